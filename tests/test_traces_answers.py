"""Answers kept for retries (``tracestore/traces/answers.py``, ``lua/session_field_keep.lua``) on every backend."""

from __future__ import annotations

from typing import Any

import pytest

from tracestore import TraceStore
from tracestore.errors import CorruptData, InvalidInput, SessionReleased
from tracestore.traces import KeptAnswer

D = "0123456789abcdef0123456789abcdef"


def test_kept_answers_round_trip_expire_and_go_with_the_session(store: TraceStore) -> None:
    store.open_session("s", "w")
    assert store.read_answer("s", D) is None
    rec = {"rid": "req-1", "resp": "line\n", "n": 3, "content": "hi", "calls": [["call_1", "add", {"n": 2}]]}
    store.keep_answer("s", D, rec, ttl_s=60)
    store.keep_answer("s", D, rec, ttl_s=60)  # idempotent
    assert store.read_answer("s", D) == {"v": 1, **rec}
    assert 0 < store.redis.pttl(store.keys.ans("s")) <= 60_000  # type: ignore[union-attr]
    assert store.read_answer("s", "f" * 32) is None
    for bad in ("short", D.upper(), D + "0"):
        with pytest.raises(InvalidInput):
            store.keep_answer("s", bad, rec)
    store.release(["s"], "w", "done")  # purged with the session's data; keeping then is refused
    assert store.redis.exists(store.keys.ans("s")) == 0  # type: ignore[union-attr]
    with pytest.raises(SessionReleased):
        store.keep_answer("s", D, rec)


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"v": 2}'])
def test_a_damaged_kept_answer_is_corrupt_data(store: TraceStore, raw: bytes) -> None:
    store.open_session("s", "w")
    store.redis.hset(store.keys.ans("s"), D, raw)  # type: ignore[union-attr]
    with pytest.raises(CorruptData):
        store.read_answer("s", D)


def test_record_turn_keeps_the_answer_in_the_same_write(store: TraceStore) -> None:
    """``record_turn(..., answer=KeptAnswer(...))``: the turn and its kept answer in one script; a
    retry of the record writes the same answer again; a bad record refuses the turn before any I/O."""
    store.open_session("s", "w")
    rec = {"rid": "req-1", "resp": " b", "n": 2, "content": "b"}
    m = store.lookup("s", "a")
    kw: dict[str, Any] = {"prefix": m, "delta_token_ids": [1], "response_token_ids": [2, 3],
                          "response_logprobs": [-0.5, -0.25], "version": 0}
    t = store.record_turn("s", "a", " b", answer=KeptAnswer(D, rec, 60.0), **kw)
    assert t.written == 2
    assert store.read_answer("s", D) == {"v": 1, **rec}
    assert 0 < store.redis.pttl(store.keys.ans("s")) <= 60_000  # type: ignore[union-attr]
    assert store.record_turn("s", "a", " b", answer=KeptAnswer(D, rec, 60.0), **kw).written == 0
    assert store.read_answer("s", D) == {"v": 1, **rec}
    for bad in (KeptAnswer("nothex", rec), KeptAnswer(D, {"x": object()})):
        with pytest.raises(InvalidInput):
            store.record_turn("s2", "a", " b", answer=bad, **{**kw, "prefix": store.lookup("s2", "a")})
    assert store.redis.exists(store.keys.idx("s2")) == 0  # type: ignore[union-attr]
    store.record_turn("s", "a c", " d", prefix=store.lookup("s", "a c"), delta_token_ids=[4],
                      response_token_ids=[5], response_logprobs=[-1.0], version=0)
    assert store.redis.hlen(store.keys.ans("s")) == 1  # type: ignore[union-attr]  # without one: none kept
