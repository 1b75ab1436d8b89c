"""Checkpoint/restore (tracestore/checkpoint.py) and Redis-level durability (AOF, SIGKILL)."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from tracestore import InvalidInput, Segment, SessionReleased, StorageError, TraceStore
from tracestore.checkpoint import LOST_PREFIX, expert_key_lost
from tracestore.errors import RunNotEmpty
from tracestore.replay import REPLAY_OWNER, STORED_STATUSES, Group
from tracestore.servers import EmbeddedServer

PRODUCER = "rollout:p"


def _turns(st: TraceStore, sid: str, n: int, *, expert: bool, version: int = 0) -> str:
    prompt = f"<sys>{sid}</sys><user>q</user>"
    for t in range(n):
        match = st.lookup(sid, prompt)
        resp = f"<a>answer {t} \u00e9\u4e2d</a>"
        st.record_turn(
            sid, prompt, resp, prefix=match,
            delta_token_ids=[7 + t, 8 + t], response_token_ids=[100 + t, 101 + t, 102 + t],
            response_logprobs=[-0.25, -0.5, -1.0], version=version + t,
            delta_expert_key=f"ek-{sid}-d{t}" if expert else None,
            response_expert_key=f"ek-{sid}-r{t}" if expert else None,
        )
        prompt = prompt + resp + f"<user>more {t}</user>"
    return prompt[: -len(f"<user>more {n - 1}</user>")]


def _build(st: TraceStore) -> dict[str, str]:
    """A run with groups of every stored status, taken and released sessions, traces."""
    finals: dict[str, str] = {}
    for i in range(8):
        gid = f"g{i}"
        sids = [f"{gid}.s{j}" for j in range(2)]
        st.open_sessions(sids, PRODUCER)
        for sid in sids:
            finals[sid] = _turns(st, sid, 2 + i % 2, expert=i % 3 != 0, version=i % 4)
        status = "aborted" if i == 5 else "completed"
        st.replay.put(
            Group(gid, "math" if i % 2 else "code", tuple(sids), status=status,  # min_version i % 4
                  retryable=i % 2 == 1, payload={"rewards": [i, -i], "why": ["stop", "length"]}),
            PRODUCER,
        )
    # min_version < 2: g1 (retryable) kept as expired; g0, g4 released (g5 stays aborted)
    st.replay.expire(4, 2, statuses=("completed",))
    st.replay.take("code", 1, owner="train:0")
    st.open_session("loose", "eval:0")
    finals["loose"] = _turns(st, "loose", 1, expert=True)
    return finals


def _dump(st: TraceStore) -> dict[str, Any]:
    """Every key of the run, raw, keyed by its name relative to the run (op caches excluded)."""
    r: Any = st.redis
    k = st.keys
    out: dict[str, Any] = {}
    names = [n.decode() for n in _scan(st, k.control_pattern)] + [n.decode() for n in _scan(st, k.data_pattern)]
    for name in names:
        rel = name.replace(f"{{{k.run}}}", "{R}").replace(f"{{{k.run}/", "{R/")
        if ":op:" in rel:
            continue
        t = r.type(name).decode()
        if t == "hash":
            v: Any = r.hgetall(name)
        elif t == "set":
            v = r.smembers(name)
        elif t == "zset":
            v = r.zrange(name, 0, -1, withscores=True)
        elif t == "stream":
            v = [f for _, f in r.xrange(name)]
        elif t == "list":
            v = r.lrange(name, 0, -1)
        else:
            v = r.get(name)
        out[rel] = v
    return out


def _scan(st: TraceStore, pattern: str) -> list[bytes]:
    r: Any = st.redis
    if st.cluster:
        keys: list[bytes] = []
        for node in r.get_primaries():
            keys += list(r.get_redis_connection(node).scan_iter(match=pattern, count=1000))
        return keys
    return list(r.scan_iter(match=pattern, count=1000))


def _mark_lost(dump: dict[str, Any]) -> dict[str, Any]:
    out = dict(dump)
    for name, v in dump.items():
        if name.endswith(":idx"):
            new = {}
            for f, rec in v.items():
                parts = rec.split(b",", 6)  # num,parent_num,end,ntok,flags,version,expert_key
                if not f.startswith(b"#") and parts[6]:
                    parts[6] = LOST_PREFIX.encode() + parts[6]
                new[f] = b",".join(parts)
            out[name] = new
    return out


def test_round_trip(store: TraceStore, store_factory: Any, url: str, tmp_path: Path) -> None:
    finals = _build(store)
    before = _dump(store)
    path = tmp_path / "run.tsck"
    info = store.checkpoint(path)
    assert info.groups == 5 and info.sessions == 17 and info.nodes > 0
    assert not (tmp_path / "run.tsck.tmp").exists()
    head = orjson.loads(path.read_bytes().splitlines()[0])
    assert head["format"] == "tracestore-checkpoint" and head["version"] == 3
    # groups are in the file queue by queue, in FIFO order
    recs = [orjson.loads(x) for x in path.read_bytes().splitlines()[1:]]
    assert [r["gid"] for r in recs if r["k"] == "group"] == ["g6", "g3", "g7", "g5", "g1"]

    other = TraceStore.connect(url, run=f"t-{uuid.uuid4().hex[:12]}")
    try:
        rinfo = other.restore(path)
        assert rinfo.groups == 5 and rinfo.lost_expert_keys > 0
        # the run's counters travel with it, the turn count included
        assert other.stats() == store.stats() and store.stats().turns_recorded > 0
        after = _dump(other)
        assert after == _mark_lost(before)
        for task in ("math", "code"):
            for status in STORED_STATUSES:
                assert other.replay.groups(task, status) == store.replay.groups(task, status)
        for sid, final in finals.items():
            if store.owner_of(sid) is None:  # released: data purged in both
                with pytest.raises(SessionReleased):
                    other.export_training_trace(sid, final)
                continue
            a = store.export_training_trace(sid, final)
            b = other.export_training_trace(sid, final)
            assert (a.input_ids, a.labels, a.logprobs, a.versions) == (b.input_ids, b.labels, b.logprobs, b.versions)
            if a.expert_keys is None:
                assert b.expert_keys is None
            else:
                assert b.expert_keys == [LOST_PREFIX + x for x in a.expert_keys]
                assert all(expert_key_lost(x) for x in b.expert_keys)
        assert other.sessions(REPLAY_OWNER) == store.sessions(REPLAY_OWNER)
        # the restored buffer behaves like the original one
        ta = store.replay.take("math", 2, owner="train:1", policy="staleness")
        tb = other.replay.take("math", 2, owner="train:1", policy="staleness")
        assert [g.gid for g in ta] == [g.gid for g in tb] == ["g3", "g7"]
        assert store.replay.claim_retry("math", 5, PRODUCER) == other.replay.claim_retry("math", 5, PRODUCER)
        # released ids stay released
        with pytest.raises(Exception, match="released"):
            other.open_session("g0.s0", PRODUCER)
    finally:
        other.close()


def test_restore_refuses_a_non_empty_run(store: TraceStore, url: str, tmp_path: Path) -> None:
    _build(store)
    path = tmp_path / "run.tsck"
    store.checkpoint(path)
    before = _dump(store)
    with pytest.raises(RunNotEmpty):
        store.restore(path)
    assert _dump(store) == before
    # a run with only trace data is not empty either
    other = TraceStore.connect(url, run=f"t-{uuid.uuid4().hex[:12]}")
    try:
        other.redis.hset(other.keys.idx("x"), "a", "1")
        with pytest.raises(RunNotEmpty):
            other.restore(path)
    finally:
        other.close()


def test_restore_refuses_bad_files(store: TraceStore, url: str, tmp_path: Path) -> None:
    _build(store)
    good = tmp_path / "good.tsck"
    store.checkpoint(good)
    lines = good.read_bytes().splitlines(keepends=True)
    cases = {
        "not-json": b"hello\n",
        "pickle": b"\x80\x04\x95\x00",
        "truncated": b"".join(lines[:-1]),
        "future": lines[0].replace(b'"version":3', b'"version":99') + b"".join(lines[1:]),
        "bad-record": lines[0] + b'{"k":"what"}\n' + lines[-1],
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.tsck"
        p.write_bytes(data)
        fresh = TraceStore.connect(url, run=f"t-{uuid.uuid4().hex[:12]}")
        try:
            with pytest.raises(InvalidInput):
                fresh.restore(p)
            assert [k for k in _dump(fresh) if not k.endswith(":meta")] == [], name
        finally:
            fresh.close()


def test_async_checkpoint(url: str, run_id: str, arun: Any, store: TraceStore, tmp_path: Path) -> None:
    """Round trip through the asyncio store; the file is never opened on the event loop's thread."""
    import sys
    import threading

    from tests.conftest import connect_async

    _build(store)
    opened: list[tuple[int, str]] = []
    watching = [True]

    def audit(event: str, args: tuple[Any, ...]) -> None:  # audit hooks cannot be removed: gated
        if watching[0] and event == "open" and str(tmp_path) in str(args[0]):
            opened.append((threading.get_ident(), str(args[0])))

    sys.addaudithook(audit)

    async def go() -> Any:
        loop_thread = threading.get_ident()
        a = await connect_async(url, run_id)
        b = await connect_async(url, f"t-{uuid.uuid4().hex[:12]}")
        try:
            await a.checkpoint(tmp_path / "x.tsck")
            await b.restore(tmp_path / "x.tsck")
            return loop_thread, await b.replay.count()
        finally:
            await a.close()
            await b.close()

    try:
        loop_thread, count = arun(go())
    finally:
        watching[0] = False
    assert count == store.replay.count() == 5
    assert opened and all(tid != loop_thread for tid, _path in opened), opened


