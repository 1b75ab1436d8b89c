"""Trace data plane (tracestore/traces/, lua/record_turn.lua, insert_node.lua, read_index.lua).

Real servers on every backend of the fixture: behaviour, atomicity of refused
writes (every key of the session byte-identical), cache safety with two
clients, and identical results from the sync and async clients.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import re
import threading
from array import array
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import connect_async
from tracestore import (
    InvalidId,
    InvalidInput,
    NodeConflict,
    PrefixChanged,
    PrefixMatch,
    PromptMismatch,
    Segment,
    SessionReleased,
    TraceStore,
    traces,
)
from tracestore.nodecache import node_cache
from tracestore.scripts import Eval
from tracestore.traces import node_id

SYS = "<|system|>You are a calculator.<|end|>"
U1 = "<|user|>What is 2+2?<|end|><|assistant|>"
R1 = "4<|end|>"
U2 = "<|user|>And 3*3?<|end|><|assistant|>"
R2 = "9<|end|>"
R2B = "nine<|end|>"
U3 = "<|user|>Thanks. Über-ünïcode ✓ 😀<|end|><|assistant|>"
R3 = "You're welcome 😀<|end|>"


def _turn(
    st: TraceStore,
    sid: str,
    prompt: str,
    response: str,
    delta_ids: list[int],
    resp_ids: list[int],
    *,
    version: int = 0,
    lps: list[float] | None = None,
    dkey: str | None = None,
    rkey: str | None = None,
) -> Any:
    """What a session server does: lookup before the request, record_turn after it."""
    match = st.lookup(sid, prompt)
    return st.record_turn(
        sid,
        prompt,
        response,
        prefix=match,
        delta_token_ids=delta_ids,
        response_token_ids=resp_ids,
        response_logprobs=lps if lps is not None else [-0.5] * len(resp_ids),
        version=version,
        delta_expert_key=dkey,
        response_expert_key=rkey,
    )


def _three_turns(st: TraceStore, sid: str, **kw: Any) -> str:
    """Record three turns; returns the final key (prompt + response of turn 3)."""
    p1 = SYS + U1
    _turn(st, sid, p1, R1, [1, 2, 3], [10, 11], version=1, **kw)
    p2 = p1 + R1 + U2
    _turn(st, sid, p2, R2, [4, 5], [12], version=2, **kw)
    p3 = p2 + R2 + U3
    _turn(st, sid, p3, R3, [6, 7, 8], [13, 14, 15], version=3, **kw)
    return p3 + R3


def _session_dump(st: TraceStore, sid: str) -> dict[str, Any]:
    """Every key of the session's slot, byte for byte (DUMP) plus readable HGETALLs."""
    r: Any = st.redis
    k = st.keys
    names = {k.idx(sid), k.tok(sid), k.txt(sid), k.dead(sid)}
    pattern = k.idx(sid)[: -len(":idx")].replace("{", "\\{").replace("}", "\\}") + "*"
    names.update(x.decode() if isinstance(x, bytes) else x for x in r.scan_iter(match=pattern))
    out: dict[str, Any] = {}
    for name in sorted(names):
        out[name] = r.dump(name)
        if r.type(name) in (b"hash", "hash"):
            out[name + " (hgetall)"] = r.hgetall(name)
    return out


# -- behaviour ---------------------------------------------------------------------------------


def test_round_trip_labels_versions(store: TraceStore) -> None:
    sid = "rt"
    final = _three_turns(store, sid)
    tr = store.export_training_trace(sid, final)
    assert tr.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 7, 8, 13, 14, 15]
    assert tr.labels == [-100] * 3 + [10, 11] + [-100] * 2 + [12] + [-100] * 3 + [13, 14, 15]
    assert tr.logprobs == [0.0] * 3 + [-0.5] * 2 + [0.0] * 2 + [-0.5] + [0.0] * 3 + [-0.5] * 3
    assert tr.versions == [1] * 5 + [2] * 3 + [3] * 6
    assert tr.min_version == 1
    assert tr.expert_keys is None
    assert len(tr.nodes) == 6
    assert [n.generated for n in tr.nodes] == [False, True] * 3
    assert tr.nodes[-1].end == len(final) and tr.nodes[-1].id == node_id(final)
    # lookup of the next prompt matches the whole stored trace
    nxt = final + "<|user|>bye<|end|><|assistant|>"
    m = store.lookup(sid, nxt)
    assert m.text_len == len(final) and m.token_ids == tr.input_ids
    assert m.node == tr.nodes[-1] and m.path == tr.nodes
    # a fresh client (cold cache) sees the same
    other = TraceStore.connect(store.url, run=store.run_id)
    try:
        assert other.export_training_trace(sid, final) == tr
        assert other.lookup(sid, nxt) == m
    finally:
        other.close()
    # an intermediate key exports its own prefix
    mid = SYS + U1 + R1
    assert store.export_training_trace(sid, mid).input_ids == [1, 2, 3, 10, 11]


def test_logprobs_float32_and_minus_inf(store: TraceStore) -> None:
    lps = [-0.1, -math.inf, -1e-30]
    _turn(store, "lp", "p", "r", [1], [5, 6, 7], lps=lps)
    got = store.export_training_trace("lp", "pr").logprobs
    assert got[0] == 0.0 and got[2] == -math.inf
    assert got[1] == pytest.approx(-0.1, rel=1e-6) and got[3] == pytest.approx(-1e-30, rel=1e-6)


def test_lookup_reads_never_create_a_session(store: TraceStore) -> None:
    m = store.lookup("nobody", "some text")
    assert (m.text_len, m.token_ids, m.node, m.path) == (0, [], None, ())
    assert store.search("nobody", "x").segments == ()
    assert all(not store.redis.exists(k) for k in store.keys.data_keys("nobody"))
    with pytest.raises(PromptMismatch) as ei:
        store.export_training_trace("nobody", "text")
    assert ei.value.matched_len == 0 and ei.value.nearest_ends == []


