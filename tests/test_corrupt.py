"""Corrupted stored data (issue 11 item 7): a typed CorruptData naming the key, and nothing committed.

Each test writes a value tracestore would never write (by hand, as a
broken tool or a person with ``redis-cli`` might) and checks that the read
or the take that meets it raises CorruptData with that key, never a raw
orjson, UnicodeDecodeError or ValueError, and that a take, claim or expiry
over a corrupted group changes nothing (every key of the run byte-identical).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests._dump import dump_run
from tests.test_ownership import prompt_of, response_of, write_turn
from tracestore import CorruptData, PrefixMatch, Segment, TraceStore
from tracestore.replay import Group
from tracestore.traces import node_id


def _raw(store: TraceStore) -> Any:
    return store.redis


def _fresh(store: TraceStore) -> None:
    store.context.caches.clear()  # the client caches immutable nodes; these change by hand


def _num(store: TraceStore, sid: str, key_text: str) -> bytes:
    """The node number of ``key_text`` (its field in tok and txt): the first field of its record, before ".wid"."""
    rec = _raw(store).hget(store.keys.idx(sid), node_id(key_text))
    assert rec is not None
    return bytes(rec).split(b",", 1)[0].split(b".")[0]


def _edit_record(store: TraceStore, sid: str, key_text: str, field: int, value: bytes) -> None:
    """Replace comma field ``field`` of the index record of ``key_text``."""
    r = _raw(store)
    parts = bytes(r.hget(store.keys.idx(sid), node_id(key_text))).split(b",")
    parts[field] = value
    r.hset(store.keys.idx(sid), node_id(key_text), b",".join(parts))


def test_corrupt_trace_index_payload_and_text(store: TraceStore) -> None:
    r, k = _raw(store), store.keys
    full = prompt_of("t") + response_of("t")
    cases = [
        ("record", lambda: r.hset(k.idx("t"), node_id(full), "not,a,record")),
        ("utf-8", lambda: r.hset(k.idx("t"), node_id(full), b"\xff\xfe")),
        ("index version", lambda: r.hset(k.idx("t"), "#v", "many")),
        ("missing parent", lambda: r.hdel(k.idx("t"), node_id(prompt_of("t")))),
        ("payload size", lambda: r.hset(k.tok("t"), _num(store, "t", full), b"\x01\x02\x03")),
        # the parent named by a number no node has; a node number that is not one
        ("parent number", lambda: _edit_record(store, "t", full, 1, b"7")),
        ("node number", lambda: _edit_record(store, "t", full, 0, b"x")),
        ("write id", lambda: _edit_record(store, "t", full, 0, _num(store, "t", full) + b".xyz")),
    ]
    for name, corrupt in cases:
        store.drop_session_data("t") if r.exists(k.idx("t")) else None
        r.delete(k.dead("t"))
        write_turn(store, "t")
        corrupt()
        _fresh(store)
        want = k.tok("t") if name == "payload size" else k.idx("t")
        for read in (
            lambda: store.export_training_trace("t", full),
            lambda: store.lookup("t", full),
            lambda: store.search("t", full + "more"),
        ):
            with pytest.raises(CorruptData) as ei:
                read()
            assert ei.value.key == want, name
            assert want in str(ei.value)
    # node text that is not UTF-8, met while explaining a PromptMismatch
    store.drop_session_data("t")
    r.delete(k.dead("t"))
    write_turn(store, "t")
    r.hset(k.txt("t"), _num(store, "t", full), b"\xff")
    _fresh(store)
    with pytest.raises(CorruptData) as ei:
        store.export_training_trace("t", prompt_of("t") + "X")
    assert ei.value.key == k.txt("t")


def test_a_write_refuses_a_node_number_that_is_taken(store: TraceStore) -> None:
    """Nodes are numbered HLEN idx - 2 + 1; an index edited by hand (a node's record deleted)
    would hand out a number whose payload exists: CorruptData, nothing written."""
    r, k = _raw(store), store.keys
    write_turn(store, "n")
    r.hdel(k.idx("n"), node_id(prompt_of("n")))  # node 1's record: the count says 1 node
    _fresh(store)
    before = {key: r.dump(key) for key in (k.idx("n"), k.tok("n"), k.txt("n"))}
    full = prompt_of("n") + response_of("n")
    with pytest.raises(CorruptData) as ei:
        store.insert("n", full + "more", Segment([9]))
    assert ei.value.key == k.tok("n") and "node number 2 is taken" in str(ei.value)
    assert {key: r.dump(key) for key in before} == before


def test_a_write_refuses_an_index_version_that_does_not_parse(store: TraceStore) -> None:
    """#v is "version.chain"; edited by hand into something else, a turn on the session is
    refused with CorruptData naming #v before anything is written (it once failed after
    writing its nodes)."""
    r, k = _raw(store), store.keys
    write_turn(store, "v")
    r.hset(k.idx("v"), "#v", "many")
    before = {key: r.dump(key) for key in (k.idx("v"), k.tok("v"), k.txt("v"))}
    full = prompt_of("v") + response_of("v")
    m = PrefixMatch(0, [], None, ())  # the prefix as a client that cannot read the index has it
    with pytest.raises(CorruptData) as ei:
        store.record_turn("v", full + "?", "!", prefix=m, delta_token_ids=[1], response_token_ids=[2],
                          response_logprobs=[0.0], version=0)
    assert ei.value.key == k.idx("v") and ei.value.field == "#v"
    assert {key: r.dump(key) for key in before} == before


def _groups(store: TraceStore, n: int, **kw: Any) -> list[Group]:
    out = []
    for i in range(n):
        sids = (f"g{i}.a", f"g{i}.b")
        store.open_sessions(list(sids), "rollout:p")
        g = Group(gid=f"g{i}", task="math", sids=sids, payload={"i": i}, **kw)
        assert store.replay.put(g, "rollout:p").stored
        out.append(g)
    return out


def _rec_with(store: TraceStore, gid: str, **fields: Any) -> bytes:
    """Group ``gid``'s stored record with ``fields`` replaced (a value put never writes)."""
    rec = json.loads(store.redis.hget(store.keys.rb_groups, gid))
    rec.update(fields)
    return json.dumps(rec).encode()


