"""One turn's answer across policy calls: a generation a weight update stopped and the rollout
worker continued (DESIGN section 15, ``--on-weight-update continue``) is one answer, recorded
once, with the weight version of every token.

:class:`Continuation` adds each call's ids, logprobs and routed experts,
tagging the ids with the version of the gate lease the call ran under. The
input of the next call is the prompt plus every id so far, with the rest of
the token budget. Routed experts are concatenated as the session gateway
does (``tracestore/gateway/generation.py``): the rows up to the ids the
earlier calls generated come from those calls, the rest from the call that
resumed (its prompt rows past them are the routing of the tokens it fed),
so the array has ``prompt + ids`` rows, row 0 the dummy, as one call's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .policy import Generation


@dataclass
class Continuation:
    """The answer so far of one turn whose input is ``prompt`` (see the module docstring)."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: The version of each id: that of the lease its call ran under.
    versions: list[int] = field(default_factory=list)
    #: ``[prompt + ids, layers, top_k]`` int32, row 0 dummy; None before the first call.
    experts: np.ndarray | None = None
    #: Policy calls that ran (a call stopped before it started is not one).
    calls: int = 0
    #: How the last call ended: ``stop``, ``length`` or ``abort`` (None: no call yet).
    finish: str | None = None
    #: Times a weight update stopped this turn and it waited for the new weights.
    held: int = 0

    @property
    def input_ids(self) -> list[int]:
        """What the next call generates after: the prompt and every id so far."""
        return [*self.prompt, *self.ids]

    def budget(self, max_new_tokens: int) -> int:
        """The tokens the next call may generate: ``max_new_tokens`` less the ids so far."""
        return max_new_tokens - len(self.ids)

    def add(self, gen: Generation, version: int) -> None:
        """Fold one call's :class:`~.policy.Generation` (run under a lease of ``version``).

        Raises ValueError when the call's routed experts do not cover its
        input and output (``prompt + ids + new ids`` rows).
        """
        keep = len(self.prompt) + len(self.ids)  # rows (with the dummy) of what earlier calls fed
        rows = keep + len(gen.output_ids)
        if gen.routed_experts.shape[0] != rows:
            raise ValueError(f"routed experts of {gen.routed_experts.shape[0]} rows for {rows} tokens")
        if self.experts is None or not self.ids:
            self.experts = gen.routed_experts
        else:
            self.experts = np.concatenate([self.experts[:keep], gen.routed_experts[keep:]])
        self.ids += gen.output_ids
        self.logprobs += gen.logprobs
        self.versions += [version] * len(gen.output_ids)
        self.calls += 1
        self.finish = gen.finish_reason

    def stopped_before_start(self) -> None:
        """A weight update stopped the turn before its next call ran (nothing generated)."""
        self.finish = "abort"

    @property
    def mixed_versions(self) -> list[int] | None:
        """The per-token versions when they differ (what ``record_turn`` takes), else None."""
        return list(self.versions) if len(set(self.versions)) > 1 else None

    @property
    def first_version(self) -> int | None:
        """The version of the first id (None before any)."""
        return self.versions[0] if self.versions else None


__all__ = ["Continuation"]
