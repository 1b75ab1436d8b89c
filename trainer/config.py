"""Configuration of a training run (``tracestore train`` options map onto it)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MODES = ("colocated", "disaggregated")
TASK = "calc"


class ConfigError(ValueError):
    """A training option is invalid (the command prints it and exits non-zero)."""


@dataclass
class TrainConfig:
    """Everything a run needs; defaults give a 1-2 minute run on 2 cores."""

    mode: str = "colocated"
    steps: int = 20
    url: str | None = None
    run: str = field(default_factory=lambda: f"train-{int(time.time())}")
    out: str = "train-out"
    resume: bool = False
    seed: int = 0
    workers: int = 2
    prompts_per_step: int = 4
    group_size: int = 8
    max_calls: int = 3
    max_new_tokens: int = 8
    lr: float = 2e-3
    warmup_steps: int = 120
    sync_every: int = 1
    eval_every: int = 4
    eval_prompts: int = 32
    #: Evaluation samples at a lower temperature (less noise than the training samples).
    eval_temperature: float = 0.5
    checkpoint_every: int = 4
    max_staleness: int = 2
    #: Disaggregated: the producer pauses while this many completed groups wait.
    max_buffer: int = 4
    lease_ttl_s: float = 30.0
    drain_timeout_s: float = 30.0
    holder_drain_s: float = 15.0
    #: Tests: after the checkpoint of this step, kill every actor without cleanup.
    crash_after_step: int | None = None

    def validate(self) -> TrainConfig:
        """Check the options; raise :class:`ConfigError` with a readable message."""
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        for name in (
            "workers",
            "prompts_per_step",
            "group_size",
            "max_calls",
            "max_new_tokens",
            "sync_every",
            "eval_every",
            "checkpoint_every",
            "eval_prompts",
            "max_buffer",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError("group_size must be at least 2 (GRPO compares samples of a prompt)")
        if not self.eval_temperature > 0 or not self.lr > 0:
            raise ConfigError("eval_temperature and lr must be positive")
        if self.warmup_steps < 0 or self.max_staleness < 0:
            raise ConfigError("warmup_steps and max_staleness must be non-negative")
        return self

    def to_json(self) -> dict[str, Any]:
        """JSON form (sent to actors, stored in checkpoints and reports)."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_json` (unknown keys ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