def test_aof_survives_sigkill(tmp_path: Path) -> None:
    """appendfsync always: every put acknowledged before a SIGKILL is there after a restart."""
    srv = EmbeddedServer(aof=True, dir=tmp_path / "data").start()
    acked: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        # no retries: a lost connection means the server died; a long read timeout, so that a
        # slow fsync on a busy disk is not taken for that
        st = TraceStore.connect(srv.url, run="aof", retries=0, socket_timeout_s=30)
        try:
            i = 0
            while not stop.is_set():
                gid = f"g{i}"
                sids = [f"{gid}.a", f"{gid}.b"]
                st.open_sessions(sids, PRODUCER)
                st.replay.put(Group(gid, "math", tuple(sids), min_version=i), PRODUCER)
                acked.append(gid)
                i += 1
        except StorageError:
            return  # the server died under us: everything before is acknowledged
        except BaseException as exc:
            errors.append(exc)
        finally:
            st.close()

    t = threading.Thread(target=writer)
    try:
        t.start()
        deadline = time.monotonic() + 60  # ~100 fsyncs (appendfsync always): slow on a busy CI disk
        while len(acked) < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        srv.kill()  # SIGKILL mid-run
        stop.set()
        t.join(15)
        assert not errors, errors
        assert len(acked) >= 50
        srv2 = EmbeddedServer(aof=True, dir=tmp_path / "data").start()
        try:
            st = TraceStore.connect(srv2.url, run="aof")
            try:
                stored = {g.gid for g in st.replay.groups("math")}
                assert set(acked) <= stored  # an unacknowledged last put may be there too
                assert len(stored) - len(acked) <= 1
                sids = [s for g in acked for s in (f"{g}.a", f"{g}.b")]
                states = st.session_states(sids)
                assert all(states[s] == (REPLAY_OWNER, "live") for s in sids)
                order = [g.gid for g in st.replay.take("math", len(acked), owner="train:0")]
                assert order == acked
            finally:
                st.close()
        finally:
            srv2.stop()
    finally:
        stop.set()
        srv.stop()