def test_the_layout_reads_by_hand_as_documented(store: TraceStore) -> None:
    """docs/traces.md, "Reading a session by hand": ids of 16 hex characters (node_id of the
    key), records num.wid,parent_num,end,ntok,flags,version,expert_key, tok and txt keyed by
    number; numbers 1.. in write order, a retried turn's answer a sibling of the first; the
    nodes of one call share its write id, #v keeps the chain of the calls' ids after the version."""
    final = _three_turns(store, "hand")
    m = store.lookup("hand", final[: -len(R3)])
    store.record_turn("hand", final[: -len(R3)], "5<|end|>", prefix=m, delta_token_ids=[],
                      response_token_ids=[16], response_logprobs=[-1.0], version=4)
    r: Any = store.redis
    k = store.keys
    idx = {f.decode(): v.decode() for f, v in r.hgetall(k.idx("hand")).items()}
    version, _, last_wid = idx.pop("#v").partition(".")
    assert version == "4" and idx.pop("#e")
    keys = _keys_in_order(final) + [final[: -len(R3)] + "5<|end|>"]
    assert sorted(idx) == sorted(node_id(x) for x in keys)
    assert all(len(f) == 16 and int(f, 16) >= 0 for f in idx)
    recs = [idx[node_id(x)].split(",") for x in keys]
    nums = [x[0].split(".") for x in recs]
    assert [int(n) for n, _ in nums] == list(range(1, 8))  # write order
    wids = [w for _, w in nums]
    assert all(re.fullmatch("[0-9a-f]{8}", w) for w in wids)
    # three turns of two nodes, then the retry's answer alone: four calls, four write ids
    assert wids[0] == wids[1] != wids[2] == wids[3] != wids[4] == wids[5] != wids[6]
    assert len(set(wids)) == 4
    chain = ""  # sha1 of the previous chain, ':' and each call's write id, 16 hex characters
    for w in (wids[0], wids[2], wids[4], wids[6]):
        chain = hashlib.sha1(f"{chain}:{w}".encode()).hexdigest()[:16]
    assert last_wid == chain
    assert [x[1] for x in recs] == ["", "1", "2", "3", "4", "5", "5"]  # the retry's answer: under node 5
    assert [int(x[2]) for x in recs] == [len(x) for x in keys]
    ids = {1: [1, 2, 3], 2: [10, 11], 3: [4, 5], 4: [12], 5: [6, 7, 8], 6: [13, 14, 15], 7: [16]}
    texts = r.hgetall(k.txt("hand"))
    assert sorted(int(f) for f in r.hkeys(k.tok("hand"))) == sorted(int(f) for f in texts) == list(range(1, 8))
    for num, want in ids.items():
        data = r.hget(k.tok("hand"), str(num))
        assert array("i", data[: 4 * len(want)]).tolist() == want
    assert b"".join(texts[str(i).encode()] for i in range(1, 7)).decode() == final


def test_a_reopened_session_numbers_its_nodes_again_and_warm_readers_follow(
    store_factory: Callable[..., TraceStore],
) -> None:
    """Node numbers name nodes of one data epoch: after a purge and a reopen, number 1 is
    another node, and a client whose cache holds the old epoch must not read it as the old one."""
    a, b = store_factory(), store_factory()
    _turn(a, "re", "p", "q", [1, 2], [3])  # nodes 1 "p", 2 "pq"
    assert b.lookup("re", "p").token_ids == [1, 2]  # b: index of the old epoch, payload of node 1
    a.drop_session_data("re")
    a.redis.delete(a.keys.dead("re"))  # reopened (the tombstone is gone)
    _turn(a, "re", "x", "y", [7], [8])  # now number 2 is "xy"
    # b asks for "pq"'s payload by its old number, 2: the reply is "xy"'s, under the new epoch
    with pytest.raises(PromptMismatch):
        b.export_training_trace("re", "pq")
    _turn(a, "re", "p", "q", [1, 2], [9])  # "pq" again, with other ids (nodes 3 and 4)
    assert b.export_training_trace("re", "pq").input_ids == [1, 2, 9]
    assert b.lookup("re", "xy").token_ids == [7, 8]


def test_an_insert_judged_on_a_stale_cached_index_is_judged_again_on_the_server(
    store_factory: Callable[..., TraceStore],
) -> None:
    """insert checks a new node's expert key against its parent's before any I/O, on the
    cached index: after a purge and a reopen that parent is gone, and the insert must be
    judged on the server's index (found by the trace model test's programs)."""
    a, b = store_factory(), store_factory()
    b.insert("ins", "p", Segment([1]))  # b caches "p", which has no expert key
    a.drop_session_data("ins")
    a.redis.delete(a.keys.dead("ins"))  # reopened: "p" is gone
    node = b.insert("ins", "px", Segment([2], expert_key="e:1"))  # a root now: allowed
    assert node.parent is None and node.expert_key == "e:1"
    assert a.export_training_trace("ins", "px").input_ids == [2]
    b.insert("ins", "pxy", Segment([3], expert_key="e:2"))
    with pytest.raises(InvalidInput) as ei:  # a mix on the server's index is still refused
        b.insert("ins", "pxyz", Segment([4]))
    assert ei.value.field == "segment.expert_key"


def _roll_back(st: TraceStore, path: Any) -> None:
    """The store goes back to the checkpoint at ``path``: what failover to a lagging replica
    does to the writes it lost (the run deleted, the checkpoint restored, same run id)."""
    st.delete_run(force=True)
    st.restore(path)


def test_after_a_rollback_a_warm_client_reads_the_new_history_not_the_lost_one(
    store_factory: Callable[..., TraceStore], tmp_path: Any,
) -> None:
    """A rollback hands out the same index version and node numbers again, for other nodes
    (docs/traces.md, Write ids). a's cache holds the lost history at the version b's new
    write reaches: neither the index (same version, another chain), nor a payload read by its old
    number (now another node's), nor a payload cached for a node stored again with other
    tokens may be read as current."""
    a, b = store_factory(), store_factory()
    a.open_session("rb", "producer")
    _turn(a, "rb", "p", "q", [1, 2], [3])  # nodes 1 "p", 2 "pq": index version 1
    a.checkpoint(tmp_path / "v1.tsck")
    _turn(a, "rb", "pq", "x", [], [4])  # node 3 "pqx", version 2: lost below
    _turn(a, "rb", "pq", "w", [], [6])  # node 4 "pqw", version 3: lost below
    assert a.export_training_trace("rb", "pqx").input_ids == [1, 2, 3, 4]  # a caches it all
    _roll_back(b, tmp_path / "v1.tsck")
    _turn(b, "rb", "pq", "y", [], [5])  # node 3 is "pqy" now, version 2
    _turn(b, "rb", "pq", "w", [], [7])  # "pqw" again, node 4, version 3, other tokens
    with pytest.raises(PromptMismatch):  # a's index (version 3) is not b's (version 3)
        a.export_training_trace("rb", "pqx")
    assert a.export_training_trace("rb", "pqy").input_ids == [1, 2, 3, 5]
    assert a.export_training_trace("rb", "pqw").input_ids == [1, 2, 3, 7]  # not a's cached [6]
    assert a.lookup("rb", "pqw and more").token_ids == [1, 2, 3, 7]
    # a payload asked for by the number a cached: number 3 is "pqy"'s now
    c = store_factory()
    assert c.lookup("rb", "pqy").token_ids == [1, 2, 3, 5]
    c.checkpoint(tmp_path / "v3.tsck")
    _turn(c, "rb", "pqy", "!", [], [8])  # c caches version 4 with "pqy!" (node 5)
    node_cache(c.context).clear()
    assert c.export_training_trace("rb", "pqy!").input_ids == [1, 2, 3, 5, 8]
    cache = node_cache(c.context)
    for key in [k for k in list(cache._items) if k[0] == "tok"]:  # c keeps the index, not the payloads
        cache.discard(key)
    _roll_back(b, tmp_path / "v3.tsck")
    _turn(b, "rb", "pqy", "?", [], [9])  # node 5 is "pqy?" now, version 4
    with pytest.raises(PromptMismatch):
        c.export_training_trace("rb", "pqy!")
    assert c.export_training_trace("rb", "pqy?").input_ids == [1, 2, 3, 5, 9]


