"""One answer's tokens across engine calls: a generation that a weight update stopped and the
gateway continued (DESIGN section 15) is one answer, one recorded turn, with the version of
every token.

:class:`Generation` adds each engine call's ids, logprobs and routed experts,
tagging the ids with the weight version their call was admitted under. The
engine input of the next call is the prompt plus every id so far, with the
remaining token budget. Routed experts are concatenated: the rows of each
call's own tokens (its prompt rows come from the calls before it, which
generated those tokens), so every token keeps the routing that produced it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from ..traces import KeptExperts
from .engines import Chunk, EngineOutput
from .experts import decode_experts


@dataclass
class Generation:
    """The answer so far (see the module docstring). ``prompt``: ids of the turn's engine input."""

    prompt: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    matched: int | str | None = None
    weight_version: str | None = None
    calls: int = 0
    #: Routed experts of every id fed through the model so far (a numpy array with the dummy
    #: row 0), None when the engine gave none; ``experts_missing``: some call's rows are unknown.
    experts: Any = None
    experts_missing: bool = False
    _start: int = 0

    @classmethod
    def resumed(
        cls, prompt: int, ids: tuple[int, ...], logprobs: tuple[float, ...], versions: tuple[int, ...],
        experts: KeptExperts | None = None,
    ) -> Generation:
        """A generation continued from tokens kept in the store, with the routed experts kept
        with them (rows of the prompt's new tokens and of the kept ids); without them, or when
        they do not cover those, the answer's experts are unknown (``experts_missing``)."""
        g = cls(prompt, list(ids), list(logprobs), list(versions))
        if experts is not None and ids and experts.start + experts.rows == prompt + len(ids):
            import numpy as np  # the gateway extra has numpy; only routed experts need it

            rows = np.frombuffer(experts.data, dtype="<i4").reshape(experts.rows, *experts.row_shape)
            full = np.zeros((prompt + len(ids), *experts.row_shape), dtype=np.int32)
            full[experts.start :] = rows  # (rows before start: the stored path's, never recorded again)
            g.experts = full
        else:
            g.experts_missing = bool(ids)
        return g

    def kept_experts(self, start: int) -> KeptExperts | None:
        """The routed experts of input positions ``start`` on and of the ids so far, to keep with
        them (None: none known)."""
        if self.experts is None or self.experts_missing or not self.ids:
            return None
        rows = self.experts[start : self.prompt + len(self.ids)]
        return KeptExperts(start, int(rows.shape[0]), tuple(int(x) for x in rows.shape[1:]), rows.astype("<i4").tobytes())

    def begin(self) -> None:
        """A new engine call starts (from the prompt plus :attr:`ids`)."""
        self.calls += 1
        self.finish = None
        self.matched = None
        self._start = len(self.ids)

    def add(self, chunk: Chunk, version: int) -> None:
        """Fold one chunk of the current call (its ids generated under ``version``)."""
        self.ids.extend(chunk.ids)
        self.logprobs.extend(chunk.logprobs)
        self.versions.extend([version] * len(chunk.ids))
        if chunk.finish is not None:
            self.finish = chunk.finish
            self.matched = chunk.matched
        if chunk.weight_version is not None:
            self.weight_version = chunk.weight_version
        if chunk.routed_experts is not None:
            self._experts(chunk.routed_experts, chunk.experts_shape)

    def add_output(self, out: EngineOutput, version: int) -> None:
        """Fold a whole call's output."""
        self.add(
            Chunk(
                tuple(out.output_ids), tuple(out.logprobs), out.finish, out.matched, out.weight_version,
                out.routed_experts, out.experts_shape,
            ),
            version,
        )

    def _experts(self, b64: str, shape: tuple[int, ...] | None) -> None:
        import numpy as np  # the gateway extra has numpy; only routed experts need it

        rows = self.prompt + len(self.ids) - 1  # every id fed through the model by this call
        arr = decode_experts(b64, shape, rows)  # (ValueError: counted as an engine error)
        if self.experts is None or self._start == 0:
            self.experts = arr
            return
        keep = self.prompt + self._start  # rows (with the dummy) of tokens earlier calls generated
        self.experts = np.concatenate([self.experts[:keep], arr[keep:]])

    def output(self) -> EngineOutput:
        """The whole answer as one engine output (experts re-encoded when there are any)."""
        b64, shape = None, None
        if self.experts is not None and not self.experts_missing:
            rows = self.experts[1:]
            b64 = base64.b64encode(rows.astype("<i4").tobytes()).decode()
            shape = tuple(int(x) for x in rows.shape)
        return EngineOutput(
            list(self.ids), list(self.logprobs), self.finish, self.matched, self.weight_version, b64, shape
        )

    @property
    def distinct_versions(self) -> list[int]:
        """The versions of the answer's tokens, first to last, each once."""
        out: list[int] = []
        for v in self.versions:
            if not out or out[-1] != v:
                out.append(v)
        return out


__all__ = ["Generation"]
