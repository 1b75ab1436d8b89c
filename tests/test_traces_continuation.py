"""Flat turns: TokenIds (tracestore/traces/tokens.py) and the per-session continuation
(tracestore/traces/continuation.py) that lookup and record_turn keep.

The continuation lets a lookup check the part of a prompt it already knows by
comparison and hash only the new text; these tests pin down when it may be
used and, above all, when it must not: another client wrote the session, the
session was purged (and reopened with other tokens under the same keys), a
node appeared between the checkpoint and the prompt's end, the prompt leaves
the continuation's text inside the last turn.
"""

from __future__ import annotations

import pickle
import threading
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tracestore import (
    InvalidInput,
    PrefixChanged,
    PrefixMatch,
    PromptMismatch,
    Segment,
    SessionReleased,
    TraceStore,
    TurnRecorder,
)
from tracestore.nodecache import node_cache
from tracestore.traces import TokenIds
from tracestore.traces.continuation import Continuation, _starts_with, cont_key
from tracestore.traces.index import SessionIndex

SYS = "<|system|>" + "You are a calculator. " * 20 + "<|end|>"
U1 = "<|user|>What is 2+2?<|end|><|assistant|>"
R1 = "4<|end|>"
U2 = "<|user|>And 3*3?<|end|><|assistant|>"
R2 = "9<|end|>"
U3 = "<|user|>Thanks ✓ 😀<|end|><|assistant|>"
R3 = "You're welcome<|end|>"
U4 = "<|user|>Bye<|end|><|assistant|>"


def _turn(
    st: TraceStore, sid: str, prompt: str, response: str, delta: list[int], out: list[int]
) -> PrefixMatch:
    """lookup then record_turn; returns the lookup's match."""
    m = st.lookup(sid, prompt)
    st.record_turn(
        sid,
        prompt,
        response,
        prefix=m,
        delta_token_ids=delta if m.text_len < len(prompt) else [],
        response_token_ids=out,
        response_logprobs=[-0.5] * len(out),
        version=0,
    )
    return m


