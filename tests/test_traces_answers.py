"""Answers kept for retries (``tracestore/traces/answers.py``, ``lua/session_field_keep.lua``) on every backend."""

from __future__ import annotations

import pytest

from tracestore import TraceStore
from tracestore.errors import CorruptData, InvalidInput, SessionReleased

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