@pytest.mark.parametrize(
    ("part", "value"),
    [
        ("payloads", "not json"),
        ("payloads", "[1, 2]"),
        ("payloads", b'{"x": "\xff"}'),
        ("sids", '{"a": 1}'),
        ("sids", "[1, 2]"),
        ("groups", "not json"),
        ("groups", {"min_version": "old"}),
        ("groups", {"status": "lost"}),
    ],
)
def test_take_never_commits_a_group_the_client_cannot_decode(store: TraceStore, part: str, value: Any) -> None:
    r, k = _raw(store), store.keys
    _groups(store, 3)
    key = {"payloads": k.rb_payloads, "sids": k.rb_sids, "groups": k.rb_groups}[part]
    r.hset(key, "g1", _rec_with(store, "g1", **value) if isinstance(value, dict) else value)
    before = dump_run(store)
    with pytest.raises(CorruptData) as ei:
        store.replay.take("math", 2, owner="train:0")
    assert (ei.value.key, ei.value.field) == (key, "g1")
    assert dump_run(store) == before  # nothing taken, moved or released
    with pytest.raises(CorruptData) as ei:
        store.replay.groups("math")
    assert ei.value.field == "g1"
    # the groups before it can still be taken; the operator repairs or deletes the group
    assert [g.gid for g in store.replay.take("math", 1, owner="train:0")] == ["g0"]
    for h in (k.rb_groups, k.rb_sids, k.rb_payloads):
        r.hdel(h, "g1")
    r.zrem(k.rb_queue("math", "completed"), "g1")
    r.zrem(k.rb_versions("math", "completed"), "g1")
    assert [g.gid for g in store.replay.take("math", 1, owner="train:0")] == ["g2"]


def test_claim_and_expire_refuse_corrupt_groups_without_writing(store: TraceStore) -> None:
    r, k = _raw(store), store.keys
    _groups(store, 2, status="aborted", retryable=True)
    r.hset(k.rb_payloads, "g0", "{")
    before = dump_run(store)
    with pytest.raises(CorruptData) as ei:
        store.replay.claim_retry("math", 2, "rollout:q")
    assert (ei.value.key, ei.value.field) == (k.rb_payloads, "g0")
    assert dump_run(store) == before

    sids = ("c.a",)
    store.open_sessions(list(sids), "rollout:p")
    store.replay.put(Group(gid="c", task="code", sids=sids, min_version=0), "rollout:p")
    r.hset(k.rb_sids, "c", "[broken")
    before = dump_run(store)
    with pytest.raises(CorruptData) as ei:
        store.replay.expire(10, 1, task="code")
    assert (ei.value.key, ei.value.field) == (k.rb_sids, "c")
    assert dump_run(store) == before


def test_corrupt_control_records(store: TraceStore, url: str, run_id: str) -> None:
    r, k = _raw(store), store.keys
    lease = store.gate.admit("s", "w", 60)
    r.hset(k.gate_lease(lease.id), "deadline_ms", "soon")
    with pytest.raises(CorruptData) as ei:
        store.gate.lease_records([lease.id])
    assert ei.value.key == k.gate_lease(lease.id)
    store.open_session("s1", "w")
    r.hset(k.session("s1"), "state", b"\xc3")
    with pytest.raises(CorruptData) as ei:
        store.session_states(["s1"])
    assert ei.value.key == k.session("s1")
    r.hset(k.meta, "created_ms", "yesterday")
    with pytest.raises(CorruptData) as ei:
        TraceStore.connect(url, run=run_id)
    assert ei.value.key == k.meta


def test_async_cluster_batch_error_is_not_its_own_cause(cluster_url: str, run_id: str, arun: Any) -> None:
    """A failing command in an async cluster batch: a StorageError caused by redis-py's error."""
    import redis as redis_py

    from tracestore import AsyncTraceStore, StorageError
    from tracestore.scripts import Batch, Cmd

    async def main() -> None:
        st = await AsyncTraceStore.connect(cluster_url, run=run_id)
        try:
            key = st.keys.meta  # a hash: GET on it is a WRONGTYPE error
            with pytest.raises(StorageError) as ei:
                await st.execute(Batch((Cmd(("GET", key), key=key), Cmd(("PING",), key=key))))
            err = ei.value
            assert err.__cause__ is not err and isinstance(err.__cause__, redis_py.ResponseError)
        finally:
            await st.close()

    arun(main())