class _MatchSpy:
    """Records how each SessionIndex.match call started: (start node end or None, bytes given)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int | None, int]] = []
        real = SessionIndex.match

        def spy(ix: SessionIndex, text: str, field_name: str, **kw: Any) -> Any:
            start = kw.get("start")
            self.calls.append((start[0].end if start else None, len(kw.get("encoded", b""))))
            return real(ix, text, field_name, **kw)

        monkeypatch.setattr(SessionIndex, "match", spy)

    def last(self) -> tuple[int | None, int]:
        return self.calls[-1]


# -- TokenIds (pure) -----------------------------------------------------------------------------


def test_token_ids_read_like_a_list() -> None:
    t = TokenIds([5, 6, 7, 8])
    assert len(t) == 4 and t[0] == 5 and t[-1] == 8 and list(t) == [5, 6, 7, 8]
    with pytest.raises(IndexError):
        t[4]
    with pytest.raises(IndexError):
        t[-5]
    assert t == [5, 6, 7, 8] and [5, 6, 7, 8] == t and t == (5, 6, 7, 8)
    assert t == array("i", [5, 6, 7, 8]) and t == TokenIds([5, 6, 7, 8])
    assert t != [5, 6, 7] and t != [5, 6, 7, 9] and t != TokenIds([5, 6, 7])
    assert t[:2] == [5, 6] and t[1:3] == [6, 7] and t[::2] == [5, 7] and t[::-1] == [8, 7, 6, 5]
    assert t.index(7) == 2 and 8 in t and t.count(5) == 1
    assert t.tolist() == [5, 6, 7, 8] and isinstance(t.tolist(), list)
    assert pickle.loads(pickle.dumps(t)) == t
    assert (
        np.asarray(t).tolist() == [5, 6, 7, 8] and np.asarray(t, dtype=np.int64).dtype == np.int64
    )
    assert hash(t) == hash(TokenIds([5, 6, 7, 8]))
    assert [1] + t == [1, 5, 6, 7, 8] and isinstance([1] + t, list)
    assert t + [9] == [5, 6, 7, 8, 9] and isinstance(t + [9], TokenIds)
    assert repr(TokenIds([1, 2])) == "TokenIds([1, 2])"
    with pytest.raises(OverflowError):
        TokenIds([2**40])


def test_token_ids_views_never_change_when_a_shared_buffer_grows() -> None:
    base = TokenIds([1, 2])
    a = base + [3]  # appended in place: a shares base's buffer
    b = base + [4]  # a branch: base's tail is taken by a, so b copies base
    c = base + [3, 5]  # same first id as a's tail: shares it, then appends 5
    d = a + [6]  # a's tail now holds 5 (c's): a branch again
    e = base[:1] + [2, 3, 5, 7]  # a prefix view extended over ids already there, then 7
    assert (base, a, b, c, d, e) == (
        [1, 2],
        [1, 2, 3],
        [1, 2, 4],
        [1, 2, 3, 5],
        [1, 2, 3, 6],
        [1, 2, 3, 5, 7],
    )
    assert base + [] is base
    # a slice of a view reads only the view's items, though its buffer holds more now
    assert base[1:] == [2] and base[1:99] == [2] and base[-1:] == [2] and base[::-1] == [2, 1]
    assert a[1:] == [2, 3] and a[::2] == [1, 3] and len(base._buf) > len(base)
    # a buffer someone exports (a memoryview) cannot grow: the extension copies instead
    held = TokenIds([1])
    view = memoryview(held._buf)
    grown = held + [2]
    assert grown == [1, 2] and held == [1]
    view.release()


def test_token_ids_extended_from_many_threads_at_once() -> None:
    base = TokenIds(range(1000))
    results: dict[int, TokenIds] = {}

    def work(j: int) -> None:
        ids = base
        for k in range(200):
            ids = ids + [j * 10_000 + k]
        results[j] = ids

    threads = [threading.Thread(target=work, args=(j,)) for j in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert base == list(range(1000))
    for j, ids in results.items():
        assert ids == list(range(1000)) + [j * 10_000 + k for k in range(200)]


def test_continuation_text_compare_across_pieces() -> None:
    pieces = ("abc", "def")
    assert _starts_with("abcdefg", pieces, 6) and _starts_with("abcdex", pieces, 5)
    assert _starts_with("abX", pieces, 2) and not _starts_with("abX", pieces, 3)
    assert not _starts_with("abcdXf", pieces, 6) and not _starts_with("abc", pieces, 4)
    assert _starts_with("", pieces, 0)


# -- the continuation on real servers ---------------------------------------------------------------


def _four_turns(st: TraceStore, sid: str, offset: int = 0) -> list[str]:
    """Record four turns (ids from :func:`_ids`); the keys of the responses."""
    keys = []
    prompt = SYS + U1
    for k, (resp, nxt) in enumerate(((R1, U2), (R2, U3), (R3, U4), ("ok<|end|>", ""))):
        ids = _ids(k + 1, offset)[-3:]
        _turn(st, sid, prompt, resp, ids[:2], ids[2:])
        keys.append(prompt + resp)
        prompt = prompt + resp + nxt
    return keys


def _ids(k: int, offset: int = 0) -> list[int]:
    """Token ids of the first ``k`` turns of :func:`_four_turns`."""
    return [offset + x for j in range(k) for x in (10 * j + 1, 10 * j + 2, 10 * j + 3)]


def test_steady_turns_hash_only_the_new_text(
    store: TraceStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = "flat"
    spy = _MatchSpy(monkeypatch)
    prompt = SYS + U1
    _turn(store, sid, prompt, R1, [1, 2], [3])
    assert spy.last()[0] is None  # nothing to continue: the whole prompt was hashed
    prev_end = len(prompt + R1)
    for k, (u, r) in enumerate(((U2, R2), (U3, R3), (U4, "ok<|end|>"))):
        prompt = prompt + (R1, R2, R3)[k] + u
        m = _turn(store, sid, prompt, r, [10 + k], [20 + k])
        start, hashed = spy.last()
        assert start == prev_end  # started at the last response's end...
        assert hashed == len(u.encode())  # ...and hashed only the new user text
        assert m.text_len == prev_end
        prev_end = len(prompt + r)
    tr = store.export_training_trace(sid, prompt + "ok<|end|>")
    assert (
        store.lookup(sid, prompt + "ok<|end|>?").token_ids
        == tr.input_ids
        == [1, 2, 3, 10, 20, 11, 21, 12, 22]
    )


def test_key_digest_resumes_from_the_continuation_and_equals_the_hash_of_the_whole_text(
    store_factory: Callable[..., TraceStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``traces.key_digest``: blake2b-128 of the text (its first 16 hex are ``node_id``), whatever
    the session's cached continuation is (current, behind another writer's turn, of a purged
    epoch, unrelated to the text), and only the bytes after its deepest checkpoint are hashed."""
    import hashlib

    from tracestore.traces import key_digest, node_id, reads

    a, b = store_factory(), store_factory()
    sid = "digest"
    encoded: list[int] = []
    real = reads.utf8
    monkeypatch.setattr(reads, "utf8", lambda field, text: (encoded.append(len(text)), real(field, text))[1])

    def check(st: TraceStore, text: str) -> int:
        encoded.clear()
        got = key_digest(st.context, sid, text)
        assert got == hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        assert got[:16] == node_id(text)
        return encoded[-1]

    p1 = SYS + U1
    assert check(a, p1) == len(p1)  # no continuation: the whole text
    _turn(a, sid, p1, R1, [1, 2], [3])
    p2 = p1 + R1 + U2
    assert check(a, p2) == len(U2)  # warm: only the new message
    assert check(a, p1 + "✓ other") == len("✓ other")  # leaves the last turn: a shallower checkpoint
    assert check(a, "unrelated ✓") == len("unrelated ✓")  # no checkpoint prefixes it: all of it
    _turn(b, sid, p2, R2, [4], [5])  # another writer went further: a's checkpoints still hash right
    assert check(a, p2 + R2 + U3) == len(U2 + R2 + U3)  # from the end of a's own turn
    with pytest.raises(InvalidInput):
        key_digest(a.context, sid, "bad \ud800 surrogate")


