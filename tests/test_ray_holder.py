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
from tracestore.errors import InvalidId, InvalidInput
from tracestore.ray import ExpertRefMissing, RefHolder, RefHolderActor, expert_index, expert_values

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
        values = [ray.get(r) for r in self.refs]  # a put_many ref's value is a list of arrays
        return int(sum(sum(x.nbytes for x in v) if isinstance(v, list) else v.nbytes for v in values))

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
        # the consumer counts a batch of events after its drops, and acknowledges them after that
        wait_for(lambda: holder.stats().events == 2, what="the holder to count both events")
        st = holder.stats()
        assert (st.sessions, st.refs, st.bytes, st.dropped) == (1, 1, VALUE_BYTES, 2)
        # Every event was acknowledged by the holder's group.
        wait_for(
            lambda: store.redis.xpending(store.keys.events, holder.name)["pending"] == 0,
            what="the holder to acknowledge both events",
        )
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
        # x was taken (not refused as late); a reconcile may already have dropped it
        assert holder.stats().late == 0 and "y" in holder.held_sessions()
        wait_for(lambda: holder.held_sessions() == ["y"], what="reconcile to drop x")
        wait_for(lambda: store_used() <= VALUE_BYTES + MB, what="the store to free x")
        # (a reconcile is counted after its drops)
        wait_for(lambda: holder.stats().reconciles >= 2, what="a periodic reconcile to be counted")
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


# -- put_many: one ray.put for many sessions' values, a shared ref per call -------------------


def test_put_many_shares_one_ref_until_its_last_session_is_released(store: TraceStore) -> None:
    store.open_sessions(["m0", "m1", "m2"], "train:6")
    with RefHolder(store, reconcile_s=60) as holder:
        keys = holder.put_many([("m0", array(0)), ("m1", array(1)), ("m0", array(2)), ("m2", array(3))])
        assert [expert_index(k) for k in keys] == [0, 1, 2, 3]
        assert len({k.rsplit(".", 1)[0] for k in keys}) == 1  # one object for all
        assert all(c not in k for k in keys for c in " \t{},") and all(len(k) <= 512 for k in keys)
        st = holder.stats()
        assert (st.sessions, st.refs, st.keys, st.bytes) == (3, 1, 4, 4 * VALUE_BYTES)
        wait_for(lambda: store_used() >= 4 * VALUE_BYTES, what="the shared object in the store")
        assert [int(v[0]) for v in holder.values(keys)] == [0, 1, 2, 3]

        # one session's release removes its keys, not the object the others still use
        assert store.release(["m0"], "train:6") == ["m0"]
        wait_for(lambda: holder.held_sessions() == ["m1", "m2"], what="the holder to see m0's release")
        st = holder.stats()
        assert (st.refs, st.keys, st.dropped) == (1, 2, 0)
        with pytest.raises(ExpertRefMissing):
            holder.get([keys[0]])
        assert [int(v[0]) for v in holder.values([keys[3], keys[1]])] == [3, 1]
        assert stays(lambda: store_used() >= 4 * VALUE_BYTES, 0.5), "freed while m1 and m2 still use it"

        # the last two go: the shared ref is dropped once, and the store frees it
        assert sorted(store.release(["m1", "m2"], "train:6")) == ["m1", "m2"]
        wait_for(lambda: holder.stats().refs == 0, what="the holder to drop the shared ref")
        # (a batch of events is counted after its drops)
        wait_for(lambda: holder.stats().events == 3, what="the holder to count the three events")
        st = holder.stats()
        assert (st.sessions, st.keys, st.bytes, st.dropped, st.events) == (0, 0, 0, 1, 3)
        wait_for(lambda: store_used() < MB, what="the store to free the shared object")
        assert holder.drop(["m0", "m1", "m2"]) == 0  # never twice
        assert holder.stats().dropped == 1


# -- keep: held in process, put when lent (the gateway's path) ----------------------------------