def test_a_call_sent_again_after_a_rollback_does_not_make_the_two_histories_look_alike(
    store_factory: Callable[..., TraceStore], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call whose reply a failover lost is sent again, with the same write id (a client's
    retry resends its arguments), after another writer: the index reaches the version the lost
    history had, and that call's write id. The chain in #v covers every write of the index, so
    the two histories still differ (review of stop 23: the last call's id alone matched)."""
    import tracestore.traces.write as write_mod

    a, b, c, d = store_factory(), store_factory(), store_factory(), store_factory()
    a.open_session("rb3", "producer")
    _turn(a, "rb3", "p", "q", [1, 2], [3])  # version 1
    a.checkpoint(tmp_path / "v1.tsck")  # what the lagging replica has
    _turn(b, "rb3", "pq", "x", [], [4])  # version 2 "pqx": lost
    monkeypatch.setattr(write_mod, "new_wid", lambda: "deadbeef")
    _turn(c, "rb3", "pq", "w", [], [6])  # version 3 "pqw": lost, its reply too
    monkeypatch.undo()
    assert a.export_training_trace("rb3", "pqx").input_ids == [1, 2, 3, 4]  # a caches it all
    lost_v = a.redis.hget(a.keys.idx("rb3"), "#v")
    _roll_back(b, tmp_path / "v1.tsck")
    _turn(d, "rb3", "pq", "y", [], [5])  # version 2 "pqy"
    monkeypatch.setattr(write_mod, "new_wid", lambda: "deadbeef")
    _turn(c, "rb3", "pq", "w", [], [6])  # c's call again: version 3, the same write id
    monkeypatch.undo()
    now_v = a.redis.hget(a.keys.idx("rb3"), "#v")
    assert now_v.split(b".")[0] == lost_v.split(b".")[0] == b"3" and now_v != lost_v
    with pytest.raises(PromptMismatch):
        a.export_training_trace("rb3", "pqx")
    assert a.export_training_trace("rb3", "pqy").input_ids == [1, 2, 3, 5]
    assert a.export_training_trace("rb3", "pqw").input_ids == [1, 2, 3, 6]  # the same call's nodes
    assert a.insert("rb3", "pqyz", Segment([9])).parent == node_id("pqy")  # judged on the new index


def test_a_turn_on_a_prefix_read_before_a_rollback_is_refused(
    store_factory: Callable[..., TraceStore], tmp_path: Any,
) -> None:
    """record_turn extends the prefix's token ids as lookup read them: when the store rolled
    back and the prefix node was stored again (other tokens), the turn is refused, nothing is
    written, and a lookup again gives the stored ids."""
    a, b = store_factory(), store_factory()
    a.open_session("rb2", "producer")
    a.checkpoint(tmp_path / "empty.tsck")
    _turn(a, "rb2", "p", "q", [1, 2], [3])
    m = a.lookup("rb2", "pq")
    assert m.token_ids == [1, 2, 3]
    _roll_back(b, tmp_path / "empty.tsck")
    _turn(b, "rb2", "p", "q", [1, 2], [30])  # "pq" again, another write, other tokens
    before = b.redis.hgetall(b.keys.idx("rb2"))
    with pytest.raises(PrefixChanged, match="stored again") as ei:
        a.record_turn("rb2", "pq", "z", prefix=m, delta_token_ids=[], response_token_ids=[4],
                      response_logprobs=[-0.5], version=0)
    assert ei.value.field == "prefix"
    assert b.redis.hgetall(b.keys.idx("rb2")) == before
    _turn(a, "rb2", "pq", "z", [], [4])
    assert a.lookup("rb2", "pqz").token_ids == [1, 2, 30, 4]
    assert a.export_training_trace("rb2", "pqz").input_ids == [1, 2, 30, 4]
    # a rollback that loses the prefix altogether: the same error (stored False), nothing written
    m = a.lookup("rb2", "pqz")
    _roll_back(b, tmp_path / "empty.tsck")
    with pytest.raises(PrefixChanged, match="no longer stored") as ei2:
        a.record_turn("rb2", "pqz", "!", prefix=m, delta_token_ids=[], response_token_ids=[5],
                      response_logprobs=[-0.5], version=0)
    assert not ei2.value.stored and ei2.value.field == "prefix"
    assert not b.redis.exists(b.keys.idx("rb2"))


def test_a_prefixs_write_id_is_checked_even_when_empty_and_must_be_hex(store_factory: Callable[..., TraceStore]) -> None:
    """The prefix of a turn is sent as "id.wid" whatever its wid: a node read without one (a
    record written before write ids, e.g. restored from a version 1 or 2 checkpoint) must still
    be stored without one; a wid that is not 8 lowercase hex is refused as InvalidInput, not a
    script error. Nothing is written either way."""
    import dataclasses

    a = store_factory()
    _turn(a, "legacy", "p", "q", [1, 2], [3])
    r, k = a.redis, a.keys
    for f, v in r.hgetall(k.idx("legacy")).items():  # the records as a schema 1 file restores them
        if not f.startswith(b"#"):
            head, rest = v.split(b",", 1)
            r.hset(k.idx("legacy"), f, head.split(b".")[0] + b"," + rest)
    r.hset(k.idx("legacy"), "#v", r.hget(k.idx("legacy"), "#v").split(b".")[0])
    b = store_factory()
    m = b.lookup("legacy", "pq+")
    assert m.token_ids == [1, 2, 3] and m.node is not None and m.node.wid == ""
    call = {"delta_token_ids": [4], "response_token_ids": [5], "response_logprobs": [0.0], "version": 0}
    # the prefix stored again (another write) since b read it: refused
    rec = r.hget(k.idx("legacy"), m.node.id)
    r.hset(k.idx("legacy"), m.node.id, rec.replace(b",", b".0badf00d,", 1))
    before = r.hgetall(k.idx("legacy"))
    with pytest.raises(PrefixChanged, match="stored again"):
        b.record_turn("legacy", "pq+", "r", prefix=m, **call)  # type: ignore[arg-type]
    r.hset(k.idx("legacy"), m.node.id, rec)
    bad = dataclasses.replace(m, node=dataclasses.replace(m.node, wid="NOT-HEX"))
    with pytest.raises(InvalidInput) as ei:
        b.record_turn("legacy", "pq+", "r", prefix=bad, **call)  # type: ignore[arg-type]
    assert ei.value.field == "prefix"
    assert r.hgetall(k.idx("legacy")) == {**before, m.node.id.encode(): rec}
    b.record_turn("legacy", "pq+", "r", prefix=m, **call)  # type: ignore[arg-type]
    assert a.export_training_trace("legacy", "pq+r").input_ids == [1, 2, 3, 4, 5]


def test_retry_is_idempotent_and_does_not_bump_the_index(store: TraceStore) -> None:
    p = SYS + U1
    t1 = _turn(store, "idem", p, R1, [1, 2], [3])
    assert t1.written == 2 and t1.delta is not None
    v = store.redis.hget(store.keys.idx("idem"), "#v")
    before = _session_dump(store, "idem")
    m = PrefixMatch(0, [], None)  # the prefix the first call used
    t2 = store.record_turn(
        "idem",
        p,
        R1,
        prefix=m,
        delta_token_ids=[1, 2],
        response_token_ids=[3],
        response_logprobs=[-0.5],
        version=0,
    )
    assert t2.written == 0 and (t2.delta, t2.response) == (t1.delta, t1.response)
    assert store.redis.hget(store.keys.idx("idem"), "#v") == v
    assert _session_dump(store, "idem") == before


def test_match_of_lookup_records_the_same_nodes_as_a_rehashed_one(store: TraceStore) -> None:
    """record_turn continues lookup's hash state only for exactly the text it hashed."""
    sid = "rehash"
    p1 = SYS + U1
    _turn(store, sid, p1, R1, [1, 2], [3])
    p2 = p1 + R1 + U3  # non-ASCII: character and byte offsets differ
    m = store.lookup(sid, p2 + "tail the record does not get")
    assert m.text_len == len(p1 + R1)
    kw: dict[str, Any] = {
        "delta_token_ids": [4],
        "response_token_ids": [5],
        "response_logprobs": [-0.5],
        "version": 1,
    }
    t = store.record_turn(sid, p2, R3, prefix=m, **kw)
    assert t.written == 2
    assert t.delta is not None and t.delta.id == node_id(p2) and t.delta.parent == m.node.id  # type: ignore[union-attr]
    assert t.response.id == node_id(p2 + R3) and t.response.parent == node_id(p2)
    # the same match again (a retry), and a copy that lost the hash state: equal nodes
    for again in (m, pickle.loads(pickle.dumps(m))):
        assert again == m
        t2 = store.record_turn(sid, p2, R3, prefix=again, **kw)
        assert (t2.written, t2.delta, t2.response) == (0, t.delta, t.response)
    assert store.export_training_trace(sid, p2 + R3).input_ids == [1, 2, 3, 4, 5]
    # a prompt that differs inside the matched prefix is refused, wherever it differs
    cut = m.text_len
    for bad in ("X" + p2[1:], p2[: cut - 1] + "X" + p2[cut:]):
        with pytest.raises(InvalidInput) as ei:
            store.record_turn(sid, bad, R3, prefix=m, **kw)
        assert ei.value.field == "prefix"
    for bad_text in (None, b"bytes", p2 + "\udcff"):
        with pytest.raises(InvalidInput) as ei:
            store.record_turn(sid, bad_text, R3, prefix=m, **kw)  # type: ignore[arg-type]
        assert ei.value.field == "prompt_text"


def test_branch_after_a_retried_turn(store: TraceStore) -> None:
    sid = "br"
    p1 = SYS + U1
    _turn(store, sid, p1, R1, [1, 2], [3], version=1)
    p2 = p1 + R1 + U2
    a = _turn(store, sid, p2, R2, [4], [5], version=2)
    # retry: the lookup now matches the stored prompt, so the delta is empty
    b = _turn(store, sid, p2, R2B, [], [6, 7], version=3)
    assert b.delta is None and b.written == 1  # the delta node is shared
    assert b.response.parent == a.delta.id  # type: ignore[union-attr]
    ta = store.export_training_trace(sid, p2 + R2)
    tb = store.export_training_trace(sid, p2 + R2B)
    assert ta.input_ids == [1, 2, 3, 4, 5] and ta.versions == [1, 1, 1, 2, 2]
    assert tb.input_ids == [1, 2, 3, 4, 6, 7] and tb.versions == [1, 1, 1, 2, 3, 3]
    # continue the second branch
    p3 = p2 + R2B + U3
    m = store.lookup(sid, p3)
    assert m.text_len == len(p2 + R2B) and m.token_ids == tb.input_ids
    _turn(store, sid, p3, R3, [8], [9], version=4)
    assert store.export_training_trace(sid, p3 + R3).input_ids == [1, 2, 3, 4, 6, 7, 8, 9]
    assert store.export_training_trace(sid, p2 + R2).input_ids == [1, 2, 3, 4, 5]


def test_empty_delta_hangs_the_response_under_the_prefix(store: TraceStore) -> None:
    sid = "ed"
    _turn(store, sid, "a", "b", [1], [2])
    # the prompt adds text but the tokenizer produced no new tokens for it
    t = _turn(store, sid, "ab+", "c", [], [3])
    assert t.delta is None and t.response.parent == node_id("ab")
    tr = store.export_training_trace(sid, "ab+c")
    assert tr.input_ids == [1, 2, 3] and tr.labels == [-100, 2, 3]
    # a prompt equal to a stored key: no delta at all
    t = _turn(store, sid, "ab+c", "d", [], [4])
    assert t.delta is None and t.response.parent == node_id("ab+c")
    with pytest.raises(InvalidInput) as ei:
        _turn(store, sid, "ab+cd", "e", [9], [5])
    assert ei.value.field == "delta_token_ids"


def test_expert_keys_per_node_none_or_mix(store: TraceStore) -> None:
    _turn(store, "ek", "p", "r", [1], [2], dkey="ref:d1", rkey="ref:r1")
    _turn(store, "ek", "pr+q", "s", [3], [4], dkey="ref:d2", rkey="ref,with,commas")
    tr = store.export_training_trace("ek", "pr+qs")
    assert tr.expert_keys == ["ref:d1", "ref:r1", "ref:d2", "ref,with,commas"]
    _turn(store, "none", "p", "r", [1], [2])
    assert store.export_training_trace("none", "pr").expert_keys is None
    _turn(store, "mix", "p", "r", [1], [2], dkey="ref:d1", rkey="ref:r1")
    # data that mixes keyed and unkeyed nodes (written by hand, or before record_turn
    # refused it) is refused by the export, naming how many nodes lack a key
    _turn(store, "mix", "pr+q", "s", [3], [4], dkey="ref:d2", rkey="ref:r2")
    r: Any = store.redis
    k = store.keys
    for digest, record in r.hgetall(k.idx("mix")).items():
        rec = record.decode()
        if rec.endswith(",ref:d2") or rec.endswith(",ref:r2"):
            r.hset(k.idx("mix"), digest, rec.rsplit(",", 1)[0] + ",")
    store.context.caches.clear()  # the client caches immutable nodes; these were changed by hand
    assert store.export_training_trace("mix", "pr").expert_keys == ["ref:d1", "ref:r1"]
    with pytest.raises(InvalidInput) as ei:
        store.export_training_trace("mix", "pr+qs")
    assert ei.value.field == "expert_keys" and "2 of 4" in str(ei.value)


def test_record_turn_refuses_expert_keys_that_would_make_the_trace_unexportable(
    store: TraceStore,
) -> None:
    # the case: a response key without a delta key on a non-empty delta
    with pytest.raises(InvalidInput) as ei:
        _turn(store, "rk", "p", "r", [1], [2], rkey="ref:r1")
    assert ei.value.field == "delta_expert_key" and "export" in str(ei.value)
    with pytest.raises(InvalidInput) as ei:
        _turn(store, "rk", "p", "r", [1], [2], dkey="ref:d1")
    assert ei.value.field == "response_expert_key"
    assert set(_session_dump(store, "rk").values()) == {None}  # no key exists
    # an empty delta needs no delta key
    _turn(store, "rk", "", "r", [], [2], rkey="ref:r1")
    # keyed and unkeyed turns cannot follow each other on one path; nothing is written
    _turn(store, "keyed", "p", "r", [1], [2], dkey="ref:d1", rkey="ref:r1")
    _turn(store, "plain", "p", "r", [1], [2])
    before = (_session_dump(store, "keyed"), _session_dump(store, "plain"))
    for sid, dkey, rkey in (("keyed", None, None), ("plain", "ref:d2", "ref:r2")):
        with pytest.raises(InvalidInput) as ei:
            _turn(store, sid, "pr+q", "s", [3], [4], dkey=dkey, rkey=rkey)
        assert ei.value.field == "response_expert_key" and "stored prefix node" in str(ei.value)
    with pytest.raises(InvalidInput):  # insert under a keyed node without a key, likewise
        store.insert("keyed", "pr+q", Segment(token_ids=[3]))
    assert (_session_dump(store, "keyed"), _session_dump(store, "plain")) == before
    assert store.export_training_trace("keyed", "pr").expert_keys == ["ref:d1", "ref:r1"]
    assert store.export_training_trace("plain", "pr").expert_keys is None


def test_negative_zero_logprob_is_an_equal_rewrite_not_a_conflict(store: TraceStore) -> None:
    m = PrefixMatch(0, [], None)
    kw: dict[str, Any] = {"prefix": m, "delta_token_ids": [1], "response_token_ids": [2, 3], "version": 0}
    first = store.record_turn("nz", "p", "r", response_logprobs=[0.0, -1.0], **kw)
    before = _session_dump(store, "nz")
    again = store.record_turn("nz", "p", "r", response_logprobs=[-0.0, -1.0], **kw)  # -0.0 == 0.0
    assert (first.written, again.written) == (2, 0)
    assert _session_dump(store, "nz") == before


def test_node_conflict_changes_nothing(store: TraceStore) -> None:
    sid = "nc"
    _turn(store, sid, "p", "r", [1], [2], dkey="ref:d", rkey="ref:a")
    before = _session_dump(store, sid)
    m = PrefixMatch(0, [], None)
    for kw in (
        {"response_token_ids": [3], "response_logprobs": [-0.5]},  # other tokens
        {"response_token_ids": [2], "response_logprobs": [-0.25]},  # other logprobs
        {"response_token_ids": [2], "response_logprobs": [-0.5], "version": 7},  # other version
        {"response_token_ids": [2], "response_logprobs": [-0.5], "response_expert_key": "ref:b"},
    ):
        args: dict[str, Any] = {
            "version": 0, "delta_expert_key": "ref:d", "response_expert_key": "ref:a", **kw
        }
        with pytest.raises(NodeConflict) as ei:
            store.record_turn(sid, "p", "r", prefix=m, delta_token_ids=[1], **args)
        # a new version changes the delta node too, which is checked first
        assert ei.value.sid == sid and ei.value.digest in (node_id("p"), node_id("pr"))
        assert _session_dump(store, sid) == before
    # a conflicting delta refuses the whole turn, even with a new response
    with pytest.raises(NodeConflict) as ei:
        store.record_turn(
            sid,
            "p",
            "other",
            prefix=m,
            delta_token_ids=[9],
            response_token_ids=[2],
            response_logprobs=[-0.5],
            version=0,
            delta_expert_key="ref:d",
            response_expert_key="ref:a",
        )
    assert ei.value.digest == node_id("p")
    assert _session_dump(store, sid) == before


def test_prompt_mismatch_reports_where(store: TraceStore) -> None:
    sid = "pm"
    final = _three_turns(store, sid)
    wrong = final[:-10] + "X" + final[-9:]
    with pytest.raises(PromptMismatch) as ei:
        store.export_training_trace(sid, wrong)
    e = ei.value
    p3 = final[: -len(R3)]
    assert e.sid == sid and e.matched_len == len(p3) and e.prompt_len == len(wrong)
    assert len(final) in e.nearest_ends and len(e.nearest_ends) <= 8
    assert e.window is not None and f"at char {len(final) - 10}" in e.window
    assert "X" in e.window and "welcome" in e.window
    # longer than anything stored: the window says where the stored key ends
    with pytest.raises(PromptMismatch) as ei:
        store.export_training_trace(sid, final + "more")
    assert ei.value.matched_len == len(final)
    assert ei.value.window is not None and "more" in ei.value.window


def test_store_text_false_keeps_no_text(store_factory: Callable[..., TraceStore]) -> None:
    st = store_factory(store_text=False)
    final = _three_turns(st, "nt")
    assert not st.redis.exists(st.keys.txt("nt"))
    assert st.export_training_trace("nt", final).input_ids[:3] == [1, 2, 3]
    with pytest.raises(PromptMismatch) as ei:
        st.export_training_trace("nt", final[:-1] + "?")
    assert ei.value.matched_len == len(final) - len(R3) and ei.value.window is None
    with_text = store_factory()
    _three_turns(with_text, "wt")
    txt = with_text.redis.hgetall(with_text.keys.txt("wt"))
    idx = with_text.redis.hgetall(with_text.keys.idx("wt"))
    # txt is keyed by node number, the first field of the node's index record (before ".wid")
    num = {f: v.split(b",", 1)[0].split(b".")[0] for f, v in idx.items()}
    assert b"".join(txt[num[node_id(k).encode()]] for k in _keys_in_order(final)).decode() == final


def _keys_in_order(final: str) -> list[str]:
    p1 = SYS + U1
    p2 = p1 + R1 + U2
    p3 = p2 + R2 + U3
    return [p1, p1 + R1, p2, p2 + R2, p3, final]


def test_drop_session_data_then_writes_raise(store: TraceStore) -> None:
    sid = "drop"
    final = _three_turns(store, sid)
    store.export_training_trace(sid, final)  # warm the cache
    assert store.drop_session_data(sid) == 3
    assert all(not store.redis.exists(k) for k in store.keys.data_keys(sid))
    with pytest.raises(SessionReleased) as ei:
        _turn(store, sid, "p", "r", [1], [2])
    assert ei.value.sid == sid
    before = _session_dump(store, sid)
    with pytest.raises(SessionReleased):
        store.record_turn(
            sid,
            "p",
            "r",
            prefix=PrefixMatch(0, [], None),
            delta_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[0.0],
            version=0,
        )
    with pytest.raises(SessionReleased):
        store.insert(sid, "p", Segment([1]))
    with pytest.raises(SessionReleased):
        store.export_training_trace(sid, final)
    assert _session_dump(store, sid) == before
    assert store.drop_session_data(sid) == 0  # idempotent


def test_insert_and_search_xtuner_style(store: TraceStore) -> None:
    sid = "xt"
    n1 = store.insert(sid, "hello", Segment([1, 2], text="hello"))
    assert n1.parent is None and not n1.generated
    n2 = store.insert(sid, "hello world", Segment([3], logprobs=[-1.0], labels=[3], version=2))
    assert n2.parent == n1.id and n2.generated
    # explicit labels that are not derivable
    n3 = store.insert(sid, "hello world!", Segment([4, 5], labels=[-100, 5]))
    assert n3.flags == 2 and n3.parent == n2.id
    # a key between stored ones hangs under the longest proper prefix; edges never split
    n4 = store.insert(sid, "hello wo", Segment([6]))
    assert n4.parent == n1.id
    assert store.insert(sid, "hello wo", Segment([6])) == n4  # equal rewrite: no-op
    with pytest.raises(NodeConflict):
        store.insert(sid, "hello wo", Segment([7]))
    with pytest.raises(InvalidInput) as ei:
        store.insert(sid, "hello there", Segment([1], text="not the segment"))
    assert ei.value.field == "segment.text"
    m = store.search(sid, "hello world!?")
    assert m.text_len == len("hello world!")
    assert [s.text for s in m.segments] == ["hello", " world", "!"]
    assert [list(s.labels or []) for s in m.segments] == [[-100, -100], [3], [-100, 5]]
    assert [s.version for s in m.segments] == [0, 2, 0]
    assert m.token_ids == [1, 2, 3, 4, 5]
    tr = store.export_training_trace(sid, "hello world!")
    assert tr.labels == [-100, -100, 3, -100, 5]
    assert store.search(sid, "hello wonder").token_ids == [1, 2, 6]
    assert store.search(sid, "help").text_len == 0


# -- atomicity: refused writes leave every key byte-identical -------------------------------


def _bad_calls(
    sid: str, prefix: PrefixMatch, foreign: PrefixMatch, prompt: str
) -> list[tuple[str, str, dict[str, Any], type]]:
    """(case, field the error names, record_turn kwargs, error type)."""
    ok: dict[str, Any] = {
        "sid": sid,
        "prompt_text": prompt,
        "response_text": "resp",
        "prefix": prefix,
        "delta_token_ids": [7, 8],
        "response_token_ids": [9, 10],
        "response_logprobs": [-0.1, -0.2],
        "version": 1,
        "delta_expert_key": "d",
        "response_expert_key": "r",
    }
    unkeyed = {"delta_expert_key": None, "response_expert_key": None}
    big = 2_000  # tokens; max_payload_bytes is 1000 in this test
    return [
        ("length mismatch", "response_logprobs", {**ok, "response_logprobs": [-0.1]}, InvalidInput),
        (
            "id above int32",
            "response_token_ids",
            {**ok, "response_token_ids": [1, 2**31]},
            InvalidInput,
        ),
        ("negative id", "delta_token_ids", {**ok, "delta_token_ids": [7, -1]}, InvalidInput),
        (
            "+inf logprob",
            "response_logprobs",
            {**ok, "response_logprobs": [-0.1, math.inf]},
            InvalidInput,
        ),
        (
            "nan logprob",
            "response_logprobs",
            {**ok, "response_logprobs": [math.nan, -0.1]},
            InvalidInput,
        ),
        (
            "parent not found",
            "prefix",
            {**ok, **unkeyed, "prefix": foreign, "delta_token_ids": []},
            InvalidInput,
        ),
        ("response key alone", "delta_expert_key", {**ok, "delta_expert_key": None}, InvalidInput),
        ("unkeyed turn on a keyed path", "response_expert_key", {**ok, **unkeyed}, InvalidInput),
        (
            "payload too big",
            "response_token_ids",
            {**ok, "response_token_ids": [1] * big, "response_logprobs": [0.0] * big},
            InvalidInput,
        ),
        ("delta too big", "delta_token_ids", {**ok, "delta_token_ids": [1] * big}, InvalidInput),
        (
            "lone surrogate in prompt",
            "prompt_text",
            {**ok, "prompt_text": prompt + "\ud800", "prefix": prefix},
            InvalidInput,
        ),
        (
            "lone surrogate in response",
            "response_text",
            {**ok, "response_text": "a\udfffb"},
            InvalidInput,
        ),
        (
            "bad expert key",
            "response_expert_key",
            {**ok, "response_expert_key": "a\nb"},
            InvalidInput,
        ),
        ("negative version", "version", {**ok, "version": -1}, InvalidInput),
        (
            "prefix of another prompt",
            "prefix",
            {**ok, "prompt_text": "Z" + prompt[1:]},
            InvalidInput,
        ),
    ]


def test_refused_record_turn_leaves_every_key_byte_identical(
    store_factory: Callable[..., TraceStore],
) -> None:
    st = store_factory(max_payload_bytes=1000)
    sid = "atom"
    final = _three_turns(st, sid, dkey="d", rkey="r")
    prompt = final + "<|user|>next<|end|><|assistant|>"
    prefix = st.lookup(sid, prompt)
    assert prefix.text_len == len(final)
    # a match taken in another session: its node is not stored in this one
    _turn(st, "elsewhere", prompt, "x", [1], [2])
    foreign = st.lookup("elsewhere", prompt + "x")
    assert foreign.node is not None
    foreign = PrefixMatch(foreign.text_len - 1, [1], foreign.path[0], foreign.path[:1])
    assert foreign.text_len == len(prompt)
    before = _session_dump(st, sid)
    assert before and any(k.endswith(":tok") for k in before)
    cases = _bad_calls(sid, prefix, foreign, prompt)
    for case, field, kwargs, err in cases:
        with pytest.raises(err) as ei:
            st.record_turn(**kwargs)
        assert getattr(ei.value, "field", None) == field, f"{case}: {ei.value}"
        assert _session_dump(st, sid) == before, case
    # tombstoned session: SessionReleased names the session, nothing is written
    _turn(st, "tomb", "p", "r", [1], [2])
    st.drop_session_data("tomb")
    tomb_before = _session_dump(st, "tomb")
    with pytest.raises(SessionReleased) as ei2:
        st.record_turn(
            **{
                **cases[0][2],
                "sid": "tomb",
                "response_logprobs": [-0.1, -0.2],
                "prefix": PrefixMatch(0, [], None),
            }
        )
    assert ei2.value.sid == "tomb"
    assert _session_dump(st, "tomb") == tomb_before
    # and the valid call still works afterwards
    st.record_turn(**{**cases[0][2], "response_logprobs": [-0.1, -0.2]})
    assert st.export_training_trace(sid, prompt + "resp").input_ids[-4:] == [7, 8, 9, 10]


def test_refused_insert_leaves_every_key_byte_identical(store: TraceStore) -> None:
    sid = "atom-ins"
    store.insert(sid, "abc", Segment([1, 2]))
    before = _session_dump(store, sid)
    for field, key, seg in (
        ("segment.logprobs", "abcd", Segment([1], logprobs=[0.0, 0.0])),
        ("segment.logprobs", "abcd", Segment([1], logprobs=[math.nan])),
        ("segment.token_ids", "abcd", Segment([2**40])),
        ("segment.labels", "abcd", Segment([1], labels=[-5])),
        ("key_text", "abc\udc00", Segment([1])),
        ("segment.text", "abcd", Segment([1], text="\ud800")),
    ):
        with pytest.raises(InvalidInput) as ei:
            store.insert(sid, key, seg)
        assert ei.value.field == field
        assert _session_dump(store, sid) == before


# -- cache safety ------------------------------------------------------------------------------


def test_insert_on_a_stale_index_is_refused_then_placed_under_the_new_parent(
    store_factory: Callable[..., TraceStore],
) -> None:
    """Guard: insert_node.lua's stale-index check (the write is conditional on the index
    version the client chose its parent from). Deterministic: another client's insert
    lands between this client's cached read and its write, and makes a longer prefix."""
    a, b = store_factory(), store_factory()
    sid = "stale-ins"
    a.insert(sid, "he", Segment([1]))  # a's cache now holds the index
    gen = traces.insert(a.context, sid, "hello world", Segment([3]))
    req = next(gen)
    assert isinstance(req, Eval) and req.script.name == "insert_node"  # warm: straight to the write
    hello = b.insert(sid, "hello", Segment([2]))  # meanwhile: the longest prefix changes
    before = _session_dump(a, sid)
    reply = a.execute(req)
    assert int(reply[0]) == 1, "a write chosen from a stale index was not refused"
    assert _session_dump(a, sid) == before  # refused: nothing written
    try:
        while True:  # the client re-reads the index, chooses the parent again, writes
            req = gen.send(a.execute(req))
    except StopIteration as stop:
        node = stop.value
    assert node.parent == hello.id
    for st in (a, b):
        m = st.search(sid, "hello world")
        assert [seg.text for seg in m.segments] == ["he", "llo", " world"]
        assert st.export_training_trace(sid, "hello world").input_ids == [1, 2, 3]


def test_two_clients_warm_cache_never_stale(store_factory: Callable[..., TraceStore]) -> None:
    a = store_factory()
    b = store_factory(cache_bytes=4096)  # tiny: evicts constantly
    sid = "cache"
    p1 = SYS + U1
    _turn(a, sid, p1, R1, [1], [2])
    assert b.lookup(sid, p1 + R1 + U2).token_ids == [1, 2]  # b warm on v2
    assert a.lookup(sid, p1 + R1 + U2).token_ids == [1, 2]  # a warm on v2
    # b writes the next turn; a's cached index is now stale
    _turn(b, sid, p1 + R1 + U2, R2, [3], [4])
    m = a.lookup(sid, p1 + R1 + U2 + R2 + U3)
    assert m.text_len == len(p1 + R1 + U2 + R2) and m.token_ids == [1, 2, 3, 4]
    # interleave writes on two branches from both clients; every read agrees with a cold client
    base = p1 + R1 + U2
    for i in range(12):
        w = (a, b)[i % 2]
        key = base + f"<|branch {i % 3}|>" * (i // 3 + 1)
        _turn(w, sid, key, f"resp{i}", [100 + i], [200 + i])
    cold = store_factory(cache_bytes=0)
    for i in range(12):
        key = base + f"<|branch {i % 3}|>" * (i // 3 + 1) + f"resp{i}"
        for c in (a, b):
            assert c.lookup(sid, key + "tail") == cold.lookup(sid, key + "tail")
            assert c.export_training_trace(sid, key) == cold.export_training_trace(sid, key)
    # purge and a new incarnation (tombstone removed): cached nodes of the old epoch are not used
    assert a.export_training_trace(sid, p1 + R1).input_ids == [1, 2]
    a.drop_session_data(sid)
    a.redis.delete(a.keys.dead(sid))
    _turn(b, sid, p1, R1, [7], [8])  # same keys, other tokens, new epoch
    assert a.lookup(sid, p1 + R1 + U2).token_ids == [7, 8]
    assert a.export_training_trace(sid, p1 + R1).input_ids == [7, 8]
    assert len(node_cache(b.context)) > 0 and node_cache(b.context).nbytes <= 4096


def test_concurrent_writers_and_readers_never_see_a_wrong_prefix(
    store_factory: Callable[..., TraceStore],
) -> None:
    """Threads write their own branches of one session through three clients (two
    threads share one client and its cache); a reader checks every match it sees."""
    shared = store_factory()
    clients = [shared, shared, store_factory(), store_factory(cache_bytes=8192)]
    reader_client = store_factory()
    sid = "threads"
    base = SYS + U1
    _turn(shared, sid, base, R1, [1], [2])
    rounds = 8
    expected: dict[str, list[int]] = {base + R1: [1, 2]}
    keys: dict[int, list[str]] = {}
    for j in range(len(clients)):  # every branch's keys and their ids, known in advance
        text, ids = base + R1, [1, 2]
        keys[j] = []
        for k in range(rounds):
            prompt = text + f"<|user|>branch {j} step {k}<|end|>"
            ids = ids + [1000 * j + 10 * k]
            expected[prompt] = list(ids)
            text = prompt + f"ok {j}.{k}"
            ids = ids + [1000 * j + 10 * k + 1]
            expected[text] = list(ids)
            keys[j].append(text)
    errors: list[str] = []
    done = threading.Event()

    def writer(j: int) -> None:
        st = clients[j]
        text = base + R1
        try:
            for k in range(rounds):
                prompt = text + f"<|user|>branch {j} step {k}<|end|>"
                m = st.lookup(sid, prompt)
                if m.text_len != len(text) or m.token_ids != expected[text]:
                    errors.append(f"writer {j}: lookup matched {m.text_len}")
                if k % 2:  # the low-level insert path (conditional on the index version)
                    st.insert(sid, prompt, Segment([1000 * j + 10 * k]))
                    st.insert(sid, prompt + f"ok {j}.{k}", Segment([1000 * j + 10 * k + 1]))
                else:
                    st.record_turn(
                        sid,
                        prompt,
                        f"ok {j}.{k}",
                        prefix=m,
                        delta_token_ids=[1000 * j + 10 * k],
                        response_token_ids=[1000 * j + 10 * k + 1],
                        response_logprobs=[0.0],
                        version=0,
                    )
                text = prompt + f"ok {j}.{k}"
                got = st.lookup(sid, text + "?")
                if got.text_len != len(text) or got.token_ids != expected[text]:
                    errors.append(f"writer {j}: own write not visible at step {k}")
        except Exception as exc:  # reported below; a thread must not die silently
            errors.append(f"writer {j}: {exc!r}")

    def reader() -> None:
        last: dict[str, int] = {}
        while not done.is_set():
            for j in keys:
                q = keys[j][-1] + "?"
                m = reader_client.lookup(sid, q)
                matched = q[: m.text_len]
                if m.text_len and expected.get(matched) != m.token_ids:
                    errors.append(f"reader: wrong ids for a match of {m.text_len} chars")
                if m.text_len < last.get(q, 0):
                    errors.append("reader: a match went backwards")
                last[q] = m.text_len

    threads = [threading.Thread(target=writer, args=(j,)) for j in range(len(clients))]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    r.join()
    assert errors == []
    for st in (*clients, reader_client):
        for j in keys:
            for key in keys[j]:
                tr = st.export_training_trace(sid, key)
                assert tr.input_ids == expected[key]


def test_turn_cost_does_not_grow_with_the_context(standalone_url: str, run_id: str) -> None:
    """DESIGN s4 cost invariant: bytes on the wire per turn are O(new tokens)."""

    def net(st: TraceStore) -> int:
        s = st.redis.info("stats")
        return int(s["total_net_input_bytes"]) + int(s["total_net_output_bytes"])

    def steady_bytes(first_tokens: int) -> int:
        # a long read timeout: a request sent again after a timeout would count its bytes twice
        st = TraceStore.connect(standalone_url, run=run_id, socket_timeout_s=30)
        try:
            sid = f"ctx{first_tokens}"
            text = "<|system|>" + "w" * (4 * first_tokens)
            _turn(st, sid, text, "r0", list(range(first_tokens)), [1])
            text += "r0"
            before = net(st)
            for k in range(6):
                prompt = text + f"<|user|>question {k}<|end|>"
                _turn(st, sid, prompt, f"answer {k}", [7] * 20, [8] * 20)
                text = prompt + f"answer {k}"
            after = net(st)
            assert st.export_training_trace(sid, text).input_ids[-1] == 8
            return after - before
        finally:
            st.close()

    small, large = steady_bytes(250), steady_bytes(50_000)
    assert large <= 1.2 * small, (small, large)


def test_warm_lookup_is_one_round_trip(store: TraceStore) -> None:
    sid = "rtt"
    final = _three_turns(store, sid)
    nxt = final + "<|user|>more<|end|><|assistant|>"
    store.lookup(sid, nxt)  # warm
    calls: list[Any] = []
    orig = store.execute

    def counting(req: Any) -> Any:
        calls.append(req)
        return orig(req)

    store.execute = counting  # type: ignore[method-assign]
    try:
        m = store.lookup(sid, nxt)
        assert m.text_len == len(final)
        assert len(calls) == 1
        calls.clear()
        _turn(store, sid, nxt, "ok", [20], [21])
        assert len(calls) == 2  # lookup + record_turn, one round trip each
        calls.clear()
        store.export_training_trace(sid, nxt + "ok")
        assert len(calls) == 1
    finally:
        del store.execute


# -- sync and async clients agree -------------------------------------------------------------


def test_async_and_sync_give_identical_results(
    store: TraceStore, url: str, run_id: str, arun: Any
) -> None:
    script: list[tuple[str, str, str, list[int], list[int], int]] = []
    p = SYS + U1
    script.append((p, R1, "", [1, 2], [3], 1))
    p2 = p + R1 + U2
    script.append((p2, R2, "", [4], [5, 6], 2))
    script.append((p2, R2B, "", [], [7], 3))
    p3 = p2 + R2B + U3
    script.append((p3, R3, "", [8], [9], 4))

    def sync_run(sid: str) -> list[Any]:
        out: list[Any] = []
        for prompt, resp, _, d, r, v in script:
            m = store.lookup(sid, prompt)
            out.append(m)
            out.append(
                store.record_turn(
                    sid,
                    prompt,
                    resp,
                    prefix=m,
                    delta_token_ids=d,
                    response_token_ids=r,
                    response_logprobs=[-1.0] * len(r),
                    version=v,
                )
            )
            out.append(store.search(sid, prompt + resp + "!"))
            out.append(store.export_training_trace(sid, prompt + resp))
        out.append(store.insert(sid, p3 + "?", Segment([42], labels=[42])))
        try:
            store.export_training_trace(sid, p3 + "#")
        except PromptMismatch as e:
            out.append((e.matched_len, e.nearest_ends, e.window))
        return out

    async def async_run(sid: str) -> list[Any]:
        ast = await connect_async(url, run_id)
        out: list[Any] = []
        try:
            for prompt, resp, _, d, r, v in script:
                m = await ast.lookup(sid, prompt)
                out.append(m)
                out.append(
                    await ast.record_turn(
                        sid,
                        prompt,
                        resp,
                        prefix=m,
                        delta_token_ids=d,
                        response_token_ids=r,
                        response_logprobs=[-1.0] * len(r),
                        version=v,
                    )
                )
                out.append(await ast.search(sid, prompt + resp + "!"))
                out.append(await ast.export_training_trace(sid, prompt + resp))
            out.append(await ast.insert(sid, p3 + "?", Segment([42], labels=[42])))
            try:
                await ast.export_training_trace(sid, p3 + "#")
            except PromptMismatch as e:
                out.append((e.matched_len, e.nearest_ends, e.window))
            # the async client reads what the sync one wrote, and vice versa
            out.append(await ast.export_training_trace("sync-side", p3 + R3))
            await ast.drop_session_data("gone")
            with pytest.raises(SessionReleased):
                await ast.lookup("gone", "x")
        finally:
            await ast.close()
        return out

    s = sync_run("sync-side")
    a = arun(async_run("async-side"))
    assert a[:-1] == s
    assert a[-1] == store.export_training_trace("async-side", p3 + R3)
    assert len(s) == 4 * 4 + 2


# -- demo section ------------------------------------------------------------------------------


def test_traces_demo_section(standalone_url: str) -> None:
    from tracestore.demo import run_demo

    rows = dict(run_demo(standalone_url, only="traces", echo=lambda s: None)["s20_traces"])
    assert rows["export retried branch"].startswith("232 tokens (46 trained), 8 nodes")
    assert rows["export first attempt"].startswith("175 tokens")
    assert "PromptMismatch" in rows["export of a prompt never stored"]
    assert "NodeConflict" in rows["rewrite a node with other logprobs"]


# -- the benchmark's baseline agrees with tracestore ----------------------------------------


def test_actor_baseline_trie_agrees_with_tracestore(store: TraceStore) -> None:
    """benchmarks/baselines/actor_store.py (plain class) exports what tracestore exports."""
    from benchmarks.baselines.actor_store import SessionServerClient, TextTrieStore

    trie = TextTrieStore()
    client = SessionServerClient(trie)
    p1 = SYS + U1
    p2 = p1 + R1 + U2
    p3 = p2 + R2B + U3
    plan = [(p1, R1, [1, 2], [3]), (p2, R2, [4], [5]), (p2, R2B, [], [6, 7]), (p3, R3, [8], [9])]
    for i, (prompt, resp, delta, out) in enumerate(plan):
        pos, ids = client.before_request("s", prompt)
        m = store.lookup("s", prompt)
        assert (pos, ids) == (m.text_len, m.token_ids)
        client.after_response("s", prompt, resp, delta, out, [-0.5] * len(out), i)
        _turn(store, "s", prompt, resp, delta, out, version=i)
    for key in (p1 + R1, p2 + R2, p2 + R2B, p3 + R3):
        want = client.export("s", key)
        got = store.export_training_trace("s", key)
        assert want == {
            "input_ids": got.input_ids,
            "labels": got.labels,
            "logprobs": got.logprobs,
            "versions": got.versions,
            "expert_keys": None,
        }
    assert client.release(["s", "other"]) == 1 and trie.session_count() == 0


def test_export_many_equals_exports_in_one_round_trip(store_factory: Callable[..., TraceStore]) -> None:
    from tests.test_scripts import _Counting

    writer, reader = store_factory(), store_factory()
    keys = {f"em{i}": _three_turns(writer, f"em{i}") for i in range(5)}
    items = list(keys.items())
    want = [writer.export_training_trace(s, k) for s, k in items]
    count = _Counting(reader)
    assert reader.export_many(items) == want  # cold: index checks, then the missing payloads
    assert len(count.requests) == 2
    count.requests.clear()
    assert reader.export_many(items) == want  # warm: one round trip for all
    assert len(count.requests) == 1
    with pytest.raises(PromptMismatch):
        reader.export_many([items[0], ("em1", "no such key"), items[2]])
    with pytest.raises(InvalidId):
        reader.export_many([items[0], ("bad id", "x")])
    assert reader.export_many([]) == []


def test_export_node_is_the_trace_of_the_node_by_its_id(store_factory: Callable[..., TraceStore]) -> None:
    writer, reader = store_factory(), store_factory()
    final = _three_turns(writer, "en")
    mid = SYS + U1 + R1
    turn = _turn(writer, "en", final + U2, R2B, [9], [16])  # record_turn's Turn names its nodes
    for key in (final, mid, final + U2 + R2B):
        want = writer.export_training_trace("en", key)
        assert reader.export_node("en", node_id(key)) == want  # a cold reader, by the id alone
    assert turn.response.id == node_id(final + U2 + R2B)
    assert reader.export_node("en", turn.response.id).input_ids[-2:] == [9, 16]
    with pytest.raises(InvalidInput, match="has no node"):
        reader.export_node("en", node_id("not a stored key"))
    for bad in ("xyz", node_id(final).upper(), node_id(final) + "0", 7):
        with pytest.raises(InvalidInput, match="expected a node id"):
            reader.export_node("en", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidId):
        reader.export_node("bad id", node_id(final))
    writer.drop_session_data("en")
    with pytest.raises(SessionReleased):
        reader.export_node("en", node_id(final))
