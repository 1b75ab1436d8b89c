"""Configuration of a training run (``tracestore train`` options map onto it)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

MODES = ("colocated", "disaggregated")
#: How agents reach the policy: ``local`` (in the rollout worker's process) or ``http``
#: (the openai SDK through a session gateway in front of the workers' engines).
AGENTS = ("local", "http")
#: How rollout workers go over the Ray cluster's nodes (:func:`tracestore.trainer.actors.plan`).
PLACEMENTS = ("spread", "pack")
#: What becomes of a generation a weight update stops (DESIGN section 15): ``continue`` (its
#: tokens are kept and it resumes under the new weights) or ``abort`` (it is thrown away and redone).
ON_WEIGHT_UPDATE = ("continue", "abort")
TASK = "calc"
#: Options of ``tracestore train`` (the others are set from Python only).
CLI_OPTIONS = frozenset(
    {
        "mode", "agents", "steps", "url", "run", "out", "resume", "seed", "workers", "sync_every",
        "checkpoint_every", "ray_address", "placement", "worker_resources", "learner_resources",
        "on_weight_update", "prompts_per_step", "group_size", "gateways",
    }
)
_RESOURCE = re.compile(r"([A-Za-z_][A-Za-z0-9_.:-]*)=([0-9]*\.?[0-9]+)\Z")
#: What ``--resume`` takes from the checkpoint: a flag that disagrees is an error ...
FROM_CHECKPOINT = ("url", "run", "mode")
#: ... unless --override lets it replace the checkpoint's (a resumed run keeps its id).
OVERRIDABLE = ("url", "mode")


def default_run_id() -> str:
    """``train-<unix time>-<6 hex>``: unique also for two runs started in the same second."""
    return f"train-{int(time.time())}-{uuid.uuid4().hex[:6]}"


class ConfigError(ValueError):
    """A training option is invalid (the command prints it and exits 2)."""


def option_name(name: str) -> str:
    """How a person names a config field: ``--sync-every`` for a CLI option, else the field."""
    return f"--{name.replace('_', '-')}" if name in CLI_OPTIONS else name


@dataclass
class TrainConfig:
    """Everything a run needs; defaults give a 1-2 minute run on 2 cores."""

    mode: str = "colocated"
    agents: str = "local"
    steps: int = 20
    url: str | None = None
    run: str = field(default_factory=default_run_id)
    out: str = "train-out"
    resume: bool = False
    seed: int = 0
    workers: int = 2
    prompts_per_step: int = 4
    group_size: int = 8
    #: With ``agents="http"``: session gateway processes the agents' sessions are spread over
    #: (each session sticks to one; each gateway keeps its sessions' routed experts).
    gateways: int = 1
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
    #: HTTP agents: SDK retries of a request answered 503 (a weight update under way).
    http_retries: int = 30
    #: A generation a weight update stops: ``continue`` (kept, resumed under the new weights
    #: from prompt + kept tokens, one turn recorded with per-token versions) or ``abort``
    #: (thrown away; the turn's episode comes back ``aborted`` and is redone after the update).
    on_weight_update: str = "continue"
    #: Continue mode: how long a stopped generation waits for the update to end before it is
    #: given up as in ``abort`` mode (the gateway's ``--hold-timeout`` with ``--agents http``).
    hold_timeout_s: float = 600.0
    #: Rollout workers heartbeat their owner tags with this TTL: when a worker (or its
    #: node) dies, gc declares its tag lost this long after its last heartbeat.
    owner_ttl_s: float = 30.0
    #: The Ray cluster to join (``ray.init(address=...)``; ``auto``, ``HOST:PORT``,
    #: ``ray://HOST:PORT``); None or ``local``: a private local Ray.
    ray_address: str | None = None
    #: Rollout workers over the nodes: ``spread`` (round-robin, pinned) or ``pack`` (Ray decides).
    placement: str = "spread"
    #: Ray resources each rollout worker claims, ``NAME=AMOUNT,...`` (``CPU``, ``GPU``, custom).
    worker_resources: str = ""
    #: Ray resources the learner claims (the evaluation runs in the learner's process).
    learner_resources: str = ""
    #: The run's lock expires this long after the driver's last renewal (renewed every third):
    #: how long a killed driver on another machine keeps a new trainer of the run waiting.
    lock_ttl_s: float = 30.0
    #: Tests: after the checkpoint of this step, kill every actor without cleanup.
    crash_after_step: int | None = None
    #: Tests: each weight update waits up to this long for a rollout worker's next token and
    #: stops its generation right after it (local agents, disaggregated mode), so updates land
    #: mid-generation; the producer then never pauses on a full buffer, so a round is in flight
    #: at each update (0: off).
    update_mid_generation_s: float = 0.0

    def validate(self) -> TrainConfig:
        """Check the options; raise :class:`ConfigError` with a readable message."""
        from tracestore.errors import InvalidId
        from tracestore.keys import validate_run

        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        try:
            validate_run(self.run)
        except InvalidId as exc:
            raise ConfigError(f"--run {self.run!r} is not a run id: {exc.rule}") from None
        if self.on_weight_update not in ON_WEIGHT_UPDATE:
            raise ConfigError(
                f"unknown --on-weight-update {self.on_weight_update!r}: choose one of {', '.join(ON_WEIGHT_UPDATE)}"
            )
        if not self.hold_timeout_s > 0:
            raise ConfigError(f"hold_timeout_s must be positive, got {self.hold_timeout_s}")
        if self.agents not in AGENTS:
            raise ConfigError(f"unknown agents {self.agents!r}: choose one of {', '.join(AGENTS)}")
        if self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        for name in (
            "workers",
            "gateways",
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
                raise ConfigError(f"{option_name(name)} must be at least 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError(
                f"{option_name('group_size')} must be at least 2 (GRPO compares samples of a prompt), got {self.group_size}"
            )
        if self.gateways > 1 and self.agents != "http":
            raise ConfigError(f"--gateways {self.gateways} only applies with --agents http (local agents use none)")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"unknown placement {self.placement!r}: choose one of {', '.join(PLACEMENTS)}"
            )
        resources(self.worker_resources, "worker_resources")
        resources(self.learner_resources, "learner_resources")
        if not self.owner_ttl_s > 0:
            raise ConfigError(f"owner_ttl_s must be positive, got {self.owner_ttl_s}")
        if not self.lock_ttl_s > 0:
            raise ConfigError(f"lock_ttl_s must be positive, got {self.lock_ttl_s}")
        if not self.eval_temperature > 0 or not self.lr > 0:
            raise ConfigError("eval_temperature and lr must be positive")
        if self.warmup_steps < 0 or self.max_staleness < 0:
            raise ConfigError("warmup_steps and max_staleness must be non-negative")
        return self

    @property
    def joins_cluster(self) -> bool:
        """True when the run joins an existing Ray cluster (``ray_address`` other than ``local``)."""
        return self.ray_address not in (None, "", "local")

    def to_json(self) -> dict[str, Any]:
        """JSON form (sent to actors, stored in checkpoints and reports)."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_json` (unknown keys ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def resumed(self, given: Mapping[str, Any], *, override: bool = False) -> TrainConfig:
        """The configuration of ``--resume``: this (the checkpoint's) with the options ``given``.

        URL, run and mode come from the checkpoint (:data:`FROM_CHECKPOINT`):
        a given one that disagrees raises ConfigError naming both values,
        unless ``override`` (URL and mode only: a resumed run keeps its id).
        Other given options (``--steps`` to go further, ``--workers``...)
        replace the checkpoint's.
        """
        from tracestore.connection import mask_url

        out = replace(self, resume=True, crash_after_step=None)
        for name, value in given.items():
            saved = getattr(self, name)
            if name in FROM_CHECKPOINT and value != saved:
                if not override or name not in OVERRIDABLE:
                    flag = option_name(name)
                    fix = "add --override to change it" if name in OVERRIDABLE else (
                        "a resumed run keeps its id"
                    )
                    shown, was = (mask_url(value), mask_url(saved)) if name == "url" else (value, saved)
                    raise ConfigError(
                        f"{flag} {shown!r} disagrees with the checkpoint, which ran with "
                        f"{was!r}; leave {flag} out to resume as it was, or {fix}"
                    )
            setattr(out, name, value)
        return out


def resources(spec: str, name: str = "resources") -> dict[str, float]:
    """Parse a Ray resource request ``NAME=AMOUNT[,NAME=AMOUNT...]`` (``""``: none).

    ``CPU`` and ``GPU`` are Ray's own; other names are custom resources a
    node declares (``ray start --resources '{"rollout": 1}'``). Raises
    ConfigError naming the option for a malformed entry, a zero amount or a
    name given twice.
    """
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        m = _RESOURCE.match(part)
        if m is None or float(m.group(2)) <= 0:
            raise ConfigError(
                f"{option_name(name)} {spec!r}: {part!r} is not NAME=AMOUNT with a positive "
                "amount (e.g. CPU=4,GPU=1 or rollout=1)"
            )
        if m.group(1) in out:
            raise ConfigError(f"{option_name(name)} {spec!r}: {m.group(1)} is given twice")
        out[m.group(1)] = float(m.group(2))
    return out
