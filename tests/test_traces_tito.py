"""What token-exact traces add to the data plane, on every backend: fork reasons on nodes,
``PrefixMatch.extended``, per-token weight versions, kept tokens of a stopped turn, and the
canonical conversation key."""

from __future__ import annotations

from typing import Any

import pytest

from tests._gateway import dump_run
from tracestore import TraceStore
from tracestore.conversation import conversation_key, key_parts, message_key
from tracestore.errors import CorruptData, InvalidInput, SessionReleased


def _turn(store: TraceStore, sid: str, prompt: str, answer: str, ids: list[int], **kw: object) -> object:
    m = store.lookup(sid, prompt)
    delta = [] if m.text_len == len(prompt) else [7] * (len(prompt) - m.text_len)
    return store.record_turn(
        sid, prompt, answer, prefix=m, delta_token_ids=delta, response_token_ids=ids,
        response_logprobs=[-0.5] * len(ids), version=kw.pop("version", 3), **kw,  # type: ignore[arg-type]
    )


def test_per_token_versions_are_exported_and_the_node_keeps_the_oldest(store: TraceStore) -> None:
    store.open_session("s", "w")
    _turn(store, "s", "ab", "cd", [1, 2, 3, 4], version=4, response_versions=[3, 3, 4, 4])
    tr = store.export_training_trace("s", "abcd")
    assert tr.versions == [4, 4, 3, 3, 4, 4]  # the delta at the turn's version, the answer per token
    assert tr.labels[2:] == [1, 2, 3, 4] and tr.min_version == 3
    assert tr.nodes[-1].version == 3  # the oldest: a group's staleness comes from it
    assert tr.stale_mask(6, 2) == [False, False, True, True, False, False]
    # one version only: no per-token payload (8 bytes a token, as before)
    _turn(store, "s", "abcd" + "ef", "gh", [5, 6], version=4, response_versions=[4, 4])
    tr2 = store.export_training_trace("s", "abcdefgh")
    assert tr2.versions[-2:] == [4, 4] and tr2.nodes[-1].flags == 1


def test_bad_per_token_versions_write_nothing(store: TraceStore) -> None:
    store.open_session("s", "w")
    before = dump_run(store)
    for versions, field in (([3, 4, 5], "response_versions"), ([3, 9], "response_versions"), ([3, -1], "response_versions")):
        with pytest.raises(InvalidInput) as ei:
            _turn(store, "s", "ab", "cd", [1, 2], version=4, response_versions=versions)
        assert ei.value.field == field
    assert dump_run(store) == before


def test_a_fork_reason_is_recorded_on_the_first_new_node_and_extended_says_a_match_has_children(store: TraceStore) -> None:
    store.open_session("s", "w")
    assert store.lookup("s", "ab").extended is False  # nothing stored yet
    _turn(store, "s", "ab", "cd", [1])
    m = store.lookup("s", "abcd" + "x")
    assert m.node is not None and m.extended is False  # the answer has no child yet
    assert store.lookup("s", "zz").extended is True  # the root has one
    assert store.lookup("s", "ab").extended is True  # the prompt has its answer
    t = _turn(store, "s", "abcdxy", "zw", [2], fork="client_edit")
    assert t.delta is not None and t.delta.fork == "client_edit" and t.response.fork is None  # type: ignore[attr-defined]
    tr = store.export_training_trace("s", "abcdxyzw")
    assert [n.fork for n in tr.nodes] == [None, None, "client_edit", None]
    # no delta: the response node carries it
    t2 = _turn(store, "s", "abcdxy", "other", [3], fork="template")
    assert t2.delta is None and t2.response.fork == "template"  # type: ignore[attr-defined]
    with pytest.raises(InvalidInput):
        _turn(store, "s", "abcdxy", "third", [4], fork="because")


def test_kept_tokens_round_trip_expire_with_the_session_and_drop(store: TraceStore) -> None:
    store.open_session("s", "w")
    assert store.read_partial("s", "the prompt") is None
    store.keep_partial("s", "the prompt", [5, 6, 7], [-0.1, -0.2, -0.3], [3, 3, 3], 40, kept_ms=1234, ttl_s=60)
    p = store.read_partial("s", "the prompt")
    assert p is not None and p.ids == (5, 6, 7) and p.versions == (3, 3, 3) and p.input_len == 40 and p.kept_ms == 1234
    assert p.logprobs == pytest.approx((-0.1, -0.2, -0.3))
    assert 0 < store.redis.pttl(store.keys.part("s")) <= 60_000  # type: ignore[union-attr]
    assert store.read_partial("s", "another prompt") is None
    store.drop_partial("s", "the prompt")
    store.drop_partial("s", "the prompt")  # idempotent
    assert store.read_partial("s", "the prompt") is None
    with pytest.raises(InvalidInput):
        store.keep_partial("s", "p", [1, 2], [0.0], [1, 1], 3)
    # purged with the session's data; keeping then is refused
    store.keep_partial("s", "p", [1], [0.0], [1], 3)
    store.release(["s"], "w", "done")
    assert store.redis.exists(store.keys.part("s")) == 0  # type: ignore[union-attr]
    with pytest.raises(SessionReleased):
        store.keep_partial("s", "p", [1], [0.0], [1], 3)


