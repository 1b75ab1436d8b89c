"""The reference trainer end to end: real Ray actors, real servers, real RefHolders.

Short runs of both modes on a standalone server and on a cluster must end
with nothing leaked (no live session, no held ref, one release event per
session, nothing left in the Ray object store), the learner's training
forward with the holders' routed experts must reproduce the rollout
log-probabilities of the exported traces, a run killed after a checkpoint
must resume with consistent counts, and a bad configuration must exit with
a clear message.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from click.testing import CliRunner

from tracestore import TraceStore
from tracestore.cli import main as cli
from tracestore.servers import EmbeddedServer
from tracestore.trainer.checkpoint import load_state
from tracestore.trainer.config import ConfigError, TrainConfig
from tracestore.trainer.housekeeping import store_counts
from tracestore.trainer.loop import SimulatedCrash, run
from tracestore.trainer.report import Report

pytestmark = pytest.mark.ray

FAST: dict[str, Any] = {
    "steps": 4,
    "prompts_per_step": 2,
    "group_size": 4,
    "warmup_steps": 30,
    "eval_every": 2,
    "eval_prompts": 4,
    "checkpoint_every": 2,
    "max_buffer": 2,
}


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    # address="local": always a private Ray, never a cluster some earlier `ray start` left recorded
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(url: str, tmp: str, mode: str, **kw: Any) -> TrainConfig:
    opts = {**FAST, **kw}
    return TrainConfig(mode=mode, url=url, run=f"t-{uuid.uuid4().hex[:10]}", out=tmp, **opts)


def _check_nothing_leaked(report: Report, url: str) -> None:
    assert report.sessions_opened > 0
    assert report.sessions_leaked == 0
    assert report.sessions_released == report.sessions_opened
    assert report.release_events == report.sessions_opened
    assert report.refs_held_at_end == 0
    assert report.expert_bytes_held_at_end == 0
    assert report.object_store_bytes_at_end == 0
    assert report.poisoned_leases == 0
    assert report.invalid_responses == 0
    share = report.store_call_time_share + report.expert_put_time_share
    assert 0 < report.store_call_time_share and abs(share - report.tracestore_time_share) < 1e-9
    by_role = report.tracestore_time_share_by_role
    assert set(by_role) == {"workers", "producer", "learner"}
    assert by_role["producer"] > 0 and by_role["learner"] > 0  # with HTTP agents the gateway calls, not the workers
    assert by_role["workers"] > 0 or report.agents == "http"
    assert abs(sum(by_role.values()) - report.tracestore_time_share) < 1e-9
    assert report.violations() == []
    # no rollout failed: nobody released a session another role was still writing
    assert report.groups.get("failed", 0) == 0
    # the learner released exactly what it took, every step
    for h in report.history:
        assert h.released == h.taken == h.samples
    # the server agrees: no live session, no owner holding anything, buffer empty
    with TraceStore.connect(url, run=report.run) as store:
        assert store.sessions() == []
        assert all(o.sessions == 0 for o in store.owners())
        assert store.replay.count() == 0
        assert store.gate.status().version == report.gate_cycles
        assert store.gate.status().live == 0  # every lease settled (workers settle a round late)
        # a clean end (issue 12 item 4): every role deregistered its heartbeats, so gc will not
        # call any owner lost, and every lease receipt and retry record expires within a minute
        assert store.redis.zcard(store.keys.owners) == 0
        k, r = store.keys, store.redis
        transient = [x for x in r.scan_iter(match=k.control_pattern, count=1000)
                     if (k.control_suffix(x.decode()) or "").startswith(("gate:l:", "op:"))]
        # (-2: it expired between the scan and its PTTL)
        assert all(p == -2 or 0 < p <= 60_000 for p in (r.pttl(x) for x in transient))


# each mode once and each server once; the HTTP-agent test below runs the other two pairs
@pytest.mark.parametrize(("server", "mode"), [("standalone", "colocated"), ("cluster", "disaggregated")])
def test_short_run_leaks_nothing(
    request: pytest.FixtureRequest, tmp_path: Any, server: str, mode: str
) -> None:
    url = request.getfixturevalue(f"{server}_url")
    report = run(_cfg(url, str(tmp_path), mode))
    _check_nothing_leaked(report, url)
    assert report.gate_cycles == 4 and len(report.history) == 4
    if mode == "disaggregated":  # buffered groups' experts were in the object store mid-run
        assert report.object_store_bytes_max_seen > 0
    # continue mode (the default): no token thrown away, no episode cut by a weight update
    assert report.on_weight_update == "continue" and report.tokens_discarded == 0
    assert report.aborted_groups_claimed == 0 and "aborted" not in report.groups
    if mode == "colocated":  # nothing is in flight during a weight update
        assert report.aborted_requests == report.turns_continued == 0
    # routed experts came back from the holders for every sample (no fallback)
    assert report.routing_replay_fallbacks == 0
    assert os.path.exists(tmp_path / "report.png")
    with open(tmp_path / "report.json") as f:  # report.json is the report
        assert json.load(f) == json.loads(json.dumps(report.to_json()))


@pytest.mark.parametrize(
    ("server", "mode", "gateways"), [("standalone", "disaggregated", 1), ("cluster", "colocated", 2)]
)
def test_http_agents_through_the_gateway_leak_nothing(
    request: pytest.FixtureRequest, tmp_path: Any, server: str, mode: str, gateways: int
) -> None:
    """--agents http: openai-SDK agents with tool calls, gateway actors (one, or two sharing the
    sessions), engines on the workers."""
    url = request.getfixturevalue(f"{server}_url")
    report = run(_cfg(url, str(tmp_path), mode, agents="http", gateways=gateways))
    _check_nothing_leaked(report, url)
    assert report.agents == "http" and report.gate_cycles == 4
    assert [r for r in report.placement if r.startswith("gateway")] == ["gateway", "gateway-1"][:gateways]
    # every turn went through the gateway (evaluation too), none was given up
    assert report.gateway_requests is not None and report.gateway_requests >= report.turns > 0
    assert report.agent_turns_given_up == 0 and report.gateway_410s == 0
    # continue mode (the default): the gateway threw no token away, no episode was cut
    assert report.tokens_discarded == 0 and report.aborted_groups_claimed == 0
    assert report.gateway_overhead_p50_ms is not None and report.gateway_overhead_p50_ms > 0
    # the gateway's holder kept every turn's routed experts, and replaying them reproduces
    # the rollout log-probabilities of the engines' traces
    assert report.routing_replay_fallbacks == 0
    assert report.replay_max_abs_diff is not None and report.replay_max_abs_diff < 1e-4
    # every sample's conversation was a recorded key, or the learner's export would have
    # failed the run (PromptMismatch): the agents sent back what the gateway recorded (an
    # answer like ' mul 7' used to go back as a tool call, and the turn branched off)


def test_gc_during_a_live_run_keeps_the_counts_exact(standalone_url: str, tmp_path: Any) -> None:
    """Issue 12 items 1 and 9: gc trims events and tombstones while the trainer runs.

    Another process runs ``gc`` with no retention at all every 0.2 s during
    a disaggregated run (the consumer groups of the workers' holders still
    bound the event trimming). The trainer's accounting reads the run's
    counters, which trimming never changes: the run ends with exact counts
    and no violation (the CLI exits 0 exactly then).
    """
    cfg = _cfg(standalone_url, str(tmp_path), "disaggregated")
    stop = threading.Event()
    reports: list[Any] = []

    def collector() -> None:
        with TraceStore.connect(standalone_url, run=cfg.run) as st:
            while not stop.is_set():
                reports.append(st.gc(tombstone_retention_s=0, event_retention_s=0))
                time.sleep(0.2)

    t = threading.Thread(target=collector)
    t.start()
    try:
        report = run(cfg)
    finally:
        stop.set()
        t.join()
    # gc did trim what the old accounting counted (tombstones and events) during the run
    assert sum(r.tombstones_trimmed for r in reports) > 0
    assert sum(r.events_trimmed for r in reports) > 0
    assert report.violations() == []
    _check_nothing_leaked(report, standalone_url)
    with TraceStore.connect(standalone_url, run=cfg.run) as store:
        st = store.stats()
        assert (st.sessions_opened, st.sessions_released, st.release_events) == (
            report.sessions_opened, report.sessions_opened, report.sessions_opened
        )
        assert st.turns_recorded > 0 and st.groups_taken > 0
        # the server's own structures were trimmed below those counts
        assert store.redis.zcard(store.keys.released) < st.sessions_released


def test_routing_replay_reproduces_rollout_logprobs(standalone_url: str, tmp_path: Any) -> None:
    """Colocated with a sync every 2 steps: odd steps train on traces of the current weights.

    For those, the learner's forward over the exported ``input_ids`` with the
    routed experts fetched from the workers' holders (split per node by the
    recorder, concatenated, dummy row dropped) gives back the rollout
    log-probabilities: tokens, labels, logprobs and experts line up.
    """
    report = run(_cfg(standalone_url, str(tmp_path), "colocated", sync_every=2))
    diffs = [h.replay_max_abs_diff for h in report.history if h.step % 2 == 1]
    assert diffs and all(d is not None for d in diffs)
    assert max(diffs) < 5e-5
    assert report.routing_replay_fallbacks == 0


def test_reward_improves_over_a_fixed_seed_run(standalone_url: str, tmp_path: Any) -> None:
    """Default task and policy, fixed seed, 8 colocated steps: the evaluation reward rises.

    The evaluation (32 fixed problems, temperature 0.5) of the warm-started
    policy is compared with the one after RL; the margin is well below the
    gain of the reference run (0.147 -> 0.258 here; 0.38 after 24 steps in
    docs/benchmarks/trainer.md).
    """
    cfg = TrainConfig(
        mode="colocated",
        steps=8,
        eval_every=8,
        checkpoint_every=8,
        seed=0,
        url=standalone_url,
        run=f"t-{uuid.uuid4().hex[:10]}",
        out=str(tmp_path),
    )
    report = run(cfg)
    assert report.eval_reward_last is not None and report.eval_reward_before is not None
    assert report.eval_reward_last >= report.eval_reward_before + 0.05, report.history
    _check_nothing_leaked(report, standalone_url)


def test_resume_after_kill_following_checkpoint(cluster_url: str, tmp_path: Any) -> None:
    """Disaggregated, killed right after the checkpoint of step 2 while the producer is busy.

    The killed processes leave sessions (in flight, producer-held, buffered)
    and possibly a lease in flight; the resumed run releases what dead owners
    hold, waits out and clears their leases, continues at step 3 and ends
    with the counts of one consistent run.
    """
    # short, so that the resumed run's wait for the dead leases is short; longer than one
    # producer round on a busy machine (a worker's last leases live until the producer's put)
    kw = {"lease_ttl_s": 5.0}
    with pytest.raises(SimulatedCrash) as crash:
        run(_cfg(cluster_url, str(tmp_path), "disaggregated", crash_after_step=2, **kw))
    assert crash.value.step == 2 and len(crash.value.history) == 2
    state = load_state(TrainConfig(out=str(tmp_path)))
    assert state is not None and state.step == 2
    run_id = state.cfg.run
    with TraceStore.connect(cluster_url, run=run_id) as store:
        assert store.sessions()  # the killed processes left sessions behind
    # resume: the new default run id is ignored, the checkpoint's is used
    report = run(_cfg(cluster_url, str(tmp_path), "disaggregated", resume=True, **kw))
    assert report.run == run_id and report.resumed_from_step == 2
    assert not report.store_restored  # the server kept its state: reclaimed, not restored
    assert [h.step for h in report.history] == [1, 2, 3, 4]
    assert report.steps_this_process == 2
    assert report.gate_cycles == 4
    _check_nothing_leaked(report, cluster_url)


def test_resume_on_a_fresh_server_restores_the_store_checkpoint(
    standalone_url: str, tmp_path: Any
) -> None:
    """The server is lost too: the run resumes on an empty server from ``store.ckpt``.

    Restored traces keep their tokens; their expert keys are marked lost (the
    Ray objects died with the workers), so those samples train without
    routing replay, and the counts continue from the checkpoint's.
    """
    kw = {"lease_ttl_s": 2.0}
    with pytest.raises(SimulatedCrash) as crash:
        run(_cfg(standalone_url, str(tmp_path), "colocated", crash_after_step=2, **kw))
    assert crash.value.step == 2
    state = load_state(TrainConfig(out=str(tmp_path)))
    assert state is not None
    run_id = state.cfg.run
    with TraceStore.connect(standalone_url, run=run_id) as old:
        before = store_counts(old).opened  # colocated: nothing ran after the checkpoint
    fresh = EmbeddedServer().start()
    try:
        report = run(_cfg(fresh.url, str(tmp_path), "colocated", resume=True, **kw))
        assert report.store_restored and report.resumed_from_step == 2
        # the restored sessions and tombstones count, then this process's own
        new = sum(report.groups.values()) * FAST["group_size"]
        assert report.sessions_opened >= before + new
        assert [h.step for h in report.history] == [1, 2, 3, 4]
        _check_nothing_leaked(report, fresh.url)
    finally:
        fresh.stop()


def _cli(*args: str) -> Any:
    return CliRunner().invoke(cli, ["train", *args])


def test_bad_configuration_is_refused_with_a_clear_message(tmp_path: Any) -> None:
    r = _cli("--mode", "sideways", "--steps", "1")
    assert r.exit_code == 2 and "unknown mode 'sideways'" in r.output
    r = _cli("--steps", "0")
    assert r.exit_code == 2 and "--steps must be at least 1" in r.output
    r = _cli("--url", "redis://127.0.0.1:1", "--steps", "1", "--out", str(tmp_path))
    assert r.exit_code == 3  # the store is unreachable: exit 3, one line, the reason once
    assert "error: cannot reach the store at redis://127.0.0.1:1: Connection refused\n" in r.output
    r = _cli("--run", "a/b")
    assert r.exit_code == 2 and "--run 'a/b' is not a run id" in r.output
    r = _cli("--sync-every", "0")
    assert r.exit_code == 2 and "--sync-every must be at least 1" in r.output
    r = _cli("--prompts-per-step", "0")
    assert r.exit_code == 2 and "--prompts-per-step must be at least 1, got 0" in r.output
    r = _cli("--gateways", "2", "--agents", "local")
    assert r.exit_code == 2 and "--gateways 2 only applies with --agents http" in r.output
    r = _cli("--gateways", "0", "--agents", "http")
    assert r.exit_code == 2 and "--gateways must be at least 1, got 0" in r.output
    r = _cli("--group-size", "1")
    assert r.exit_code == 2 and "--group-size must be at least 2 (GRPO compares samples of a prompt), got 1" in r.output
    r = _cli("--resume", "--out", str(tmp_path / "nothing"))
    assert r.exit_code == 2 and "no checkpoint" in r.output
    r = _cli("--on-weight-update", "drop")
    assert r.exit_code == 2 and "'drop' is not one of 'continue', 'abort'" in r.output
    with pytest.raises(ConfigError, match="unknown --on-weight-update 'drop'"):
        TrainConfig(on_weight_update="drop").validate()
