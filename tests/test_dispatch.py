"""The trainer's WorkerPool against real Ray actors and a real store (trainer/dispatch.py).

``run_unsettled`` has each worker hand back the leases of its last round for
the caller to settle in a round trip it makes anyway. When one worker's call
raises, the leases the others handed back must still be settled: left in
flight, they would expire into poison and hold the next weight update.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tracestore import TraceStore
from trainer.dispatch import WorkerPool, WorkersLost

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    # address="local": always a private Ray, never a cluster some earlier `ray start` left recorded
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote
class _Worker:
    """A rollout worker reduced to what the pool calls: one lease per session, handed back."""

    def __init__(self, url: str, run: str, name: str, fail: bool) -> None:
        self.store = TraceStore.connect(url, run=run)
        self.name, self.fail = name, fail

    def run_unsettled(self, sids: list[str], temperature: float) -> tuple[list[str], list[tuple[Any, str]]]:
        if self.fail:
            raise ValueError(f"{self.name}: the policy crashed")
        leases = [self.store.gate.admit(sid, self.name, 60) for sid in sids]
        return sids, [(lease, "completed") for lease in leases]


def _pool(url: str, run: str, failing: set[str]) -> WorkerPool:
    names = ["w0", "w1", "w2"]
    workers = {w: _Worker.remote(url, run, w, w in failing) for w in names}  # type: ignore[attr-defined]
    return WorkerPool(TraceStore.connect(url, run=run), workers)


def test_a_failing_worker_does_not_strand_the_others_leases(standalone_url: str) -> None:
    run = f"d-{uuid.uuid4().hex[:8]}"
    pool = _pool(standalone_url, run, failing={"w1"})
    by_worker = {"w0": ["a", "b"], "w1": ["c"], "w2": ["d"]}
    with pytest.raises(Exception, match="the policy crashed") as ei:
        pool.run_unsettled(by_worker)  # type: ignore[arg-type]
    assert not getattr(ei.value, "__notes__", None)  # one worker failed, the settle succeeded
    status = pool.store.gate.status()
    assert status.live == 0  # w0's and w2's three leases were settled, not left to expire
    assert sorted(pool.workers) == ["w0", "w1", "w2"]  # an error is not a lost worker


def test_every_failure_is_reported_and_the_first_raised(standalone_url: str) -> None:
    run = f"d-{uuid.uuid4().hex[:8]}"
    pool = _pool(standalone_url, run, failing={"w0", "w2"})
    with pytest.raises(Exception, match="w0: the policy crashed") as ei:
        pool.run_unsettled({"w0": ["a"], "w1": ["b"], "w2": ["c"]})  # type: ignore[arg-type]
    notes = getattr(ei.value, "__notes__", [])
    assert len(notes) == 1 and "w2: the policy crashed" in notes[0]
    assert pool.store.gate.status().live == 0  # w1's lease settled


def test_without_a_failure_the_leases_come_back_to_settle(standalone_url: str) -> None:
    run = f"d-{uuid.uuid4().hex[:8]}"
    pool = _pool(standalone_url, run, failing=set())
    out, settles = pool.run_unsettled({"w0": ["a"], "w2": ["b", "c"]})  # type: ignore[arg-type]
    assert out == {"w0": ["a"], "w2": ["b", "c"]}
    assert pool.store.gate.status().live == 3  # in flight until the caller settles them
    pool.store.gather(*settles)
    assert pool.store.gate.status().live == 0


def test_the_router_ops_outlive_the_last_worker_so_cleanup_can_retire(standalone_url: str) -> None:
    """A role's cleanup retires its sessions' routes after the run raised WorkersLost: the
    pool's router operations must still be usable (evaluation's finally ran retire on an empty scope,
    and its InvalidInput replaced the WorkersLost)."""
    run = f"d-{uuid.uuid4().hex[:8]}"
    pool = _pool(standalone_url, run, failing=set())
    assert pool.router.acquire_many(["s1"])[0] in pool.workers
    with pytest.raises(WorkersLost):
        for w in list(pool.workers):
            pool.lose(w)
    assert pool.store.gather(pool.router_ops.retire(["s1"])) == (["s1"],)
