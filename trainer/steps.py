"""The record of one training step (:class:`StepRecord`): what a checkpoint keeps and the report shows.

Its own module because the learner makes it, the checkpoint stores it and
the report reads it; none of them needs the others for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """One training step: batch reward and staleness, loss, bookkeeping, optional evaluation."""

    step: int
    reward: float
    staleness_mean: float
    staleness_max: int
    groups: int
    samples: int
    released: int
    taken: int
    loss: float
    approx_kl: float
    #: Max |replayed - rollout| logprob over samples made by the current weights (None: none).
    replay_max_abs_diff: float | None
    version: int
    synced: bool
    wait_s: float
    eval_reward: float | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form (checkpoints, report.json); ``eval_reward`` only on evaluation steps."""
        d = dataclasses.asdict(self)
        if self.eval_reward is None:
            del d["eval_reward"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepRecord:
        """Inverse of :meth:`to_json`."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