def test_keep_puts_nothing_until_a_lend_puts_the_lent_values_in_one_object(store: TraceStore) -> None:
    store.open_sessions(["k0", "k1", "k2"], "train:8")
    with RefHolder(store, reconcile_s=60) as holder:
        keys = [holder.keep("k0", array(0)), holder.keep("k1", array(1)), holder.keep("k0", array(2))]
        other = holder.keep("k2", array(3))
        assert [expert_index(k) for k in keys] == [None, None, None] and len({*keys, other}) == 4
        st = holder.stats()
        assert (st.sessions, st.refs, st.kept, st.keys, st.bytes) == (3, 4, 4, 4, 4 * VALUE_BYTES)
        assert stays(lambda: store_used() < MB, 0.3), "keep put something into the object store"

        # one lend: the three values in ONE object, each key named by its ref; k2's stays kept
        refs = holder.get(keys)
        assert len(set(refs)) == 1
        wait_for(lambda: store_used() >= 3 * VALUE_BYTES, what="the lent object in the store")
        assert stays(lambda: store_used() < 4 * VALUE_BYTES, 0.3), "the unlent value was put too"
        st = holder.stats()
        assert (st.refs, st.kept, st.keys, st.bytes) == (2, 1, 4, 4 * VALUE_BYTES)
        assert [int(v[0]) for v in expert_values(keys, refs)] == [0, 1, 2]
        # lent again (another borrower, a re-read): the same object, nothing put twice
        again = holder.get([keys[2], keys[0]])
        assert again == [refs[0], refs[0]] and [int(v[0]) for v in expert_values([keys[2], keys[0]], again)] == [2, 0]
        assert [int(v[0]) for v in holder.values([other, keys[1]])] == [3, 1]  # lends k2's now
        assert holder.stats().kept == 0
        del refs, again

        # k0's release keeps the object k1 still uses; k1's frees it, once
        assert store.release(["k0"], "train:8") == ["k0"]
        wait_for(lambda: holder.held_sessions() == ["k1", "k2"], what="the holder to see k0's release")
        with pytest.raises(ExpertRefMissing):
            holder.get([keys[0]])
        assert [int(v[0]) for v in holder.values([keys[1]])] == [1]
        assert sorted(store.release(["k1", "k2"], "train:8")) == ["k1", "k2"]
        wait_for(lambda: holder.stats().refs == 0, what="the holder to drop everything")
        st = holder.stats()
        assert (st.sessions, st.keys, st.bytes, st.kept, st.dropped) == (0, 0, 0, 0, 2)
        wait_for(lambda: store_used() < MB, what="the store to free the lent objects")
        # a late keep for a released session: a key, nothing kept
        assert holder.keep("k1", array(4)) and holder.stats().late == 1 and holder.stats().refs == 0


def test_a_kept_value_released_before_any_lend_never_reaches_the_store(store: TraceStore) -> None:
    store.open_sessions(["q0"], "train:9")
    holder = RefHolder(store, name="keep-reconcile", reconcile_s=60, start=False)
    try:
        key = holder.keep("q0", array(5))
        assert store.release(["q0"], "train:9") == ["q0"]
        assert holder.reconcile() == 1
        st = holder.stats()
        assert (st.refs, st.kept, st.bytes, st.dropped) == (0, 0, 0, 1)
        with pytest.raises(ExpertRefMissing):
            holder.get([key])
        assert stays(lambda: store_used() < MB, 0.3)
    finally:
        holder.close(destroy_group=True)