#: Written by tracestore at c508673 (checkpoint format 2, run schema 1: 32-hex node ids,
#: tok and txt keyed by them) from _build plus _extra (tests/snapshots/checkpoint_v2.tsck).
V2_FILE = Path(__file__).parent / "snapshots" / "checkpoint_v2.tsck"


def _extra(url: str, st: TraceStore) -> dict[str, str]:
    """What the v2 file holds besides _build: a retried turn (siblings) and an insert with
    explicit labels written without text; the keys to export."""
    m = st.lookup("loose", "<p>")
    st.record_turn("loose", "<p>", "A", prefix=m, delta_token_ids=[1], response_token_ids=[2],
                   response_logprobs=[-0.5], version=1)
    m = st.lookup("loose", "<p>")
    st.record_turn("loose", "<p>", "B", prefix=m, delta_token_ids=[], response_token_ids=[3],
                   response_logprobs=[-0.25], version=2)
    nt = TraceStore.connect(url, run=st.keys.run, store_text=False)
    try:
        nt.insert("loose", "<p>B!", Segment([4, 5], labels=[-100, 5], version=3))
    finally:
        nt.close()
    return {"loose.A": "<p>A", "loose.B!": "<p>B!"}


@pytest.mark.parametrize("version", [2, 1])
def test_a_schema_1_file_restores_converted(
    store: TraceStore, url: str, tmp_path: Path, version: int
) -> None:
    """A file written before node ids were shortened (format 2, and format 1, which also
    had no turns record) restores: ids cut to 16 hex characters, tok and txt renumbered,
    and every trace exports as the same calls recorded today export it."""
    finals = _build(store)
    extra = _extra(url, store)
    lines = V2_FILE.read_bytes().splitlines(keepends=True)
    path = V2_FILE
    if version == 1:
        path = tmp_path / "v1.tsck"
        path.write_bytes(
            lines[0].replace(b'"version":2', b'"version":1')
            + b"".join(x for x in lines[1:] if orjson.loads(x)["k"] != "turns")
        )
    other = TraceStore.connect(url, run=f"t-{uuid.uuid4().hex[:12]}")
    try:
        info = other.restore(path)
        assert info.sessions == 17 and info.nodes == 70 and info.lost_expert_keys > 0
        want = store.stats()
        assert other.stats() == (want if version == 2 else dataclasses.replace(want, turns_recorded=0))
        assert other.redis.hget(other.keys.meta, "schema") == b"2"
        for sid, final in [*finals.items(), *((k.split(".")[0], v) for k, v in extra.items())]:
            if store.owner_of(sid) is None and sid != "loose":
                with pytest.raises(SessionReleased):
                    other.export_training_trace(sid, final)
                continue
            a = store.export_training_trace(sid, final)
            b = other.export_training_trace(sid, final)
            assert (a.input_ids, a.labels, a.logprobs, a.versions) == (b.input_ids, b.labels, b.logprobs, b.versions)
            assert b.expert_keys == (None if a.expert_keys is None else [LOST_PREFIX + x for x in a.expert_keys])
        # today's layout: 16-hex ids, numbered nodes, the same index (but the restored epoch)
        sid = "g3.s0"
        mine, theirs = store.redis.hgetall(store.keys.idx(sid)), other.redis.hgetall(other.keys.idx(sid))
        # (records written today carry a write id after the number, and #v the chain of the
        # writes after the version; a schema 1 file's have neither: lua/_lib/nodes.lua, Write ids)
        assert {f: v for f, v in theirs.items() if f != b"#e"} == {
            f: re.sub(rb"^(\d+)\.[0-9a-f]{8,16}(,|$)", rb"\1\2", v)
            for f, v in _mark_lost({"x:idx": mine})["x:idx"].items() if f != b"#e"
        }
        assert all(len(f) == 16 for f in theirs if not f.startswith(b"#"))
        assert other.redis.hgetall(other.keys.tok(sid)) == store.redis.hgetall(store.keys.tok(sid))
        assert other.redis.hgetall(other.keys.txt(sid)) == store.redis.hgetall(store.keys.txt(sid))
        # and it takes new turns (the next node number is free)
        m = other.lookup("loose", "<p>")
        t = other.record_turn("loose", "<p>", "C", prefix=m, delta_token_ids=[], response_token_ids=[9],
                              response_logprobs=[-1.0], version=4)
        assert t.written == 1
        assert other.export_training_trace("loose", "<p>C").input_ids == [1, 9]
        assert other.export_training_trace("loose", "<p>B!").input_ids == [1, 3, 4, 5]
    finally:
        other.close()