def test_kept_tokens_carry_the_routed_experts_they_were_generated_with(store: TraceStore) -> None:
    """``keep_partial(experts=)``: the rows come back byte for byte (read and lookup alike); a
    value kept without them still reads; rows that do not fit their shape are refused before I/O."""
    from array import array

    from tracestore import traces
    from tracestore.traces import KeptExperts

    store.open_session("s", "w")
    rows = array("i", range(5 * 2 * 3)).tobytes()  # 5 rows of 2 layers x top-3
    kept = KeptExperts(start=7, rows=5, row_shape=(2, 3), data=rows)
    store.keep_partial("s", "the prompt", [5, 6, 7], [-0.1, -0.2, -0.3], [3, 3, 3], 9, ttl_s=60, experts=kept)
    p = store.read_partial("s", "the prompt")
    assert p is not None and p.ids == (5, 6, 7) and p.experts == kept
    assert store.run(traces.lookup_partial(store.context, "s", "the prompt"))[1] == p
    store.keep_partial("s", "the prompt", [5], [-0.1], [3], 9, ttl_s=60)  # replaced, without experts
    p = store.read_partial("s", "the prompt")
    assert p is not None and p.ids == (5,) and p.experts is None
    for bad in (KeptExperts(7, 5, (2, 3), rows[:-4]), KeptExperts(-1, 5, (2, 3), rows), KeptExperts(7, 5, (), rows)):
        with pytest.raises(InvalidInput):
            store.keep_partial("s", "the prompt", [5], [-0.1], [3], 9, experts=bad)
    assert store.read_partial("s", "the prompt") == p  # nothing written


def test_lookup_partial_reads_the_kept_tokens_in_the_lookups_round_trip(store: TraceStore) -> None:
    """``traces.lookup_partial``: the same match as ``lookup`` and the same kept tokens as
    ``read_partial``, cold and warm, in one script call each (the kept tokens ride in read_index)."""
    from tracestore import traces

    ctx = store.context
    store.open_session("s", "w")
    _turn(store, "s", "ab", "c", [1, 2])
    store.keep_partial("s", "abcd", [5, 6], [-0.1, -0.2], [3, 4], 9, kept_ms=7, ttl_s=60)
    sent: list[Any] = []

    def spied(op: Any) -> Any:  # the requests the operation yields, each one round trip
        try:
            req = next(op)
            while True:
                sent.append(req)
                req = op.send((yield req))
        except StopIteration as stop:
            return stop.value

    match, partial = store.run(spied(traces.lookup_partial(ctx, "s", "abcd")))
    assert [(r.script.name, len(r.keys)) for r in sent] == [("read_index", 4)]  # warm: one call carries both
    plain = store.lookup("s", "abcd")
    assert (match.text_len, list(match.token_ids)) == (plain.text_len, list(plain.token_ids)) == (3, [7, 7, 1, 2])
    assert partial == store.read_partial("s", "abcd")
    assert partial is not None and partial.ids == (5, 6) and partial.versions == (3, 4) and partial.input_len == 9
    assert store.run(traces.lookup_partial(ctx, "s", "ab"))[1] is None
    assert store.run(traces.lookup_partial(ctx, "unknown", "ab")) == (store.lookup("unknown", "ab"), None)


def test_a_damaged_kept_value_is_corrupt_data(store: TraceStore) -> None:
    from tracestore.traces.index import node_id

    store.open_session("s", "w")
    store.redis.hset(store.keys.part("s"), node_id("k"), b"p1,3,0,2\nshort")  # type: ignore[union-attr]
    with pytest.raises(CorruptData):
        store.read_partial("s", "k")
    from tracestore import traces

    with pytest.raises(CorruptData):
        store.run(traces.lookup_partial(store.context, "s", "k"))


def test_the_conversation_key_is_canonical() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"n": 3}'}}
    a = [*base, {"role": "assistant", "content": " ok ", "tool_calls": [call], "reasoning_content": "hmm"}]
    b = [*base, {"role": "assistant", "content": "ok", "tool_calls": [{**call, "id": "x9", "function": {"name": "add", "arguments": {"n": 3}}}]}]
    assert conversation_key(a, tools) == conversation_key(b, tools)  # reasoning, ids, blank space, arg form
    assert conversation_key(a, tools) != conversation_key(a, None)  # tools are in the header
    assert conversation_key(a, tools, {"enable_thinking": False}) != conversation_key(a, tools)
    dev = [{"role": "developer", "content": "s"}, base[1]]
    assert conversation_key(dev) == conversation_key(base)
    assert message_key({"role": "user", "content": [{"type": "text", "text": "u"}]}) == message_key(base[1])
    parts = key_parts(a, tools)
    assert "".join(parts) == conversation_key(a, tools) and len(parts) == 4
    # each key is a prefix of the next turn's: a turn extends its path exactly when its messages do
    nxt = [*a, {"role": "tool", "content": "= 4", "tool_call_id": "call_1"}]
    assert conversation_key(nxt, tools).startswith(conversation_key(a, tools))
    with pytest.raises(InvalidInput):
        message_key({"role": "robot", "content": "x"})
