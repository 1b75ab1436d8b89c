"""A weight update that lands mid-generation on a rollout worker (issue 24 item 5, DESIGN section 15).

A real :class:`~tracestore.trainer.rollout.RolloutWorker` (a Ray actor, its
``RefHolder``) serves its local agents' turns on a real store, and the test
runs the learner's side of a weight update by hand (``abort_requests``, then
``gate.weight_update`` with the push of the new weights inside, in a thread)
once the worker's token counter shows its policy generating, while it
collects the run and settles the leases handed back, as the producer does. Both weight versions are
policies whose end-of-turn token is masked, so every answer runs its whole
budget (``max_new_tokens``) and the update lands inside a generation.

In ``continue`` mode the stopped generations resume under the new weights:
every turn is recorded once at full length, and each token carries the
version of the weights that generated it, checked three ways: against the
weight version the worker's policy had on each call, against the
log-probabilities each version's weights give those tokens, and against the
routed experts (rows of the first part from the first call, the rest from
the resumed call). Staleness follows: the group's ``min_version`` is the
oldest token's, ``stale_mask`` marks the old part. In ``abort`` mode the
stopped turns are thrown away: their tokens are counted discarded and
nothing of them is recorded. With ``--agents http`` the gateway holds the
turn and the trainer reads the gateway's counters.

Whole runs (``tracestore train``, disaggregated, with
``update_mid_generation_s`` so that every weight update stops a worker right
after a token): in continue mode nothing is discarded, no episode is cut
(no aborted group, nothing claimed back) and nothing leaks; in abort mode,
side by side, tokens are discarded and cut episodes are claimed back. (A
worker that left its last leases to the producer deadlocked the drain of a
continue-mode run: ``GatePoisoned`` once those leases expired.)
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import ray
import torch

from tests.test_trainer_e2e import FAST, _check_nothing_leaked
from tracestore import Group, Trace, TraceStore
from tracestore.ray import expert_values
from tracestore.trainer.actors import kill, remote
from tracestore.trainer.config import TASK, TrainConfig
from tracestore.trainer.loop import run as train
from tracestore.trainer.policy import MoEPolicy, new_policy, state_to_numpy
from tracestore.trainer.rollout import PolicyCall, RolloutWorker, WorkerStats
from tracestore.trainer.sample import Sample
from tracestore.trainer.task import make_problem
from tracestore.trainer.tokenizer import TOKENIZER as TOK

pytestmark = pytest.mark.ray

OWNER = "rollout:test"
MAX_NEW = 160  # prompts are ~45 tokens: the budget fits max_len 256 whole
IGNORE = -100


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _never_stops(seed: int) -> MoEPolicy:
    """A policy (the rollout workers' shape) that never writes the end-of-turn token."""
    p = new_policy(TOK.vocab_size, seed=seed, max_len=256)
    with torch.no_grad():
        p.head.bias[TOK.stop_id] = -1e4
    p.eval()
    return p


@dataclass
class Rollout:
    """What one worker run with a weight update in the middle left behind."""

    cfg: TrainConfig
    samples: list[Sample]
    stats: WorkerStats
    calls: list[PolicyCall]
    unsettled: int
    worker: Any
    store: TraceStore


@pytest.fixture
def rollout(url: str, tmp_path: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """``rollout(mode)``: 4 samples on one worker, a weight update 0 -> 1 once it generates."""
    made: list[Rollout] = []

    def run(mode: str) -> Rollout:
        cfg = TrainConfig(
            url=url, run=f"t-{uuid.uuid4().hex[:10]}", out=str(tmp_path), max_new_tokens=MAX_NEW,
            on_weight_update=mode, hold_timeout_s=60.0,
        ).validate()
        store = TraceStore.connect(url, run=cfg.run)
        worker = remote(RolloutWorker, 3).remote(cfg, "w0")
        r = Rollout(cfg, [], None, [], 0, worker, store)  # type: ignore[arg-type]
        made.append(r)
        ray.get(worker.set_weights.remote(state_to_numpy(_never_stops(1)), 0))
        rng = random.Random(5)
        samples = [Sample.new(f"s{i}-{cfg.run}", make_problem(rng, f"p{i}"), 3) for i in range(4)]
        store.open_sessions([s.sid for s in samples], OWNER, version=0)
        running = worker.run_unsettled.remote(samples, 1.0)
        # the learner's order: abort, seal, drain, push, reopen; the abort lands right after the
        # policy's next token, inside the round's answers (each runs MAX_NEW tokens), in the actor
        # itself (polling the token count from here could land after the answers on a slow machine)
        ray.get(worker.abort_requests.remote(30.0))
        update = ThreadPoolExecutor(1).submit(_weight_update, store, worker)
        out, unsettled = ray.get(running)  # the producer's side: the run's results, its leases settled
        for outcome in {o for _, o in unsettled}:
            store.gate.settle_many([lease for lease, o in unsettled if o == outcome], outcome)
        update.result()
        r.samples, r.unsettled = out, len(unsettled)
        r.stats = ray.get(worker.stats.remote())
        r.calls = ray.get(worker.policy_calls.remote())
        return r

    yield run
    for r in made:
        ray.get(r.worker.close.remote())
        kill([r.worker])
        r.store.release_owner(OWNER, "test-end")
        r.store.close()


def _weight_update(store: TraceStore, worker: Any) -> None:
    """The learner's weight update 0 -> 1: seal, drain, push the new weights, install, reopen."""
    with store.gate.weight_update(1, 30.0):
        ray.get(worker.set_weights.remote(state_to_numpy(_never_stops(2)), 1))


def _generated(tr: Trace) -> tuple[list[int], list[float], list[int]]:
    """The trained tokens of a trace: positions, logprobs and versions."""
    pos = [i for i, label in enumerate(tr.labels) if label != IGNORE]
    return pos, [tr.logprobs[i] for i in pos], [tr.versions[i] for i in pos]


def test_a_generation_an_update_stops_continues_under_the_new_weights(rollout: Any) -> None:
    r: Rollout = rollout("continue")
    # no turn was lost: every episode's one turn (the answer runs out of budget) completed
    assert [s.status for s in r.samples] == ["completed"] * 4
    assert all(s.turns == 1 and s.finish == "length" for s in r.samples)
    assert r.stats.tokens_discarded == 0
    assert r.stats.turns_continued >= 1
    assert r.unsettled == 0  # continue mode settles its own leases (see run_unsettled)
    assert r.store.gate.status().live == 0
    stopped = [c for c in r.calls if c.finish == "abort" and c.tokens > 0]
    assert stopped, "the update landed between generations"
    a, b = _never_stops(1), _never_stops(2)
    mixed = 0
    for s in r.samples:
        tr = r.store.export_training_trace(s.sid, s.final_key())
        pos, lps, versions = _generated(tr)
        # full length: nothing regenerated, nothing lost
        assert len(pos) == MAX_NEW
        # each token's version is that of the weights the policy had when it generated it
        calls = [c for c in r.calls if c.sid == s.sid]
        assert all(c.lease_version == c.weight_version for c in calls)
        assert versions == [c.weight_version for c in calls for _ in range(c.tokens)]
        assert versions == sorted(versions)  # the old part first
        k = versions.count(0)
        if not 0 < k < len(versions):
            continue
        mixed += 1
        # ... and the weights of that version give those tokens the recorded logprobs
        ids = torch.tensor([tr.input_ids])
        with torch.no_grad():
            logits_a, used_a, _ = a(ids)
            logits_b, used_b, _ = b(ids)
        lp_a = torch.log_softmax(logits_a[0], -1)
        lp_b = torch.log_softmax(logits_b[0], -1)
        for j, (i, lp, v) in enumerate(zip(pos, lps, versions, strict=True)):
            want = (lp_a if v == 0 else lp_b)[i - 1, tr.input_ids[i]].item()
            assert lp == pytest.approx(want, abs=1e-3), (j, v)
        # routed experts: rows of the kept part from the first call (weights 0), the rest
        # from the resumed call (weights 1); row r is the routing of the token at r - 1
        keys = tr.expert_keys or []
        refs = ray.get(r.worker.get_refs.remote(keys))
        rows = np.concatenate([np.asarray(x) for x in expert_values(keys, refs)])
        assert rows.shape[0] == len(tr.input_ids)
        keep = pos[0] + k  # prompt + kept tokens
        assert np.array_equal(rows[1:keep], used_a[0, : keep - 1].numpy())
        assert np.array_equal(rows[keep:], used_b[0, keep - 1 : len(tr.input_ids) - 1].numpy())
        assert not np.array_equal(rows[keep:], used_a[0, keep - 1 : len(tr.input_ids) - 1].numpy())
        # staleness: the stale part is the kept one, and the group's min_version its version
        stale = tr.stale_mask(1, 0)
        assert [i for i, x in enumerate(stale) if x] == pos[:k]
        got = r.store.replay.put(Group(f"g-{s.sid}", TASK, (s.sid,), payload={}), OWNER)
        assert got.stored
        (group,) = [g for g in r.store.replay.groups(TASK) if g.gid == f"g-{s.sid}"]
        assert group.min_version == 0
    assert mixed >= 1


def test_abort_mode_throws_the_stopped_generations_away(rollout: Any) -> None:
    r: Rollout = rollout("abort")
    aborted = [s for s in r.samples if s.status == "aborted"]
    assert aborted  # the turns in flight at the update
    stopped = [c for c in r.calls if c.finish == "abort"]
    assert sum(c.tokens for c in stopped) > 0
    assert r.stats.tokens_discarded == sum(c.tokens for c in stopped)
    assert r.stats.turns_continued == 0
    for s in aborted:  # nothing of the stopped turn was recorded
        assert r.store.trace_keys(s.sid) == []


@pytest.mark.backends("valkey", "cluster")  # a gateway process per test: the store's own tests cover the backends
@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_http_agents_the_gateway_holds_and_the_report_reads_its_counters(
    url: str, tmp_path: Any, mode: str
) -> None:
    """``--agents http``: the worker's engine behind the trainer's gateway actor, one openai-SDK
    turn (no retries allowed) with a weight update landing mid-generation.

    Continue: the worker leaves its engine to the gateway (an engine abort before the seal
    would reach the gateway as a failed request), which holds the turn across the update;
    the agent gets the whole answer, its tokens of both versions, and the gateway's counters
    (what the report reads) show one turn continued, nothing discarded. Abort: the worker
    aborts its engine, the agent gets a 503 and the gateway counts the tokens discarded.
    """
    import openai

    from tracestore.trainer.gateway_actor import GatewayActor

    cfg = TrainConfig(
        url=url, run=f"t-{uuid.uuid4().hex[:10]}", out=str(tmp_path), agents="http", on_weight_update=mode,
        hold_timeout_s=60.0,
    ).validate()
    store = TraceStore.connect(url, run=cfg.run)
    worker = remote(RolloutWorker, 3).remote(cfg, "w0")
    handles = [worker]
    try:
        engine = ray.get(worker.serve_http.remote())
        ray.get(worker.set_weights.remote(state_to_numpy(_never_stops(1)), 0))
        gateway = remote(GatewayActor, 4).remote(cfg, [engine])
        handles.append(gateway)
        base = ray.get(gateway.url.remote())
        sid = f"h-{cfg.run}"

        def turn() -> Any:
            with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
                return client.chat.completions.with_raw_response.create(
                    model="tracestore-reference",
                    messages=[{"role": "user", "content": "reach 7 from 2"}],
                    max_tokens=MAX_NEW,
                    extra_headers={"X-Session-Id": sid, "X-Tracestore-Owner": OWNER},
                )

        pool = ThreadPoolExecutor(2)
        answer = pool.submit(turn)
        while ray.get(worker.stats.remote()).tokens_generated < 1:  # the engine is generating (from its first token: the longest window)
            time.sleep(0.005)
        ray.get(worker.abort_requests.remote())
        update = pool.submit(_weight_update, store, worker)
        stats: Any = None
        if mode == "continue":
            raw = answer.result(120)
            got = raw.parse()
            assert got.usage.completion_tokens == MAX_NEW  # the whole answer, nothing regenerated
            assert raw.headers["x-tracestore-versions"] == "0,1"
            update.result(60)
            stats = ray.get(gateway.stats.remote())
            assert (stats.turns_continued, stats.tokens_discarded) == (1, 0)
        else:
            with pytest.raises(openai.APIStatusError) as err:
                answer.result(120)
            assert err.value.status_code == 503
            update.result(60)
            stats = ray.get(gateway.stats.remote())
            assert stats.turns_continued == 0 and stats.tokens_discarded > 0
    finally:
        for h in handles[::-1]:
            ray.get(h.close.remote())
        kill(handles)
        store.release_owner(OWNER, "test-end")
        store.close()


# -- whole runs (tracestore train) ------------------------------------------------------------


def _run(url: str, tmp: Any, mode: str, on_weight_update: str) -> Any:
    cfg = TrainConfig(
        mode=mode, url=url, run=f"t-{uuid.uuid4().hex[:10]}", out=str(tmp), on_weight_update=on_weight_update,
        # each weight update stops a worker right after its next token: it lands mid-generation
        update_mid_generation_s=5.0, **FAST,
    )
    return train(cfg)


@pytest.mark.parametrize("server", ["standalone", "cluster"])
def test_a_disaggregated_run_in_continue_mode_discards_nothing(
    request: pytest.FixtureRequest, tmp_path: Any, server: str
) -> None:
    url = request.getfixturevalue(f"{server}_url")
    report = _run(url, tmp_path, "disaggregated", "continue")
    _check_nothing_leaked(report, url)
    assert report.on_weight_update == "continue" and report.gate_cycles == 4
    assert report.aborted_requests > 0  # the updates stopped generations in flight ...
    assert report.turns_continued > 0  # ... which went on under the new weights
    assert report.tokens_discarded == 0 < report.tokens_generated
    # no episode was cut: no aborted group, nothing to claim back
    assert report.aborted_groups_claimed == 0 and "aborted" not in report.groups
    assert report.routing_replay_fallbacks == 0


def test_abort_mode_side_by_side_throws_tokens_away(standalone_url: str, tmp_path: Any) -> None:
    report = _run(standalone_url, tmp_path, "disaggregated", "abort")
    _check_nothing_leaked(report, standalone_url)
    assert report.on_weight_update == "abort"
    assert report.tokens_discarded > 0 and report.turns_continued == 0
    assert report.aborted_groups_claimed > 0  # the cut episodes came back to be redone