def test_a_schema_1_file_with_colliding_short_ids_is_refused(store: TraceStore, tmp_path: Path) -> None:
    """Two node ids of one session that share their first 64 bits cannot be converted:
    InvalidInput, nothing written."""
    out = []
    for line in V2_FILE.read_bytes().splitlines(keepends=True):
        rec = orjson.loads(line)
        if rec.get("k") == "trace" and rec["sid"] == "loose":
            ids = [f for f, _ in rec["idx"] if not f.startswith("#")]
            a, b = ids[0], ids[1]
            forged = a[:16] + b[16:]  # b's id, with a's first 64 bits
            for part in ("idx", "tok", "txt"):
                rec[part] = [[forged if f == b else f, v] for f, v in rec[part]]
            rec["idx"] = [[f, v.replace(b, forged)] for f, v in rec["idx"]]
            line = orjson.dumps(rec) + b"\n"
        out.append(line)
    path = tmp_path / "collide.tsck"
    path.write_bytes(b"".join(out))
    with pytest.raises(InvalidInput, match="first 64 bits"):
        store.restore(path)
    assert not _scan(store, store.keys.data_pattern)


def test_a_file_of_another_schema_is_refused(store: TraceStore, tmp_path: Path) -> None:
    """A format 3 file claims schema 2; one claiming another schema is refused before any write."""
    lines = V2_FILE.read_bytes().splitlines(keepends=True)
    path = tmp_path / "mixed.tsck"
    path.write_bytes(lines[0].replace(b'"version":2', b'"version":3') + b"".join(lines[1:]))
    with pytest.raises(InvalidInput, match="schema 1, expected 2"):
        store.restore(path)
    assert not _scan(store, store.keys.data_pattern)
