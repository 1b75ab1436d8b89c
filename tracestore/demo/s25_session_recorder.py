"""Demo section: a session server's single-phase write with routed experts (TurnRecorder)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidInput
from ..session import TurnRecorder
from ..store import TraceStore

TITLE = "Session server: TurnRecorder before/after each request, routed experts split per node"

LAYERS, TOP_K = 2, 2


def _render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


class Rows(list):  # type: ignore[type-arg]
    """The engine's routed experts ``[tokens, layers, top_k]`` (a numpy array in real use)."""

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self), LAYERS, TOP_K)

    @property
    def nbytes(self) -> int:
        return 4 * LAYERS * TOP_K * len(self)


class DictHolder:
    """Stands in for ``tracestore.ray.RefHolder`` (which does ``ray.put`` and drops on release)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def put(self, sid: str, value: Any) -> str:
        key = f"demo-holder:{len(self.values)}"
        self.values[key] = list(value)
        return key


def _engine(input_ids: list[int], answer: str) -> tuple[list[int], list[float], Rows]:
    out = _encode(answer + "<|end|>")
    n = len(input_ids) + len(out)
    rows = Rows(
        ([[0, 0]] * LAYERS) if i == 0 else ([[i % 4, (i + 1) % 4]] * LAYERS) for i in range(n)
    )
    return out, [-0.5] * len(out), rows


def run(store: TraceStore) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    holder = DictHolder()
    rec = TurnRecorder(store, _render, _encode, holder)
    sid = "agent-1"
    messages: list[dict[str, str]] = [{"role": "user", "content": "reach 9 from 2"}]
    for i, answer in enumerate(("add 7", "done")):
        ids = rec.before_request(sid, messages)  # lookup + tokenize the delta only
        out, lps, experts = _engine(ids, answer)
        turn = rec.after_response(
            sid, messages, {"role": "assistant", "content": answer}, out, lps, experts, version=i
        )
        rows.append(
            (
                f"turn {i + 1}: {answer}",
                f"sent {len(ids)} ids; stored delta {turn.delta.ntok if turn.delta else 0} + "
                f"response {turn.response.ntok} tokens, expert rows split "
                f"{turn.delta.ntok if turn.delta else 0}/{turn.response.ntok}",
            )
        )
        messages += [{"role": "assistant", "content": answer}, {"role": "tool", "content": "= 9"}]
    try:
        rec.before_request(sid, messages)
        rec.after_response(sid, messages, {"role": "assistant", "content": "x"}, [], [], None, 2)
    except InvalidInput as exc:
        rows.append(("an empty response", f"refused, nothing written: {exc}"))
    final = _render(messages[:-1], False)
    tr = store.export_training_trace(sid, final)
    assert tr.expert_keys is not None
    n_rows = sum(len(holder.values[k]) for k in tr.expert_keys)
    rows.append(
        (
            "export",
            f"{len(tr.input_ids)} tokens, {len(tr.expert_keys)} expert parts with {n_rows} rows "
            f"(= tokens: dummy row first, each row once)",
        )
    )
    return rows