def test_other_client_wrote_the_session_further(store_factory: Callable[..., TraceStore]) -> None:
    a, b = store_factory(), store_factory()
    sid = "two-writers"
    p1 = SYS + U1
    _turn(a, sid, p1, R1, [1, 2], [3])
    p2 = p1 + R1 + U2
    _turn(b, sid, p2, R2, [4], [5])  # a's continuation ends at R1; b wrote past it
    p3 = p2 + R2 + U3
    m = a.lookup(sid, p3)
    assert (m.text_len, m.token_ids) == (len(p2 + R2), [1, 2, 3, 4, 5])
    a.record_turn(
        sid,
        p3,
        R3,
        prefix=m,
        delta_token_ids=[6],
        response_token_ids=[7],
        response_logprobs=[0.0],
        version=0,
    )
    p4 = p3 + R3 + U4
    assert a.lookup(sid, p4).token_ids == b.lookup(sid, p4).token_ids == [1, 2, 3, 4, 5, 6, 7]
    # b's continuation (at R2) is now behind a's write: b still sees everything
    assert b.lookup(sid, p4).text_len == len(p3 + R3)


def test_purged_and_reopened_with_other_tokens(store_factory: Callable[..., TraceStore]) -> None:
    a, b = store_factory(), store_factory()
    sid = "reopened"
    keys = _four_turns(a, sid)
    assert a.lookup(sid, keys[3] + "?").token_ids == _ids(4)
    b.drop_session_data(sid)
    b.redis.delete(b.keys.dead(sid))  # reopened: a new incarnation under the same keys
    _four_turns(b, sid, offset=500)  # same keys and node shapes, other token ids
    # a's continuation lies on the very same text and nodes, but its ids belong to the old epoch
    m = a.lookup(sid, keys[3] + "?")
    assert (m.text_len, m.token_ids) == (len(keys[3]), _ids(4, offset=500))
    # again, with b's new incarnation shorter than a's continuation
    b.drop_session_data(sid)
    b.redis.delete(b.keys.dead(sid))
    p1 = SYS + U1
    _turn(b, sid, p1, R1, [91, 92], [93])
    _turn(b, sid, p1 + R1 + U2, R2, [94], [95])
    m = a.lookup(sid, keys[3] + "?")  # a's deeper keys do not exist any more
    assert (m.text_len, m.token_ids) == (len(keys[1]), [91, 92, 93, 94, 95])
    m = a.lookup(sid, keys[1] + U3)
    a.record_turn(
        sid,
        keys[1] + U3,
        R3,
        prefix=m,
        delta_token_ids=[96],
        response_token_ids=[97],
        response_logprobs=[0.0],
        version=0,
    )
    want = [91, 92, 93, 94, 95, 96, 97]
    assert a.lookup(sid, keys[2] + U4).token_ids == want
    assert b.export_training_trace(sid, keys[2]).input_ids == want


