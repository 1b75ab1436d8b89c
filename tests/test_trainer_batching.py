"""Continuous batching of the reference engine (``trainer/batching.py``), in process.

What the rollout workers and the HTTP shapes rely on: a request with its
own seed gets the same tokens alone or in a batch (a lone request exactly
what ``MoEPolicy.generate`` returns), aborts end only their request, a
weight load waits for the running batch and never splits a generation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from tracestore.trainer.batching import Batcher, Job, Sampled
from tracestore.trainer.policy import (
    Generation,
    MoEPolicy,
    new_policy,
    set_determinism,
    state_to_numpy,
)
from tracestore.trainer.tokenizer import TOKENIZER

PROMPTS = [
    TOKENIZER.encode(t)
    for t in ("hello world", "use add sub mul with one digit then done", "x", "reach 3 from 1 then done", "mul 7 error")
]


@pytest.fixture
def policy() -> MoEPolicy:
    set_determinism(0)
    p = new_policy(TOKENIZER.vocab_size, seed=0, max_len=512)
    p.eval()
    return p


@pytest.fixture
def batcher(policy: MoEPolicy) -> Iterator[Batcher]:
    b = Batcher(policy, seed=0)
    yield b
    b.close()


def job(i: int, n: int, *, seed: int | None = None, temperature: float = 1.0, **kw: object) -> Job:
    return Job(
        rid=f"j{i}",
        input_ids=PROMPTS[i % len(PROMPTS)],
        max_new_tokens=n,
        temperature=temperature,
        seed=100 + i if seed is None else seed,
        experts=True,
        **kw,  # type: ignore[arg-type]
    )


def test_a_lone_request_is_exactly_policy_generate(policy: MoEPolicy, batcher: Batcher) -> None:
    for i, temperature in enumerate((1.0, 0.0, 0.7)):
        ref = policy.generate(
            PROMPTS[i], max_new_tokens=80, stop_id=[], generator=torch.Generator().manual_seed(100 + i), temperature=temperature
        )
        got = batcher.submit(job(i, 80, temperature=temperature)).result(60)
        assert got.output_ids == ref.output_ids and got.logprobs == ref.logprobs  # bitwise
        assert np.array_equal(got.routed_experts, ref.routed_experts) and got.finish_reason == "length"


def test_batched_requests_get_the_tokens_they_get_alone(batcher: Batcher) -> None:
    alone = [batcher.submit(job(i, 150)).result(60) for i in range(6)]
    together = [f.result(120) for f in [batcher.submit(job(i, 150)) for i in range(6)]]
    assert batcher.widest >= 5  # they were decoded together (each joins after its prefill)
    for a, b in zip(alone, together, strict=True):
        assert b.output_ids == a.output_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)  # float rounding of the batched step only
        assert np.array_equal(b.routed_experts, a.routed_experts)


def test_routed_experts_have_one_row_per_token_fed(batcher: Batcher) -> None:
    futs = [batcher.submit(job(i, 40 + 10 * i)) for i in range(3)]
    for i, f in enumerate(futs):
        g = f.result(60)
        # the dummy row, then every prompt token and every output token but the last
        assert g.routed_experts.shape == (len(PROMPTS[i]) + len(g.output_ids), 2, 2)
        assert not g.routed_experts[0].any()


def test_stops_end_only_their_request(batcher: Batcher) -> None:
    ref = batcher.submit(job(0, 60, temperature=0.0)).result(60).output_ids
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    text = TOKENIZER.decode([ref[k]])
    futs = [
        batcher.submit(job(0, 60, temperature=0.0, stop_ids=frozenset([ref[k]]))),
        batcher.submit(job(1, 60)),
        batcher.submit(job(0, 60, temperature=0.0, stop=(text,))),
    ]
    by_id, other, by_text = (f.result(60) for f in futs)
    assert by_id.output_ids == ref[: k + 1] and by_id.finish_reason == "stop"
    assert other.finish_reason == "length" and len(other.output_ids) == 60
    assert by_text.finish_reason == "stop" and by_text.output_ids == ref[: len(by_text.output_ids)]
    assert text in TOKENIZER.decode(by_text.output_ids) and text not in TOKENIZER.decode(by_text.output_ids[:-1])


def test_abort_of_one_mid_generation_leaves_the_others(batcher: Batcher) -> None:
    alone = {i: batcher.submit(job(i, 200)).result(60) for i in (0, 2)}
    seen: list[int] = []
    got_three = threading.Event()
    victim = job(1, 400)

    def emit(s: Sampled) -> None:
        seen.append(s.id)
        if len(seen) >= 3:
            got_three.set()

    victim.emit = emit
    futs = {0: batcher.submit(job(0, 200)), 1: batcher.submit(victim), 2: batcher.submit(job(2, 200))}
    assert got_three.wait(60)
    victim.abort.set()
    aborted = futs[1].result(60)
    assert aborted.finish_reason == "abort" and 3 <= len(aborted.output_ids) < 400
    assert aborted.output_ids == seen[: len(aborted.output_ids)]  # the ids generated so far, as streamed
    for i in (0, 2):
        g = futs[i].result(60)
        assert g.output_ids == alone[i].output_ids and g.finish_reason == "length"
    assert batcher.aborted == 1


def test_an_aborted_waiting_request_never_runs(policy: MoEPolicy) -> None:
    b = Batcher(policy, seed=0, max_batch=1)
    try:
        started = threading.Event()
        first = job(0, 300)
        first.emit = lambda s: started.set()
        f1 = b.submit(first)
        assert started.wait(60)
        waiting = job(1, 300)
        f2 = b.submit(waiting)
        waiting.abort.set()
        first.abort.set()
        g2 = f2.result(60)
        assert g2.finish_reason == "abort" and g2.output_ids == [] and g2.routed_experts.shape[0] == 1  # the dummy row
        assert f1.result(60).finish_reason == "abort"
    finally:
        b.close()


def test_max_batch_bounds_the_rows_decoded_together(policy: MoEPolicy) -> None:
    b = Batcher(policy, seed=0, max_batch=2)
    try:
        outs = [f.result(120) for f in [b.submit(job(i, 60)) for i in range(5)]]
        assert b.widest == 2 and all(len(g.output_ids) == 60 for g in outs)
    finally:
        b.close()


def test_a_weight_load_waits_for_the_batch_and_splits_no_generation(policy: MoEPolicy, batcher: Batcher) -> None:
    order: list[str] = []
    started = threading.Event()
    running = job(0, 300)

    def first_token(s: Sampled) -> None:
        if not started.is_set():
            order.append("running:token")
            started.set()

    running.emit = first_token
    f_running = batcher.submit(running)
    assert started.wait(60)
    halved = {k: torch.from_numpy(v * 0.5) for k, v in state_to_numpy(policy).items()}

    def load() -> int:
        order.append("load" if f_running.done() else "load:during-a-generation")
        policy.load_state_dict(halved)
        batcher.version = 1
        return 1

    f_load: Future[int] = batcher.call(load)
    later = job(1, 20)

    def later_token(s: Sampled) -> None:
        if "later:token" not in order:
            order.append("later:token")

    later.emit = later_token
    f_later = batcher.submit(later)  # queued after the load: it runs with the new weights
    g_running: Generation = f_running.result(60)
    assert f_load.result(60) == 1 and f_later.result(60).finish_reason == "length"
    assert order == ["running:token", "load", "later:token"]
    assert g_running.finish_reason == "length" and len(g_running.output_ids) == 300
    assert (running.version, later.version) == (0, 1)  # each generation reports the weights it ran with


def test_bad_jobs_are_refused_at_submit(batcher: Batcher) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        batcher.submit(Job(rid="e", input_ids=[], max_new_tokens=4))
    with pytest.raises(ValueError, match="leaves no room"):
        batcher.submit(Job(rid="l", input_ids=[5] * 512, max_new_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        batcher.submit(Job(rid="t", input_ids=[5], max_new_tokens=4, temperature=-1))
