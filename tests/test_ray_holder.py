"""RefHolder with a real local Ray (issue 4, scenario 5).

What is observed is the Ray object store itself: the bytes it uses, as the
raylet reports them (``cluster_resources() - available_resources()`` of
``object_store_memory``), not the holder's own registry. Values are 4 MB, far
above Ray's inline limit (100 KB), so each one lives in the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch

from tests.test_ownership import prompt_of, response_of
from tracestore import TraceStore
from tracestore.ray import ExpertRefMissing, RefHolder, RefHolderActor

pytestmark = pytest.mark.ray

MB = 1024 * 1024
VALUE_BYTES = 4 * MB


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    # address="local": always a private Ray, never a cluster some earlier `ray start` left recorded
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * MB, log_to_driver=False
    )
    yield
    ray.shutdown()


def store_used() -> float:
    """Bytes in the Ray object store, as the raylet reports them."""
    return float(ray.cluster_resources()["object_store_memory"] - ray.available_resources().get("object_store_memory", 0))


def wait_for(cond: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.05)


def stays(cond: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not cond():
            return False
        time.sleep(0.05)
    return True


def array(seed: int) -> Any:
    return np.full(VALUE_BYTES // 4, seed, dtype=np.int32)


@pytest.fixture(autouse=True)
def empty_store() -> None:
    wait_for(lambda: store_used() < MB, what="an empty object store before the test")


@ray.remote
class Borrower:
    """Another actor that keeps lent refs until told to drop them."""

    def __init__(self) -> None:
        self.refs: list[Any] = []

    def hold(self, refs: list[Any]) -> int:
        self.refs = list(refs)
        return int(sum(ray.get(r).nbytes for r in self.refs))

    def drop(self) -> None:
        self.refs = []


def test_release_frees_the_object_store(store: TraceStore) -> None:
    store.open_sessions(["s0", "s1"], "train:1")
    store.open_session("keep", "replay")
    with RefHolder(store, reconcile_s=60) as holder:
        k0 = holder.put("s0", array(0))
        k1 = holder.put("s1", torch.full((VALUE_BYTES // 4,), 1, dtype=torch.int32))
        k2 = holder.put("keep", array(2))
        assert all(c not in k for k in (k0, k1, k2) for c in " \t{},")
        st = holder.stats()
        assert (st.sessions, st.refs, st.bytes) == (3, 3, 3 * VALUE_BYTES)
        wait_for(lambda: store_used() >= 3 * VALUE_BYTES, what="3 values in the store")

        # The key goes into the trace index like any expert key.
        m = store.lookup("s0", prompt_of("s0"))
        store.record_turn(
            "s0", prompt_of("s0"), response_of("s0"), prefix=m, delta_token_ids=[],
            response_token_ids=[2], response_logprobs=[-1.0], version=0, response_expert_key=k0,
        )
        tr = store.export_training_trace("s0", prompt_of("s0") + response_of("s0"))
        assert tr.expert_keys is not None and k0 in tr.expert_keys

        assert sorted(store.release(["s0", "s1"], "train:1", "consumed")) == ["s0", "s1"]
        wait_for(lambda: holder.stats().sessions == 1, what="the holder to drop s0 and s1")
        wait_for(lambda: store_used() <= VALUE_BYTES + MB, what="the store to free two values")
        assert store_used() >= VALUE_BYTES  # the replay-owned value stays
        for k in (k0, k1):
            with pytest.raises(ExpertRefMissing):
                holder.get([k])
        (ref,) = holder.get([k2])
        assert int(ray.get(ref)[0]) == 2
        st = holder.stats()
        assert (st.sessions, st.refs, st.bytes, st.dropped) == (1, 1, VALUE_BYTES, 2)
        assert st.events == 2
        # Every event was acknowledged by the holder's group.
        pending = store.redis.xpending(store.keys.events, holder.name)
        assert pending["pending"] == 0
        del ref
    wait_for(lambda: store_used() < MB, what="close() to drop the rest")
    # A holder without a name removes its group on close.
    assert store.redis.xinfo_groups(store.keys.events) == []


def test_lent_ref_keeps_object_alive_until_the_borrower_drops_it(store: TraceStore) -> None:
    store.open_session("s", "train:2")
    borrower = Borrower.remote()  # type: ignore[attr-defined]
    with RefHolder(store, reconcile_s=60) as holder:
        key = holder.put("s", array(7))
        assert ray.get(borrower.hold.remote(holder.get([key]))) == VALUE_BYTES
        wait_for(lambda: store_used() >= VALUE_BYTES, what="the value in the store")

        assert store.release(["s"], "train:2") == ["s"]
        wait_for(lambda: holder.stats().refs == 0, what="the holder to drop its ref")
        assert stays(lambda: store_used() >= VALUE_BYTES, 1.0), "freed while still borrowed"

        ray.get(borrower.drop.remote())
        wait_for(lambda: store_used() < MB, what="the store to free the value after the borrower dropped it")
    ray.kill(borrower)


def test_holder_started_after_events_drops_through_reconcile(store: TraceStore) -> None:
    store.open_sessions(["a", "b", "c"], "train:3")
    holder = RefHolder(store, name="late-holder", reconcile_s=60, start=False)
    try:
        for sid in ("a", "b", "c"):
            holder.put(sid, array(1))
        wait_for(lambda: store_used() >= 3 * VALUE_BYTES, what="values in the store")
        # Released while no consumer runs, and the events are gone before it starts.
        assert store.release(["a", "b"], "train:3") == ["a", "b"]
        store.redis.xtrim(store.keys.events, maxlen=0)
        holder.start()  # reconciles once at start
        assert holder.held_sessions() == ["c"]
        wait_for(lambda: store_used() <= VALUE_BYTES + MB, what="the store to free a and b")
    finally:
        holder.close(destroy_group=True)


def test_periodic_reconcile_catches_a_missed_release(store: TraceStore) -> None:
    store.open_sessions(["x", "y"], "train:4")
    # x is released before the holder exists (its event never reaches it), and
    # a producer still puts a value for x afterwards.
    store.release(["x"], "train:4", purge=False)
    # grace 2 s: "never-opened" below is surely still held 0.2 s after its put
    with RefHolder(store, reconcile_s=0.5, grace_s=2.0) as holder:
        holder.put("x", array(3))
        holder.put("y", array(4))
        assert holder.held_sessions() == ["x", "y"]
        wait_for(lambda: holder.held_sessions() == ["y"], what="reconcile to drop x")
        wait_for(lambda: store_used() <= VALUE_BYTES + MB, what="the store to free x")
        assert holder.stats().reconciles >= 2
        # A session the control plane does not know is kept for grace_s, then dropped.
        holder.put("never-opened", array(5))
        time.sleep(0.2)
        assert "never-opened" in holder.held_sessions()
        wait_for(lambda: "never-opened" not in holder.held_sessions(), what="unknown session past grace")


def test_holder_recreates_its_group_after_gc_removed_it(store: TraceStore) -> None:
    store.open_sessions(["g0", "g1"], "train:5")
    with RefHolder(store, name="comeback", reconcile_s=60, block_s=0.2) as holder:
        holder.put("g0", array(1))
        holder.put("g1", array(1))
        store.redis.xgroup_destroy(store.keys.events, "comeback")  # what gc does to an idle group
        store.release(["g0"], "train:5")
        wait_for(lambda: holder.held_sessions() == ["g1"], what="the holder to catch up")
        groups = [g["name"] for g in store.redis.xinfo_groups(store.keys.events)]
        assert [n.decode() if isinstance(n, bytes) else n for n in groups] == ["comeback"]
        store.release(["g1"], "train:5")
        wait_for(lambda: holder.held_sessions() == [], what="events flowing again")
    wait_for(lambda: store_used() < MB, what="an empty store")


def test_ready_actor(store: TraceStore, url: str) -> None:
    store.open_sessions(["w0", "w1"], "rollout:7")
    actor = RefHolderActor.remote(url, store.run_id, name="actor-holder", reconcile_s=60)
    try:
        keys = [ray.get(actor.put.remote(s, array(i))) for i, s in enumerate(["w0", "w1"])]
        refs = ray.get(actor.get.remote(keys))
        assert [int(ray.get(r)[0]) for r in refs] == [0, 1]
        wait_for(lambda: store_used() >= 2 * VALUE_BYTES, what="values in the store")
        del refs  # the trainer is done with what it borrowed
        store.release_owner("rollout:7", "done")
        wait_for(lambda: ray.get(actor.stats.remote()).sessions == 0, what="the actor's holder to drop")
        wait_for(lambda: store_used() < MB, what="the store to free the actor's values")
        with pytest.raises(ExpertRefMissing) as exc:
            ray.get(actor.get.remote(keys[:1]))
        assert exc.value.key == keys[0] and exc.value.holder == "actor-holder"
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)