def test_match_read_before_a_reopen_does_not_seed_the_continuation(
    store_factory: Callable[..., TraceStore],
) -> None:
    """A turn on a match read before a purge and reopen extends the old prefix's tokens: the
    prefix node stored again (other ids, another write id) refuses it, nothing is written, and
    after a lookup again the turn extends the stored tokens."""
    a, b = store_factory(), store_factory()
    sid = "reopened-between"
    p1 = SYS + U1
    _turn(a, sid, p1, R1, [1, 2], [3])
    p2 = p1 + R1 + U2
    m = a.lookup(sid, p2)  # read in the first epoch: ids [1, 2, 3]
    b.drop_session_data(sid)
    b.redis.delete(b.keys.dead(sid))
    _turn(b, sid, p1, R1, [91, 92], [93])  # the prefix node again, other ids
    call = {"delta_token_ids": [4], "response_token_ids": [5], "response_logprobs": [0.0], "version": 0}
    with pytest.raises(PrefixChanged, match="stored again") as ei:
        a.record_turn(sid, p2, R2, prefix=m, **call)  # type: ignore[arg-type]
    assert ei.value.field == "prefix"
    with pytest.raises(PromptMismatch):
        b.export_training_trace(sid, p2 + R2)  # nothing written
    m = a.lookup(sid, p2)
    assert m.token_ids == [91, 92, 93]
    a.record_turn(sid, p2, R2, prefix=m, **call)  # type: ignore[arg-type]
    want = [91, 92, 93, 4, 5]
    assert b.export_training_trace(sid, p2 + R2).input_ids == want
    assert a.lookup(sid, p2 + R2 + U3).token_ids == want


def test_purged_session_drops_the_continuation(store_factory: Callable[..., TraceStore]) -> None:
    a, b = store_factory(), store_factory()
    sid = "purged"
    keys = _four_turns(a, sid)
    assert isinstance(node_cache(a.context).get(cont_key(sid)), Continuation)
    b.drop_session_data(sid)
    with pytest.raises(SessionReleased):
        a.lookup(sid, keys[-1] + "?")
    assert node_cache(a.context).get(cont_key(sid)) is None
    with pytest.raises(SessionReleased):
        a.lookup(sid, keys[-1] + "?")


def test_a_node_between_the_checkpoint_and_the_prompt_end_is_found(
    store_factory: Callable[..., TraceStore],
) -> None:
    a, b = store_factory(), store_factory()
    sid = "between"
    keys = _four_turns(a, sid)
    prompt = keys[-1] + "<|user|>more<|end|><|assistant|>"
    mid = keys[-1] + "<|user|>more"
    b.insert(sid, mid, Segment([50, 51]))  # a's continuation ends at keys[-1], before mid
    m = a.lookup(sid, prompt)
    assert (m.text_len, m.token_ids) == (len(mid), _ids(4) + [50, 51])
    # and a node on the continuation's text but off its path does not shadow the checkpoint
    b.insert(sid, keys[-1][:-3], Segment([60]))
    m = a.lookup(sid, keys[-1] + "!")
    assert (m.text_len, m.token_ids) == (len(keys[-1]), _ids(4))