def test_put_many_ref_dropped_by_reconcile_and_refused_for_released_sessions(store: TraceStore) -> None:
    store.open_sessions(["r0", "r1", "r2"], "train:7")
    holder = RefHolder(store, name="many-reconcile", reconcile_s=60, start=False)
    try:
        k = holder.put_many([("r0", array(0)), ("r1", array(1))])
        k2 = holder.put_many([("r1", array(2)), ("r2", array(3))])
        assert holder.stats().refs == 2
        # released while no consumer runs, the events gone: reconcile catches them
        assert sorted(store.release(["r0", "r1"], "train:7")) == ["r0", "r1"]
        store.redis.xtrim(store.keys.events, maxlen=0)
        assert holder.reconcile() == 1  # the first object (r0, r1); the second still has r2
        st = holder.stats()
        assert (st.sessions, st.refs, st.keys, st.bytes, st.dropped) == (1, 1, 1, VALUE_BYTES * 2, 1)
        assert [int(v[0]) for v in holder.values([k2[1]])] == [3]
        for key in (*k, k2[0]):
            with pytest.raises(ExpertRefMissing):
                holder.get([key])
        wait_for(lambda: store_used() <= 2 * VALUE_BYTES + MB, what="the store to free the first object")

        # a late put for a released session: keys, but nothing kept for it
        late = holder.put_many([("r0", array(4)), ("r2", array(5)), ("r1", array(6))])
        assert len(set(late)) == 3 and expert_index(late[1]) == 0
        st = holder.stats()
        assert (st.refs, st.keys, st.late, st.bytes) == (2, 2, 2, 3 * VALUE_BYTES)
        for key in (late[0], late[2]):
            with pytest.raises(ExpertRefMissing):
                holder.get([key])
        only_late = holder.put_many([("r0", array(7))])
        assert holder.stats().refs == 2 and holder.stats().late == 3 and expert_index(only_late[0]) is None
        assert holder.put("r1", array(8)) and holder.stats().late == 4  # put refuses it the same way

        assert store.release(["r2"], "train:7") == ["r2"]
        assert holder.reconcile() == 2
        st = holder.stats()
        assert (st.sessions, st.refs, st.keys, st.bytes, st.dropped) == (0, 0, 0, 0, 3)
        wait_for(lambda: store_used() < MB, what="an empty store")
    finally:
        holder.close(destroy_group=True)


def test_lent_shared_ref_outlives_the_holder_until_the_borrower_drops_it(store: TraceStore) -> None:
    store.open_sessions(["b0", "b1"], "train:8")
    borrower = Borrower.remote()  # type: ignore[attr-defined]
    with RefHolder(store, reconcile_s=60) as holder:
        keys = holder.put_many([("b0", array(1)), ("b1", array(2))])
        refs = holder.get(keys)
        assert refs[0] == refs[1]  # one shared ref, lent once per key
        assert ray.get(borrower.hold.remote(refs[:1])) == 2 * VALUE_BYTES  # the whole list
        del refs
        assert sorted(store.release(["b0", "b1"], "train:8")) == ["b0", "b1"]
        wait_for(lambda: holder.stats().refs == 0, what="the holder to drop the shared ref")
        assert stays(lambda: store_used() >= 2 * VALUE_BYTES, 1.0), "freed while still borrowed"
        ray.get(borrower.drop.remote())
        wait_for(lambda: store_used() < MB, what="the store to free it after the borrower dropped it")
    ray.kill(borrower)


def test_expert_values_one_get_per_distinct_ref_and_bad_keys(store: TraceStore) -> None:
    store.open_sessions(["v0", "v1"], "train:9")
    with RefHolder(store, name="vals", reconcile_s=60) as holder:
        single = holder.put("v0", array(9))
        shared = holder.put_many([("v0", array(1)), ("v1", array(2))])
        keys = [shared[1], single, shared[0], shared[1]]
        assert [int(v[0]) for v in expert_values(keys, holder.get(keys))] == [2, 9, 1, 2]
        assert expert_index(single) is None and single == "rx:vals:1" and shared[0] == "rx:vals:2.0"
        for bad in ("lost:rx:vals:1", "rx:vals:x", "rx:va ls:1", "rx:vals:1.2.3"):
            with pytest.raises(InvalidInput):
                expert_index(bad)
        with pytest.raises(InvalidInput):
            expert_values(keys, holder.get(keys)[:2])
        with pytest.raises(InvalidInput):
            holder.put_many([("v0", array(1), 3)])  # type: ignore[list-item]
        with pytest.raises(InvalidId):
            holder.put_many([("v0", array(1)), ("bad id", array(2))])
        assert holder.stats().refs == 2  # nothing put for a refused call
        assert holder.put_many([]) == []


def test_ready_actor_put_many(store: TraceStore, url: str) -> None:
    store.open_sessions(["a0", "a1"], "rollout:8")
    actor = RefHolderActor.remote(url, store.run_id, name="actor-many", reconcile_s=60)
    try:
        keys = ray.get(actor.put_many.remote([("a0", array(5)), ("a1", array(6))]))
        assert [int(v[0]) for v in expert_values(keys, ray.get(actor.get.remote(keys)))] == [5, 6]
        store.release_owner("rollout:8", "done")
        wait_for(lambda: ray.get(actor.stats.remote()).refs == 0, what="the actor's holder to drop")
        wait_for(lambda: store_used() < MB, what="the store to free the actor's object")
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)
