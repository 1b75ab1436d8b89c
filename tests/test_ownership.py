"""Ownership and release on every backend (DESIGN section 5; issue 4 scenarios 1-4, 6, 7).

Real servers, real threads and a real second process; no mocks. Session data
is written through the data plane (``lookup`` + ``record_turn``), so "data
intact" and "data purged" are checked on real keys.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import orjson
import pytest
import redis

from tests._netcut import CutProxy, proxied_cluster
from tests.conftest import _selected, connect_async
from tests.test_gate import dump_run
from tracestore import InvalidId, InvalidInput, SessionReleased, TraceStore
from tracestore.errors import OwnerLost
from tracestore.io import SyncIO
from tracestore.replies import text
from tracestore.scripts import Eval, script
from tracestore.store import AsyncTraceStore

HERE = Path(__file__).resolve().parent


# -- helpers --------------------------------------------------------------------------


def prompt_of(sid: str) -> str:
    return f"<user>question of {sid}</user>"


def response_of(sid: str) -> str:
    return f"<assistant>answer of {sid}</assistant>"


def write_turn(store: TraceStore, sid: str) -> None:
    """One real turn through the data plane (same shape as tests/_producer_proc.py)."""
    m = store.lookup(sid, prompt_of(sid))
    store.record_turn(
        sid,
        prompt_of(sid),
        response_of(sid),
        prefix=m,
        delta_token_ids=[1, 2, 3, 4],
        response_token_ids=[5, 6, 7],
        response_logprobs=[-0.5, -0.25, -0.125],
        version=1,
    )


def data_intact(store: TraceStore, sid: str) -> bool:
    tr = store.export_training_trace(sid, prompt_of(sid) + response_of(sid))
    return list(tr.input_ids) == [1, 2, 3, 4, 5, 6, 7]


def data_purged(store: TraceStore, sid: str) -> bool:
    k = store.keys
    r = store.redis
    return not any(r.exists(key) for key in k.data_keys(sid)) and bool(r.exists(k.dead(sid)))


def events(store: TraceStore) -> list[dict[str, str]]:
    """Every release event of the run (XRANGE of ts:{R}:events)."""
    raw = store.redis.xrange(store.keys.events, "-", "+")
    return [{text(a): text(b) for a, b in fields.items()} for _id, fields in raw]



def offline_twin(store: TraceStore) -> TraceStore:
    """The same run and context over a client whose every I/O fails (nothing listens)."""
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    dead = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    return TraceStore(SyncIO(dead, cluster=False), store.context, f"redis://127.0.0.1:{port}")


# -- scenario 7: bad input ---------------------------------------------------------------


def test_wrong_owner_returns_nothing_and_changes_nothing(store: TraceStore) -> None:
    sids = ["a", "b", "c"]
    store.open_sessions(sids, "rollout:0")
    for s in sids:
        write_turn(store, s)
    before = store.session_states(sids)

    assert store.release(sids, "train:1", "consumed") == []
    assert store.release_owner("train:1") == []
    assert store.transfer(sids, "train:1", "eval:1") == []
    assert store.release(["unknown-1", "unknown-2"], "rollout:0") == []

    assert store.session_states(sids) == before
    assert store.sessions("rollout:0") == sids
    assert events(store) == []
    assert all(data_intact(store, s) for s in sids)
    assert not store.redis.exists(store.keys.released)

    # Unknown ids among owned ones are ignored; the owned ones go.
    assert store.release(["zz", "b", "yy"], "rollout:0") == ["b"]
    assert [e["sid"] for e in events(store)] == ["b"]
    assert data_purged(store, "b") and data_intact(store, "a")


@pytest.mark.parametrize(
    "bad", ["", "has space", "brace{", "x}", "tab\t", "é", "a" * 201, None, 7]
)
def test_invalid_ids_raise_before_any_io(store: TraceStore, bad: Any) -> None:
    store.open_session("ok", "rollout:0")
    off = offline_twin(store)  # any I/O on it raises StorageError, not InvalidId
    calls = [
        lambda s: s.release([bad], "rollout:0"),
        lambda s: s.release(["ok", bad], "rollout:0"),
        lambda s: s.release(["ok"], bad),
        lambda s: s.release(["ok"], "rollout:0", bad),
        lambda s: s.release_owner(bad),
        lambda s: s.transfer(["ok", bad], "rollout:0", "replay"),
        lambda s: s.transfer(["ok"], "rollout:0", bad),
        lambda s: s.transfer(["ok"], bad, "replay"),
        lambda s: s.open_session(bad, "rollout:0"),
        lambda s: s.open_session("new", bad),
        lambda s: s.open_sessions(["n1", bad], "rollout:0"),
        lambda s: s.owner_of(bad),
        lambda s: s.sessions(bad or ""),  # sessions(None) means every owner
        lambda s: s.heartbeat(bad, 10),
    ]
    for call in calls:
        with pytest.raises(InvalidId):
            call(off)
        with pytest.raises(InvalidId):
            call(store)
    off.redis.close()
    assert store.sessions("rollout:0") == ["ok"]
    assert events(store) == []
    # A single string is not taken for a list of ids.
    with pytest.raises(InvalidId):
        store.release("ok", "rollout:0")  # type: ignore[arg-type]


def test_released_id_cannot_be_reopened_and_data_writes_fail(store: TraceStore) -> None:
    store.open_session("s", "train:1")
    write_turn(store, "s")
    assert store.release(["s"], "train:1", "consumed") == ["s"]
    assert store.owner_of("s") is None
    with pytest.raises(SessionReleased):
        store.open_session("s", "rollout:0")
    with pytest.raises(SessionReleased):
        write_turn(store, "s")
    assert store.release(["s"], "train:1") == []
    assert len(events(store)) == 1


def test_open_sessions_with_a_released_id_opens_none_of_the_batch(store: TraceStore) -> None:
    """The batch form refuses a released id like ``open_session`` does, and writes nothing.

    Guard: the released check of lua/open_sessions.lua (issue 18 item 1: without it a
    released id was reopened and no test noticed).
    """
    store.open_sessions(["r1", "r2"], "train:1")
    write_turn(store, "r1")
    assert store.release(["r1", "r2"], "train:1", "consumed") == ["r1", "r2"]
    store.open_session("live", "rollout:0")
    before = dump_run(store)

    for batch in (["n1", "r1", "n2"], ["r2"], ["n1", "n2", "n3", "r2"], ["r1", "r2"]):
        with pytest.raises(SessionReleased) as exc:
            store.open_sessions(batch, "rollout:0")
        assert exc.value.sid == next(s for s in batch if s.startswith("r"))
        assert dump_run(store) == before  # nothing opened, nothing else written
    assert store.session_states(["n1", "n2", "n3", "r1", "r2"]) == {
        "n1": None,
        "n2": None,
        "n3": None,
        "r1": ("", "released"),
        "r2": ("", "released"),
    }
    assert store.sessions("rollout:0") == ["live"]
    with pytest.raises(SessionReleased):
        write_turn(store, "r1")  # still released: the refused open did not revive its data
    assert [e["sid"] for e in events(store)] == ["r1", "r2"]

    # Nothing half-written: the same batch without the released id opens in full.
    assert store.open_sessions(["n1", "n2"], "rollout:0") == 2
    assert store.sessions("rollout:0") == ["live", "n1", "n2"]


def test_open_sessions_is_all_or_nothing_per_chunk_of_4000(store: TraceStore) -> None:
    """The documented limit of the batch form: each chunk of 4,000 ids is one atomic script.

    A released id in the second chunk refuses that whole chunk (SessionReleased) while the
    first chunk, a separate script, is opened.
    """
    chunk = script("open_sessions").chunk
    assert chunk == 4000
    store.open_session("gone", "train:1")
    store.release(["gone"], "train:1")
    first = [f"c1-{i:04d}" for i in range(chunk)]
    second = [f"c2-{i:04d}" for i in range(10)]
    with pytest.raises(SessionReleased) as exc:
        store.open_sessions([*first, *second[:5], "gone", *second[5:]], "rollout:0")
    assert exc.value.sid == "gone"
    assert store.sessions("rollout:0") == first
    states = store.session_states(second)
    assert all(states[s] is None for s in second)


def test_a_released_session_keeps_only_its_tombstone(store: TraceStore, store_factory: Any) -> None:
    """Issue 17: the session hash goes with the release; the tombstone alone keeps every
    invariant: released once, one event, no reopen, no admission, SessionReleased for writes
    once purged, nothing resurrected by a late write."""
    r, k = store.redis, store.keys
    store.open_session("s", "rollout:0", version=3, group="g-9")
    opened_ms = int(r.hget(k.session("s"), "opened_ms"))
    write_turn(store, "s")
    m = store.lookup("s", prompt_of("s") + response_of("s") + "<user>more</user>")  # a turn in flight
    store.transfer(["s"], "rollout:0", "train:1")
    assert store.release(["s"], "train:1", "consumed") == ["s"]

    # control plane: no hash, no owner-set member; the tombstone (at the event's time) and one event
    assert not r.exists(k.session("s")) and not r.sismember(k.owner("train:1"), "s")
    ((_, ev),) = r.xrange(k.events)
    assert {text(a): text(b) for a, b in ev.items()} == {
        "sid": "s", "owner": "train:1", "reason": "consumed", "ms": text(ev[b"ms"]),
    }
    assert r.zscore(k.released, "s") == float(ev[b"ms"]) >= opened_ms
    assert store.session_states(["s"]) == {"s": ("", "released")}
    # data plane: purged, only the data tombstone is left
    assert [key for key in (k.idx("s"), k.tok("s"), k.txt("s"), k.dead("s")) if r.exists(key)] == [k.dead("s")]

    # every invariant still holds, from this client and another one
    other = store_factory()
    for st in (store, other):
        assert st.release(["s"], "train:1") == [] and st.release_owner("train:1") == []
        with pytest.raises(SessionReleased):
            st.open_session("s", "train:1")
        with pytest.raises(SessionReleased):
            st.open_sessions(["new", "s"], "train:1")
        with pytest.raises(SessionReleased):
            st.gate.admit("s", "w", 5)
        with pytest.raises(SessionReleased):  # the late write of the turn that was in flight
            st.record_turn(
                "s", prompt_of("s") + response_of("s") + "<user>more</user>", "<assistant>late</assistant>",
                prefix=m, delta_token_ids=[8], response_token_ids=[9], response_logprobs=[-1.0], version=1,
            )
        with pytest.raises(SessionReleased):
            write_turn(st, "s")
    assert not r.exists(k.idx("s")) and not r.exists(k.session("s"))
    assert r.xlen(k.events) == 1 and store.stats().sessions_released == 1
    assert store.sessions() == [] and store.owners() == []  # an empty owner set is no key


def test_the_release_script_releases_a_repeated_id_once(store: TraceStore) -> None:
    """The client deduplicates; the script does not rely on it (ownership is read once per
    batch and written at the end, so a repeated id must not pass twice)."""
    store.open_sessions(["a", "b"], "train:1")
    k = store.keys
    ids = ["a", "b", "a", "x", "b"]
    ev = Eval(
        script("release"),
        (k.owner("train:1"), k.released, k.events, k.op("dup-1"), k.stats, *k.session_keys(ids)),
        ("train:1", "consumed", 60_000, len(k.session_head)),
    )
    assert store.execute(ev) == [b"a\nb"]
    assert [e["sid"] for e in events(store)] == ["a", "b"]
    assert store.stats().sessions_released == 2 and store.sessions() == []


def test_a_release_over_several_chunks_replays_every_chunk_by_op_id(store: TraceStore) -> None:
    """The release script replies with one newline-joined string per chunk, and its op
    record keeps it: calling release_owner again with the op id (the owner set is empty
    by then) gives back the ids of every chunk of the first call, in its order, and no
    session gets a second event."""
    n = script("release").chunk + 500
    sids = [f"c-{i:05d}" for i in range(n)]
    store.open_sessions(sids, "train:1")
    first = store.release_owner("train:1", "consumed", op_id="multi-1")
    assert first == sids  # the snapshot is sorted, and these ids sort as created
    assert store.release_owner("train:1", "consumed", op_id="multi-1") == first
    assert store.release(sids, "train:1", op_id="multi-2") == []  # a new op id: nothing left to release
    assert store.redis.xlen(store.keys.events) == n
    assert store.stats().sessions_released == n


# -- scenario 3: concurrent duplicate releases -------------------------------------------


def test_concurrent_duplicate_releases_each_id_once(store_factory: Any) -> None:
    n, threads = 400, 8
    main = store_factory()
    sids = [f"s{i}" for i in range(n)]
    main.open_sessions(sids, "train:3")
    main.open_sessions([f"keep{i}" for i in range(20)], "replay")
    for s in sids[:20]:
        write_turn(main, s)
    clients = [store_factory() for _ in range(threads)]
    results: list[list[str]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads)

    def worker(i: int) -> None:
        mine = list(sids)
        random.Random(i).shuffle(mine)
        barrier.wait()
        if i % 4 == 3:  # a quarter of the callers release the whole owner instead
            results[i] = clients[i].release_owner("train:3", "consumed")
            return
        for part in range(0, n, 50):  # many overlapping calls per thread
            results[i] += clients[i].release(mine[part : part + 50], "train:3", "consumed")

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()

    returned = Counter(s for r in results for s in r)
    assert set(returned) == set(sids)
    assert max(returned.values()) == 1, [s for s, c in returned.items() if c > 1][:5]
    ev = Counter(e["sid"] for e in events(main))
    assert ev == Counter(sids)
    assert {e["owner"] for e in events(main)} == {"train:3"}
    assert main.sessions("train:3") == []
    assert len(main.sessions("replay")) == 20
    assert all(data_purged(main, s) for s in sids[:20])


def test_concurrent_releases_async(url: str, run_id: str, arun: Any) -> None:
    import asyncio

    async def body() -> tuple[list[list[str]], list[dict[str, str]]]:
        st: AsyncTraceStore = await connect_async(url, run_id)
        try:
            sids = [f"a{i}" for i in range(200)]
            await st.open_sessions(sids, "eval:2")
            results = await asyncio.gather(
                *(st.release(sids[i % 3 :] + sids[: i % 3], "eval:2", "done") for i in range(6))
            )
            raw = await st.redis.xrange(st.keys.events, "-", "+")
            return list(results), [{text(a): text(b) for a, b in f.items()} for _i, f in raw]
        finally:
            await st.close()

    results, ev = arun(body())
    returned = Counter(s for r in results for s in r)
    assert len(returned) == 200 and max(returned.values()) == 1
    assert Counter(e["sid"] for e in ev) == Counter(returned)


# -- scenario 2: evaluation releases only its own sessions ------------------------------


class EvalCrashed(RuntimeError):
    pass


def evaluate(store: TraceStore, step: int, n: int, crash_after: int | None) -> None:
    """An evaluator: opens eval:<step> sessions, writes turns, always releases its owner."""
    owner = f"eval:{step}"
    try:
        for i in range(n):
            sid = f"ev{step}-{i}"
            store.open_session(sid, owner)
            write_turn(store, sid)
            if crash_after is not None and i == crash_after:
                raise EvalCrashed(f"evaluation failed at sample {i}")
    finally:
        store.release_owner(owner, "eval-done")


@pytest.mark.parametrize("crash_after", [None, 3])
def test_eval_releases_only_eval_sessions(store: TraceStore, crash_after: int | None) -> None:
    others = {"r0": "replay", "r1": "replay", "t0": "train:7", "w0": "rollout:0", "e8": "eval:8"}
    for sid, owner in others.items():
        store.open_session(sid, owner)
        write_turn(store, sid)
    if crash_after is None:
        evaluate(store, 7, 6, None)
        n_eval = 6
    else:
        with pytest.raises(EvalCrashed):
            evaluate(store, 7, 6, crash_after)
        n_eval = crash_after + 1
    ev = events(store)
    assert sorted(e["sid"] for e in ev) == sorted(f"ev7-{i}" for i in range(n_eval))
    assert {(e["owner"], e["reason"]) for e in ev} == {("eval:7", "eval-done")}
    assert store.sessions("eval:7") == []
    for sid, owner in others.items():
        assert store.owner_of(sid) == owner
        assert data_intact(store, sid)
    assert all(data_purged(store, f"ev7-{i}") for i in range(n_eval))


# -- scenario 1: the disaggregated race ----------------------------------------------------


def _race(
    store_factory: Any, steps: int, per_step: int, producers: int = 2, *, with_gc: bool = False
) -> list[Any]:
    """Learner releases train:<step> while producers open and write and replay holds sessions.

    ``with_gc``: a thread runs ``gc`` in a loop meanwhile (producers heart-beat);
    its reports are returned.
    """
    learner = store_factory()
    retryable = [f"retry{i}" for i in range(10)]
    learner.open_sessions(retryable, "replay")
    for s in retryable:
        write_turn(learner, s)

    stop = threading.Event()
    produced: list[list[str]] = [[] for _ in range(producers)]
    in_flight: list[list[str]] = [[] for _ in range(producers)]
    errors: list[BaseException] = []

    def producer(p: int) -> None:
        st = store_factory()
        n = 0
        try:
            while not stop.is_set():
                sid, owner = f"p{p}-{n}", f"rollout:{p}"
                n += 1
                if with_gc:
                    st.heartbeat(owner, 30)
                st.open_session(sid, owner)
                write_turn(st, sid)
                if n % 3 == 0:  # a session still being generated: stays with its worker
                    in_flight[p].append(sid)
                    continue
                assert st.transfer([sid], owner, "replay") == [sid]
                produced[p].append(sid)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    reports: list[Any] = []

    def collector() -> None:
        st = store_factory()
        try:
            while not stop.is_set():
                reports.append(st.gc())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(producers)]
    if with_gc:
        threads.append(threading.Thread(target=collector))
    for t in threads:
        t.start()
    consumed: set[str] = set()
    try:
        for step in range(steps):
            owner = f"train:{step}"
            deadline = time.monotonic() + 10
            batch: list[str] = []
            while len(batch) < per_step and time.monotonic() < deadline and not errors:
                candidates = [s for s in learner.sessions("replay") if not s.startswith("retry")]
                batch += learner.transfer(candidates[: per_step - len(batch)], "replay", owner)
            assert not errors, errors
            for s in batch:
                assert data_intact(learner, s)  # the learner reads what it trains on
            released = learner.release_owner(owner, "consumed")
            assert sorted(released) == sorted(batch)
            consumed |= set(released)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors

    ev = events(learner)
    assert Counter(e["sid"] for e in ev) == Counter(consumed)
    assert all(e["reason"] == "consumed" and e["owner"].startswith("train:") for e in ev)
    for s in consumed:
        assert data_purged(learner, s)
    kept = [s for p in produced for s in p if s not in consumed]
    flying = [s for p in in_flight for s in p]
    states = learner.session_states(kept + flying + retryable)
    for s in kept + retryable:
        assert states[s] == ("replay", "live"), s
        assert data_intact(learner, s)
    for s in flying:
        assert states[s] is not None and states[s][1] == "live"
        assert data_intact(learner, s)
    return reports


def test_disaggregated_race(store_factory: Any) -> None:
    _race(store_factory, steps=8, per_step=4)


@pytest.mark.slow
def test_disaggregated_race_stress(store_factory: Any) -> None:
    _race(store_factory, steps=150, per_step=6, producers=3)


def test_disaggregated_race_second_process(store_factory: Any, url: str, run_id: str) -> None:
    """The producer runs in another process; the learner keeps releasing train:<step>."""
    learner = store_factory()
    learner.open_sessions([f"retry{i}" for i in range(5)], "replay")
    for i in range(5):
        write_turn(learner, f"retry{i}")
    n = 40
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_producer_proc.py"), url, run_id, "proc", str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    consumed: set[str] = set()
    step = 0
    try:
        while True:
            done = proc.poll() is not None
            owner = f"train:{step}"
            step += 1
            candidates = [s for s in learner.sessions("replay") if s.startswith("proc-")]
            taken = learner.transfer(candidates[:3], "replay", owner)
            released = learner.release_owner(owner, "consumed")
            assert sorted(released) == sorted(taken)
            consumed |= set(released)
            if done and not candidates:
                break
            time.sleep(0.01)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[-1] == "done"
    made = [orjson.loads(line) for line in lines[:-1]]
    assert len(made) == n
    to_replay = {m["sid"] for m in made if m["owner"] == "replay"}
    with_worker = [m["sid"] for m in made if m["owner"] == "rollout:proc"]
    assert consumed == to_replay  # everything that reached replay, and nothing else
    assert Counter(e["sid"] for e in events(learner)) == Counter(consumed)
    for s in with_worker + [f"retry{i}" for i in range(5)]:
        assert learner.owner_of(s) in ("rollout:proc", "replay")
        assert data_intact(learner, s)
    for s in consumed:
        assert data_purged(learner, s)


# -- scenario 4: a retried script whose reply was lost --------------------------------------


def _proxy_for(backend: str, url: str) -> CutProxy:
    if backend == "cluster":
        pytest.skip("the cluster announces its nodes' own addresses, which bypass a proxy")
    u = urlparse(url)
    if u.scheme != "redis" or u.password:
        pytest.skip(f"proxy test needs a plain redis:// URL, got {u.scheme}")
    return CutProxy(u.hostname or "127.0.0.1", int(u.port or 6379))


def test_retry_after_cut_connection_returns_same_ids_and_one_event(
    backend: str, url: str, run_id: str
) -> None:
    with _proxy_for(backend, url) as proxy:
        st = TraceStore.connect(proxy.url, run=run_id, retries=3)
        try:
            sids = [f"s{i}" for i in range(30)]
            st.open_sessions(sids, "train:1")
            for s in sids[:5]:
                write_turn(st, s)
            st.release(["warm-up"], "train:1")  # loads the script: the cut hits the real call
            st.transfer(["warm-up"], "a", "b")

            proxy.arm()  # the release runs on the server, its reply is lost, redis-py retries
            got = st.release(sids[:10], "train:1", "consumed")
            assert proxy.cuts == 1
            assert got == sids[:10]

            proxy.arm(skip=1)  # the release reply arrives, the purge reply is lost
            got = st.release(sids[10:20], "train:1", "consumed")
            assert proxy.cuts == 2
            assert got == sids[10:20]

            proxy.arm(skip=1)  # release_owner: SMEMBERS passes, the release reply is lost
            got = st.release_owner("train:1", "consumed")
            assert proxy.cuts == 3
            assert sorted(got) == sorted(sids[20:])

            proxy.arm()
            st.open_session("o1", "rollout:0")  # a replayed reply, not SessionExists
            proxy.arm()
            assert st.transfer(["o1"], "rollout:0", "replay") == ["o1"]
            assert proxy.cuts == 5
            assert st.owner_of("o1") == "replay"
        finally:
            st.close()
    check = TraceStore.connect(url, run=run_id)
    try:
        ev = events(check)
        assert Counter(e["sid"] for e in ev) == Counter(sids)
        assert all(data_purged(check, s) for s in sids[:5])
    finally:
        check.close()


def test_without_retries_the_cut_surfaces_and_a_new_call_is_safe(
    backend: str, url: str, run_id: str
) -> None:
    from tracestore import StorageError

    with _proxy_for(backend, url) as proxy:
        st = TraceStore.connect(proxy.url, run=run_id, retries=0)
        try:
            st.open_sessions(["x", "y"], "train:1")
            st.release(["warm-up"], "train:1")
            proxy.arm()
            with pytest.raises(StorageError):
                st.release(["x", "y"], "train:1")
            # The release ran; a new call (new op id) finds nothing left to release.
            assert st.release(["x", "y"], "train:1") == []
            assert Counter(e["sid"] for e in events(st)) == Counter(["x", "y"])
        finally:
            st.close()


# -- scenario 6: owner loss --------------------------------------------------------------


def test_owner_loss_gc_releases_and_late_heartbeat_does_not_resurrect(store: TraceStore) -> None:
    # Both alive for a minute while the workload is set up and the first gc runs (no race
    # with the clock however slow the machine), then rollout:dead's last heartbeat asks for
    # only 50 ms (a heartbeat sets the deadline to now + ttl, shorter too) and it stops.
    store.heartbeat("rollout:dead", 60)
    store.heartbeat("rollout:alive", 60)
    dead = [f"d{i}" for i in range(12)]
    store.open_sessions(dead, "rollout:dead")
    store.open_sessions(["a0", "a1"], "rollout:alive")
    store.open_sessions(["n0"], "rollout:never-beat")  # no heartbeat: gc never judges it
    for s in [*dead[:3], "a0", "n0"]:
        write_turn(store, s)

    first = store.gc()
    assert first.owners_lost == () and first.sessions_released == ()

    store.heartbeat("rollout:dead", 0.05)
    time.sleep(0.1)
    report = store.gc()
    assert report.owners_lost == ("rollout:dead",)
    assert sorted(report.sessions_released) == sorted(dead)
    ev = events(store)
    assert Counter(e["sid"] for e in ev) == Counter(dead)
    assert {(e["owner"], e["reason"]) for e in ev} == {("rollout:dead", "owner-lost")}
    assert all(data_purged(store, s) for s in dead[:3])

    # The late owner comes back: refused, and nothing is resurrected.
    with pytest.raises(OwnerLost) as exc:
        store.heartbeat("rollout:dead", 60)
    assert exc.value.owner == "rollout:dead"
    with pytest.raises(OwnerLost):
        store.open_session("d-new", "rollout:dead")
    with pytest.raises(OwnerLost):
        store.transfer(["a1"], "rollout:alive", "rollout:dead")
    assert all(store.owner_of(s) is None for s in dead)
    assert store.release(dead, "rollout:dead") == []
    with pytest.raises(SessionReleased):
        write_turn(store, dead[0])

    # The live owners are untouched, and a second gc does nothing new.
    assert store.sessions("rollout:alive") == ["a0", "a1"] and data_intact(store, "a0")
    assert store.sessions("rollout:never-beat") == ["n0"] and data_intact(store, "n0")
    again = store.gc()
    assert again.owners_lost == () and again.sessions_released == ()
    assert len(events(store)) == len(dead)
    info = {o.owner: o for o in store.owners()}
    assert info["rollout:dead"].lost_ms is not None and info["rollout:dead"].sessions == 0
    assert info["rollout:alive"].lost_ms is None and info["rollout:alive"].sessions == 2


def test_transfer_to_a_lost_owner_is_refused_and_moves_nothing(store: TraceStore, arun: Any) -> None:
    """Guard: transfer.lua's lost-owner check. A session moved to an owner gc declared lost
    would belong to a tag that can never heartbeat or release again (it would leak until
    some later gc pass); the transfer is refused, sync and async, and nothing moves."""
    store.heartbeat("rollout:dead", 0.05)
    store.open_session("d0", "rollout:dead")
    time.sleep(0.1)
    assert store.gc(scan_data=False).owners_lost == ("rollout:dead",)
    sids = [f"t{i}" for i in range(5)]
    store.open_sessions(sids, "rollout:src")
    write_turn(store, sids[0])
    before = dump_run(store)
    with pytest.raises(OwnerLost) as exc:
        store.transfer(sids, "rollout:src", "rollout:dead")
    assert exc.value.owner == "rollout:dead" and exc.value.lost_ms > 0

    async def via_async() -> None:
        st = await connect_async(store.url, store.run_id)
        try:
            with pytest.raises(OwnerLost):
                await st.transfer(sids[:2], "rollout:src", "rollout:dead")
        finally:
            await st.close()

    arun(via_async())
    assert dump_run(store) == before
    assert store.sessions("rollout:src") == sids and store.sessions("rollout:dead") == []
    assert data_intact(store, sids[0])
    assert store.transfer(sids, "rollout:src", "replay") == sids  # a live owner still receives


def test_heartbeat_keeps_owner_alive_across_gc(store: TraceStore) -> None:
    # ttl 2 s, a heartbeat every 0.6 s: 1.4 s of slack for the gc and a stalled process
    # between two beats, and 2.4 s in all, longer than one ttl (without the beats the owner
    # would be lost).
    t0 = time.monotonic()
    store.heartbeat("rollout:w", 2.0)
    store.open_sessions(["s0", "s1"], "rollout:w")
    for _ in range(4):
        time.sleep(0.6)
        store.heartbeat("rollout:w", 2.0)
        assert store.gc(scan_data=False).sessions_released == ()
    assert time.monotonic() - t0 > 2.0
    assert store.sessions("rollout:w") == ["s0", "s1"]


# -- clean shutdown (issue 12 item 4) ----------------------------------------------------


def test_a_closed_client_deregisters_its_owner_tags(url: str, run_id: str) -> None:
    """gc does not call the owners of a cleanly closed client lost; an owner that still holds
    sessions keeps its heartbeat, so gc releases them if its process never comes back."""
    a = TraceStore.connect(url, run=run_id)
    a.heartbeat("rollout:0", 0.2)  # owns nothing
    a.heartbeat("rollout:1", 0.2)
    a.open_session("held", "rollout:1")  # still owned at close
    a.heartbeat("rollout:2", 0.2)
    a.open_session("done", "rollout:2")
    a.release(["done"], "rollout:2")  # owned one, released it: done at close
    a.close()
    b = TraceStore.connect(url, run=run_id)
    try:
        assert {o.owner for o in b.owners() if o.deadline_ms is not None} == {"rollout:1"}
        time.sleep(0.3)
        report = b.gc()
        assert report.owners_lost == ("rollout:1",) and report.sessions_released == ("held",)

        # by hand: refused while the tag owns sessions, idempotent once done
        b.heartbeat("rollout:3", 30)
        b.open_session("y", "rollout:3")
        assert b.deregister("rollout:3") is False
        assert "rollout:3" in {o.owner for o in b.owners() if o.deadline_ms is not None}
        b.release(["y"], "rollout:3")
        assert b.deregister("rollout:3") is True and b.deregister("rollout:3") is True
        assert b.redis.zscore(b.keys.owners, "rollout:3") is None
        with pytest.raises(InvalidId):
            b.deregister("bad tag")
    finally:
        b.close()


def test_a_closed_async_client_deregisters_too(url: str, run_id: str, arun: Any) -> None:
    async def main() -> None:
        a = await connect_async(url, run_id)
        await a.heartbeat("rollout:0", 30)
        await a.close()

    arun(main())
    with TraceStore.connect(url, run=run_id) as st:
        assert st.owners() == []


def test_async_retry_after_cut_connection(backend: str, url: str, run_id: str, arun: Any) -> None:
    with _proxy_for(backend, url) as proxy:

        async def body() -> tuple[list[str], list[str]]:
            st = await connect_async(proxy.url, run_id, retries=3)
            try:
                sids = [f"s{i}" for i in range(20)]
                await st.open_sessions(sids, "train:1")
                await st.release(["warm-up"], "train:1")
                proxy.arm()
                first = await st.release(sids[:10], "train:1", "consumed")
                proxy.arm(skip=1)
                rest = await st.release_owner("train:1", "consumed")
                return first, rest
            finally:
                await st.close()

        first, rest = arun(body())
        assert proxy.cuts == 2
    assert first == [f"s{i}" for i in range(10)]
    assert sorted(rest) == sorted(f"s{i}" for i in range(10, 20))
    with TraceStore.connect(url, run=run_id) as check:
        assert Counter(e["sid"] for e in events(check)) == Counter(f"s{i}" for i in range(20))


def test_cluster_retry_after_cut_connection(cluster_url: str, run_id: str) -> None:
    """Scenario 4 on a cluster: one proxy per node, redis-py told to reach the nodes through them."""
    if "cluster" not in _selected():
        pytest.skip("cluster backend not selected (TRACESTORE_TEST_BACKENDS)")
    with proxied_cluster(cluster_url, run_id) as (st, proxy_of):
        keys = st.keys
        sids = [f"s{i}" for i in range(30)]
        st.open_sessions(sids, "train:1")
        for s in sids[:3]:
            write_turn(st, s)
        st.release(["warm-up"], "train:1")
        control = proxy_of(keys.meta)

        control.arm()  # the release script ran on the node; its reply is lost
        assert st.release(sids[:10], "train:1", "consumed") == sids[:10]
        assert control.cuts == 1

        control.arm(skip=1)  # release_owner: SMEMBERS passes, the release reply is lost
        assert sorted(st.release_owner("train:1", "consumed")) == sorted(sids[10:])
        assert control.cuts == 2

        control.arm()
        st.open_session("o1", "rollout:0")
        control.arm()
        assert st.transfer(["o1"], "rollout:0", "replay") == ["o1"]
        assert control.cuts == 4

        # The purge pipeline of a data node loses its reply: re-run, idempotent.
        st.open_sessions(["q0", "q1"], "train:2")
        for s in ("q0", "q1"):
            write_turn(st, s)
        data = proxy_of(keys.dead("q0"))
        data.arm(skip=1 if data is control else 0)  # the release reply comes first there
        assert st.release(["q0", "q1"], "train:2") == ["q0", "q1"]
        assert data.cuts == 1 + (4 if data is control else 0)

        ev = events(st)
        assert Counter(e["sid"] for e in ev) == Counter([*sids, "q0", "q1"])
        assert all(data_purged(st, s) for s in [*sids[:3], "q0", "q1"])


def test_disaggregated_race_with_the_replay_buffer(store_factory: Any) -> None:
    """Producer puts groups into store.replay, learner takes and releases, evaluator runs beside."""
    from tracestore.replay import Group

    learner = store_factory()
    stop = threading.Event()
    errors: list[BaseException] = []
    held: list[str] = []  # sessions of aborted, retryable groups: replay keeps them
    put_ok: list[str] = []
    evaluated: list[str] = []

    def producer() -> None:
        st = store_factory()
        g = 0
        try:
            while not stop.is_set():
                sids = [f"g{g}-{j}" for j in range(3)]
                st.open_sessions(sids, "rollout:0")
                for s in sids:
                    write_turn(st, s)
                aborted = g % 4 == 3
                st.replay.put(
                    Group(f"g{g}", "math", tuple(sids), "aborted" if aborted else "completed",
                          min_version=0, retryable=aborted),
                    "rollout:0",
                )
                (held if aborted else put_ok).extend(sids)
                g += 1
        except BaseException as exc:
            errors.append(exc)

    def evaluator() -> None:
        st = store_factory()
        try:
            for step in range(4):
                try:
                    evaluate(st, step, 3, crash_after=1 if step % 2 else None)
                except EvalCrashed:
                    pass
                evaluated.extend(f"ev{step}-{i}" for i in range(3 if step % 2 == 0 else 2))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=producer), threading.Thread(target=evaluator)]
    for t in threads:
        t.start()
    consumed: list[str] = []
    try:
        for step in range(6):
            owner = f"train:{step}"
            deadline = time.monotonic() + 10
            taken: list[Any] = []
            while not taken and time.monotonic() < deadline and not errors:
                taken = list(learner.replay.take("math", 2, owner=owner))
            assert taken, errors
            sids = [s for grp in taken for s in grp.sids]
            assert all(data_intact(learner, s) for s in sids)
            assert sorted(learner.release_owner(owner, "consumed")) == sorted(sids)
            consumed += sids
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    ev = events(learner)
    assert Counter(e["sid"] for e in ev) == Counter(consumed + evaluated)
    assert all(data_purged(learner, s) for s in consumed + evaluated)
    states = learner.session_states(held + [s for s in put_ok if s not in set(consumed)])
    for s, st in states.items():
        assert st == ("replay", "live"), (s, st)
        assert data_intact(learner, s)


def test_heartbeat_many_records_every_tag_in_one_round_trip(store: TraceStore) -> None:
    from tests.test_scripts import _Counting

    tags = ["hb:a", "hb:b", "hb:c"]
    count = _Counting(store)
    beats = store.heartbeat_many(tags, 30)
    assert len(count.requests) == 1 and [b.owner for b in beats] == tags
    scores = {o: store.redis.zscore(store.keys.owners, o) for o in tags}
    assert all(scores[b.owner] == b.deadline_ms for b in beats)
    store.redis.zadd(store.keys.owners_lost, {"hb:b": 1})  # gc declared one tag lost
    with pytest.raises(OwnerLost):
        store.heartbeat_many(tags, 60)
    after = {o: store.redis.zscore(store.keys.owners, o) for o in tags}
    assert after["hb:a"] > scores["hb:a"] and after["hb:c"] > scores["hb:c"]  # the others still beat
    with pytest.raises(InvalidInput):
        store.heartbeat_many(["hb:a"], -1)
    beats = store.heartbeat_many(["hb:a", "hb:c"], 30, op_id="beat-1")  # names the call only
    assert [b.owner for b in beats] == ["hb:a", "hb:c"]
    with pytest.raises(InvalidId):
        store.heartbeat_many(["hb:a"], 30, op_id="bad#id")