def test_prompt_leaving_the_last_turn_uses_a_shallower_checkpoint(
    store: TraceStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = "branch"
    p1 = SYS + U1
    _turn(store, sid, p1, R1, [1, 2], [3])
    p2 = p1 + R1 + U2
    _turn(store, sid, p2, R2, [4], [5])
    spy = _MatchSpy(monkeypatch)
    # a retry of turn 2: the prompt is stored (the delta node), the response is not in it
    m = store.lookup(sid, p2)
    assert (m.text_len, m.token_ids, spy.last()[0]) == (len(p2), [1, 2, 3, 4], len(p2))
    store.record_turn(
        sid,
        p2,
        "nine<|end|>",
        prefix=m,
        delta_token_ids=[],
        response_token_ids=[6],
        response_logprobs=[0.0],
        version=1,
    )
    assert store.lookup(sid, p2 + "nine<|end|>" + U3).token_ids == [1, 2, 3, 4, 6]
    # back on the first answer's branch: the continuation (the retry) does not cover it
    m = store.lookup(sid, p2 + R2 + U3)
    assert (m.text_len, m.token_ids) == (len(p2 + R2), [1, 2, 3, 4, 5])
    # a prompt that leaves the text inside turn 2's delta
    m = store.lookup(sid, p1 + R1 + "<|user|>something else")
    assert (m.text_len, m.token_ids) == (len(p1 + R1), [1, 2, 3])


def test_record_turn_does_not_trust_a_forged_match(store: TraceStore) -> None:
    """A PrefixMatch built by hand (or edited) never seeds the continuation with its ids."""
    sid = "forged"
    p1 = SYS + U1
    _turn(store, sid, p1, R1, [1, 2], [3])
    p2 = p1 + R1 + U2
    real = store.lookup(sid, p2)
    forged = PrefixMatch(real.text_len, [666, 667, 668], real.node, real.path)
    store.record_turn(
        sid,
        p2,
        R2,
        prefix=forged,
        delta_token_ids=[4],
        response_token_ids=[5],
        response_logprobs=[0.0],
        version=0,
    )
    assert store.lookup(sid, p2 + R2 + U3).token_ids == [1, 2, 3, 4, 5]
    with pytest.raises(InvalidInput) as ei:  # and a match of another prompt is refused, as before
        store.record_turn(
            sid,
            (SYS + U2) * 2,
            R2,
            prefix=store.lookup(sid, p1 + R1 + "y"),
            delta_token_ids=[4],
            response_token_ids=[5],
            response_logprobs=[0.0],
            version=0,
        )
    assert ei.value.field == "prefix"


def test_recorders_alternate_and_survive_a_reopen(store_factory: Callable[..., TraceStore]) -> None:
    """Two session servers (recorders on their own clients) take turns on one session,
    then the session is purged and reopened; every request's ids are the stored prefix's."""
    from tracestore.trainer.chat import render
    from tracestore.trainer.tokenizer import TOKENIZER as TOK

    stores = [store_factory(), store_factory()]
    recs = [TurnRecorder(s, render, TOK.encode) for s in stores]
    sid = "recorders"

    def conversation(seed: int) -> None:
        messages: list[dict[str, str]] = [{"role": "user", "content": f"{seed}+1?"}]
        for k in range(6):
            rec = recs[k % 2]
            req = rec.prepare(sid, messages)
            ids = rec.before_request(sid, messages)
            assert ids == req.input_ids == req.token_ids
            text = render(messages, True)
            assert ids[: len(req.prefix.token_ids)] == req.prefix.token_ids
            if k:
                stored = stores[0].export_training_trace(sid, render(messages[:-1], False).rstrip())
                assert req.prefix.token_ids == stored.input_ids
            answer = f"{seed + k}"
            out = TOK.encode(answer) + [TOK.stop_id]
            rec.after_response(
                sid,
                messages,
                {"role": "assistant", "content": answer},
                out,
                [-0.1] * len(out),
                None,
                0,
            )
            messages = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"and {k}?"},
            ]
            assert text  # (the prompt rendered for this turn)

    conversation(1)
    stores[1].drop_session_data(sid)
    stores[1].redis.delete(stores[1].keys.dead(sid))
    conversation(5)  # same first message shape, other answers: nothing of the old epoch may leak


def test_base_for_compares_a_text_once_and_answers_each_text_by_its_own_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn asks ``base_for`` of its key twice (the digest, then the lookup): the second answer
    is the first one's, without comparing the history again; any other text or continuation is
    compared afresh (an equal but distinct string too), and each gets its own answer."""
    from tracestore.traces import continuation as c
    from tracestore.traces.continuation import Checkpoint
    from tracestore.traces.types import Node

    calls: list[int] = []
    real = c._starts_with

    def counted(text: str, pieces: tuple[str, ...], end: int) -> bool:
        calls.append(end)
        return real(text, pieces, end)

    monkeypatch.setattr(c, "_starts_with", counted)
    prompt, response = SYS + U1, R1
    a = Checkpoint(Node("a" * 16, None, len(prompt), 3, 0, 1, None), None, TokenIds([1, 2, 3]))
    b = Checkpoint(Node("b" * 16, "a" * 16, len(prompt + response), 1, 0, 1, None), None, TokenIds([1, 2, 3, 4]))
    cont = Continuation("e1", (prompt, response), (a, b))
    later = prompt + response + "<|user|>and 3+3?<|end|>"
    assert cont.base_for(later) is b and len(calls) == 1
    assert cont.base_for(later) is b and len(calls) == 1  # the same text again: no compare
    edited = prompt + "5<|end|>"
    assert cont.base_for(edited) is a and len(calls) == 3  # the deepest fails, then its parent
    twin = "".join([later[:5], later[5:]])  # equal, another object: compared, same answer
    assert twin is not later and cont.base_for(twin) is b and len(calls) == 4
    other = Continuation("e2", (prompt, response), (a, b))
    assert other.base_for(twin) is b and len(calls) == 5  # another continuation: compared
    assert cont.base_for("nothing in common") is None and len(calls) == 7
    assert cont.base_for("nothing in common") is None and len(calls) == 7
