"""TurnRecorder: XTuner-style single-phase write over a real server.

The holder here is a tiny dict-backed object with the ``put(sid, value)``
signature of :class:`tracestore.ray.RefHolder`; the Ray holder itself is
tested with Ray in its own test file and in the trainer's end-to-end tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tracestore import InvalidInput, NodeConflict, TraceStore
from tracestore.session import TurnRecorder
from tracestore.trainer.chat import render, strip_stop
from tracestore.trainer.tokenizer import TOKENIZER as tok

L, K = 2, 2


class DictHolder:
    """Keeps values in a dict keyed ``<sid>#<n>`` (the recorder's view of a holder)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.by_sid: dict[str, list[str]] = {}

    def put(self, sid: str, value: Any) -> str:
        key = f"{sid}#{len(self.values)}"
        self.values[key] = np.array(value, copy=True)
        self.by_sid.setdefault(sid, []).append(key)
        return key


class ManyHolder(DictHolder):
    """A DictHolder with ``put_many`` (as RefHolder has): counts its calls, refuses single puts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    def put(self, sid: str, value: Any) -> str:
        raise AssertionError("a holder with put_many gets a round's parts in one call")

    def put_many(self, items: list[tuple[str, Any]]) -> list[str]:
        self.calls.append([sid for sid, _v in items])
        return [DictHolder.put(self, sid, v) for sid, v in items]


def engine(input_ids: list[int], answer: str, seed: int) -> tuple[list[int], list[float], Any]:
    """A fake-free stand-in for the engine's *outputs*: ids of ``answer`` + stop, routing rows.

    Row 0 is the dummy row when the input starts the conversation; row i is
    a deterministic function of (position, seed) so the test can check where
    every row ended up.
    """
    out = tok.encode(answer) + [tok.stop_id]
    n = len(input_ids) + len(out)
    rows = np.zeros((n, L, K), dtype=np.int32)
    for i in range(1, n):
        rows[i] = (i * 7 + seed) % 1000
    lps = [-0.1 * (j + 1) for j in range(len(out))]
    return out, lps, rows


def expected_routing(rows_per_turn: list[tuple[int, Any]]) -> Any:
    """Concatenate each turn's rows after its prefix (the engine's full array minus prefix rows)."""
    return np.concatenate([r[p:] for p, r in rows_per_turn])


def _conversation(store: TraceStore, holder: DictHolder | None, sid: str, turns: int = 3) -> Any:
    rec = TurnRecorder(store, render, tok.encode, holder)
    msgs: list[dict[str, str]] = [
        {"role": "system", "content": "use add"},
        {"role": "user", "content": "reach 9 from 2"},
    ]
    kept: list[tuple[int, Any]] = []
    all_out: list[list[int]] = []
    stored: list[int] = []  # the ids of the conversation recorded so far
    for t in range(turns):
        req = rec.prepare(sid, msgs)
        ids = rec.before_request(sid, msgs)
        assert ids == req.input_ids
        # the stored ids are sent as they are: the whole previous conversation is the prefix
        assert req.prefix.token_ids == stored and (req.prefix.text_len > 0) == (t > 0)
        out, lps, rows = engine(ids, f"add {t + 1}", seed=t)
        content, stopped = strip_stop(tok.decode(out))
        assert stopped
        assistant = {"role": "assistant", "content": content}
        turn = rec.after_response(sid, msgs, assistant, out, lps, rows, version=t)
        assert turn.response.ntok == len(out) and turn.response.version == t
        kept.append((len(req.prefix.token_ids), rows))
        all_out.append(out)
        stored = ids + out
        msgs += [assistant, {"role": "tool", "content": f"= {t}"}]
    return rec, msgs, kept, all_out


def test_recorder_round_trip_with_expert_split(store: TraceStore) -> None:
    holder = DictHolder()
    rec, msgs, kept, all_out = _conversation(store, holder, "s1")
    # the last response node's key: the conversation up to the last assistant turn
    final = render(msgs[:-1], False).rstrip()
    tr = store.export_training_trace("s1", final)
    assert tok.decode(tr.input_ids) == final
    assert tr.expert_keys is not None and len(tr.expert_keys) == 6  # delta + response per turn
    routing = np.concatenate([holder.values[k] for k in tr.expert_keys])
    assert routing.shape == (len(tr.input_ids), L, K)
    assert not routing[0].any()  # the dummy row comes first
    np.testing.assert_array_equal(routing, expected_routing(kept))
    # labels: the engine's ids on generated tokens, -100 elsewhere
    gen = [i for i, lab in zip(tr.input_ids, tr.labels, strict=True) if lab != -100]
    assert gen == [x for out in all_out for x in out]
    assert tr.versions[-1] == 2 and tr.min_version == 0
    # (prefix reuse, the stored ids sent as they are, is checked turn by turn in _conversation)
    assert rec.stats.turns == 3 and rec.stats.invalid == 0
    assert rec.stats.expert_bytes == sum(r[p:].nbytes for p, r in kept)


def test_recorder_without_holder_records_no_experts(store: TraceStore) -> None:
    _, msgs, _, _ = _conversation(store, None, "s2", turns=2)
    tr = store.export_training_trace("s2", render(msgs[:-1], False).rstrip())
    assert tr.expert_keys is None and len(tr.input_ids) > 10


@pytest.mark.parametrize(
    "bad",
    ["empty", "logprobs", "rows", "template", "version"],
)
def test_invalid_response_writes_nothing(store: TraceStore, bad: str) -> None:
    holder = DictHolder()
    rec = TurnRecorder(store, render, tok.encode, holder)
    msgs = [{"role": "user", "content": "reach 3 from 1"}]
    ids = rec.before_request("s3", msgs)
    out, lps, rows = engine(ids, "add 2", 0)
    assistant: dict[str, str] = {"role": "assistant", "content": "add 2"}
    version: Any = 0
    if bad == "empty":
        out, lps, rows = [], [], rows[: len(ids)]
    elif bad == "logprobs":
        lps = lps[:-1]
    elif bad == "rows":
        rows = rows[:-1]
    elif bad == "template":
        assistant = {"role": "assistant", "content": ""}

        def broken(m: Any, gen: bool) -> str:  # renders the answer turn differently
            return render(m, gen) if gen else "something else"

        rec.render = broken
    elif bad == "version":
        version = -1
    with pytest.raises(InvalidInput):
        rec.after_response("s3", msgs, assistant, out, lps, rows, version)
    assert holder.values == {}
    assert store.lookup("s3", render(msgs, True)).text_len == 0
    assert rec.stats.invalid == 1 and rec.stats.turns == 0


def test_recorder_looks_up_again_when_prompt_changed_and_conflicts_surface(
    store: TraceStore,
) -> None:
    rec = TurnRecorder(store, render, tok.encode, None)
    msgs = [{"role": "user", "content": "reach 3 from 1"}]
    ids = rec.before_request("s4", msgs)
    out, lps, rows = engine(ids, "add 2", 0)
    a = {"role": "assistant", "content": "add 2"}
    rec.after_response("s4", msgs, a, out, lps, rows, 0)
    # no pending request: after_response prepares again (the prompt is now a stored key)
    again = rec.after_response("s4", msgs, a, out, lps, rows, 0)
    assert again.written == 0 and again.delta is None
    # a different answer under the same key conflicts and is reported
    with pytest.raises(NodeConflict):
        rec.after_response("s4", msgs, a, out, [x - 1 for x in lps], rows, 0)
    # with a holder, a re-recorded turn has new expert keys: a conflict, never an overwrite;
    # the new refs stay registered under the session (dropped when it is released)
    holder = DictHolder()
    rec2 = TurnRecorder(store, render, tok.encode, holder)
    ids = rec2.before_request("s5", msgs)
    rec2.after_response("s5", msgs, a, out, lps, rows, 0)
    with pytest.raises(NodeConflict):
        rec2.after_response("s5", msgs, a, out, lps, rows, 0)
    assert len(holder.by_sid["s5"]) == 3
    tr = store.export_training_trace("s5", render([*msgs, a], False).rstrip())
    assert tr.expert_keys == holder.by_sid["s5"][:2]
    # a request prepared for other messages is not used: after_response looks its prompt up
    rec.prepare("s6", [{"role": "user", "content": "reach 4 from 1"}])
    t6 = rec.after_response("s6", msgs, a, out, lps, rows, 0)
    assert t6.delta is not None and t6.delta.end == len(render(msgs, True))
    assert store.export_training_trace("s6", render([*msgs, a], False).rstrip()).input_ids == [
        *tok.encode(render(msgs, True)),
        *out,
    ]


def test_async_recorder_writes_what_the_sync_one_reads(url: str, run_id: str, arun: Any) -> None:
    """AsyncTurnRecorder (asyncio session servers): same split, same nodes."""
    from tests.conftest import connect_async
    from tracestore.session import AsyncTurnRecorder

    holder = DictHolder()

    async def go() -> tuple[list[int], Any]:
        store = await connect_async(url, run_id)
        try:
            rec = AsyncTurnRecorder(store, render, tok.encode, holder)
            msgs: list[dict[str, str]] = [{"role": "user", "content": "reach 5 from 1"}]
            for t in range(2):
                ids = await rec.before_request("a1", msgs)
                out, lps, rows = engine(ids, f"add {t + 2}", seed=t)
                a = {"role": "assistant", "content": f"add {t + 2}"}
                await rec.after_response("a1", msgs, a, out, lps, rows, version=t)
                msgs += [a, {"role": "tool", "content": "= 3"}]
            with pytest.raises(InvalidInput):
                await rec.after_response(
                    "a1", msgs, {"role": "assistant", "content": "x"}, [], [], None, 0
                )
            return [len(holder.values)], msgs
        finally:
            await store.close()

    n, msgs = arun(go())
    assert n == [4]
    with TraceStore.connect(url, run=run_id) as sync:
        tr = sync.export_training_trace("a1", render(msgs[:-1], False).rstrip())
    assert tr.expert_keys is not None and len(tr.expert_keys) == 4
    routing = np.concatenate([holder.values[k] for k in tr.expert_keys])
    assert routing.shape[0] == len(tr.input_ids) and not routing[0].any()
    assert tr.versions[0] == 0 and tr.versions[-1] == 1


def test_session_recorder_demo_section(standalone_url: str) -> None:
    from tracestore.demo import run_demo

    rows = dict(
        run_demo(standalone_url, only="session_recorder", echo=lambda s: None)[
            "s25_session_recorder"
        ]
    )
    assert "refused, nothing written" in str(rows["an empty response"])
    assert "4 expert parts with 96 rows" in str(rows["export"])


@pytest.mark.parametrize("holder_type", [DictHolder, ManyHolder])
def test_batched_recorder_equals_one_by_one_and_keeps_failures_apart(
    store_factory: Any, holder_type: type[DictHolder]
) -> None:
    """prepare_many / after_response_many over many sessions: the same traces as the one-by-one
    calls, one round trip per batch, and an invalid response refused alone. A holder with
    ``put_many`` gets every expert part of a batch in one call (the refused one's not at all)."""
    from tests.test_scripts import _Counting
    from tracestore.session import Response

    batched, single = store_factory(), store_factory()
    holders = holder_type(), DictHolder()
    rb = TurnRecorder(batched, render, tok.encode, holders[0])
    rs = TurnRecorder(single, render, tok.encode, holders[1])
    sids = [f"b{i}" for i in range(6)]
    msgs = {s: [{"role": "system", "content": "use add"}, {"role": "user", "content": f"reach {i}"}]
            for i, s in enumerate(sids)}
    count = _Counting(batched)
    for t in range(3):
        count.requests.clear()
        reqs = rb.prepare_many([(s, msgs[s]) for s in sids])
        assert len(count.requests) == 1  # every lookup in one pipeline (warm: the index checks)
        responses = []
        for i, (s, req) in enumerate(zip(sids, reqs, strict=True)):
            assert not isinstance(req, Exception)
            ids = rs.before_request("x" + s, msgs[s])
            assert req.input_ids == ids and req.token_ids == ids
            out, lps, rows = engine(req.input_ids, f"add {t + i}", seed=t)
            answer = {"role": "assistant", "content": strip_stop(tok.decode(out))[0]}
            rs.after_response("x" + s, msgs[s], answer, out, lps, rows, version=t)
            if t == 2 and i == 3:  # one invalid response: one logprob missing
                lps = lps[:-1]
            responses.append(Response(s, msgs[s], answer, out, lps, rows, t))
        count.requests.clear()
        turns = rb.after_response_many(responses)
        assert len(count.requests) == 1  # every write in one pipeline
        for i, (s, r, turn) in enumerate(zip(sids, responses, turns, strict=True)):
            if t == 2 and i == 3:
                assert isinstance(turn, InvalidInput) and turn.field == "logprobs"
                continue
            assert not isinstance(turn, Exception) and turn.response.version == t
            msgs[s] = [*msgs[s], r.assistant_message, {"role": "tool", "content": f"= {t}"}]
    for s in sids:
        key = render(msgs[s][:-1], False).rstrip()  # (b3's third turn was refused: its second)
        a, b = batched.export_training_trace(s, key), single.export_training_trace("x" + s, key)
        assert (a.input_ids, a.labels, a.logprobs, a.versions) == (b.input_ids, b.labels, b.logprobs, b.versions)
        assert [np.asarray(holders[0].values[k]).tolist() for k in a.expert_keys or []] == [
            np.asarray(holders[1].values[k]).tolist() for k in b.expert_keys or []
        ]
    assert rb.stats.turns == 6 * 3 - 1 and rb.stats.invalid == 1
    assert rb.stats.expert_bytes == rs.stats.expert_bytes - sum(
        np.asarray(holders[1].values[k]).nbytes for k in holders[1].by_sid["xb3"][-2:]
    )
    if isinstance(holders[0], ManyHolder):  # one call per round: both parts of every valid turn
        assert [len(c) for c in holders[0].calls] == [6 * 2, 6 * 2, 5 * 2]  # delta + response each
        assert "b3" not in holders[0].calls[2]
    # the batched writes count their turns in the run's shards exactly as record_turn does
    assert batched.stats().turns_recorded == (6 * 3 - 1) + 6 * 3
    # a failed lookup (purged session) stands in place too
    batched.drop_session_data(sids[0])
    got = rb.prepare_many([(s, msgs[s]) for s in sids[:2]])
    assert type(got[0]).__name__ == "SessionReleased" and not isinstance(got[1], Exception)
