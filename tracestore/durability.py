"""Durability levels: when a mutating call counts as acknowledged (DESIGN section 11).

Redis replication is asynchronous: a primary answers a write before its
replicas have it, so a failover to a replica that lagged loses writes the
primary had acknowledged. ``connect(..., durability=...)`` chooses what a
mutating call waits for before it returns:

``"none"``
    the primary's answer (fastest; what Redis gives by default);
``"replicas"``
    ``WAIT durability_replicas timeout``: that many replicas have the write;
``"aof"``
    ``WAITAOF 1 0 timeout``: the primary fsynced it to its append-only file;
``"replicas+aof"``
    both.

The wait runs after every mutating script, on the same node connection and
in the same round trip (the script and the wait are pipelined; a batch sends
its scripts of one node, then one wait for that node). Read-only scripts
and plain commands get no wait. When the wait does not confirm the write
within ``durability_timeout_s``, the call raises
:class:`~tracestore.errors.DurabilityUnconfirmed`: the script ran, but its
outcome after a failure of the primary is unknown. docs/durability.md has
the table of what each level survives and what it costs.

This module is the pure part (levels, options, the wait commands and how
their replies are read); the I/O layers (:mod:`tracestore.io`) send them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

#: The durability levels, weakest first.
LEVELS = ("none", "replicas", "aof", "replicas+aof")
#: Environment variable giving the default level of ``connect`` (``durability=`` wins).
ENV_DURABILITY = "TRACESTORE_DURABILITY"
#: Environment variables giving the defaults of ``durability_replicas`` and ``durability_timeout_s``.
ENV_REPLICAS = "TRACESTORE_DURABILITY_REPLICAS"
ENV_TIMEOUT = "TRACESTORE_DURABILITY_TIMEOUT_S"
#: Every environment variable :meth:`Durability.from_options` reads.
ENV_NAMES = (ENV_DURABILITY, ENV_REPLICAS, ENV_TIMEOUT)
#: ``connect`` keywords read by :meth:`Durability.from_options`.
OPTION_NAMES = ("durability", "durability_replicas", "durability_timeout_s")


@dataclass(frozen=True)
class Durability:
    """What a mutating call waits for: ``level``, ``replicas`` (for WAIT) and ``timeout_s``.

    Raises ConfigError for an unknown level, a replica count outside 1..16
    or a timeout outside (0, 60] seconds.
    """

    level: str = "none"
    replicas: int = 1
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(
                f"durability={self.level!r} is not a durability level; use one of {', '.join(LEVELS)}"
            )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or not 1 <= self.replicas <= 16:
            raise ConfigError(f"durability_replicas must be an integer in 1..16, got {self.replicas!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= 60:
            raise ConfigError(f"durability_timeout_s must be a number of seconds in (0, 60], got {t!r}")

    @classmethod
    def from_options(cls, opts: dict[str, Any]) -> Durability:
        """The level given by ``connect``'s keywords (removed from ``opts``), else the environment's.

        Each keyword not given falls back to its variable
        (``$TRACESTORE_DURABILITY``, ``$TRACESTORE_DURABILITY_REPLICAS``,
        ``$TRACESTORE_DURABILITY_TIMEOUT_S``), then to ``none``, 1 and 1.0 s:
        a process started by a launcher (a Ray role, a gateway) gets the
        deployment's level without code. A variable that does not parse is a
        ConfigError naming it.
        """
        level = opts.pop("durability", None)
        if level is None:
            level = os.environ.get(ENV_DURABILITY, "").strip() or "none"
        replicas = opts.pop("durability_replicas", None)
        if replicas is None:
            replicas = _env_number(ENV_REPLICAS, int, 1)
        timeout_s = opts.pop("durability_timeout_s", None)
        if timeout_s is None:
            timeout_s = _env_number(ENV_TIMEOUT, float, 1.0)
        return cls(level, replicas, timeout_s)

    @property
    def waits(self) -> bool:
        """True when mutating scripts are followed by a wait."""
        return self.level != "none"

    @property
    def needs_replicas(self) -> bool:
        """True for ``replicas`` and ``replicas+aof``."""
        return "replicas" in self.level

    @property
    def needs_aof(self) -> bool:
        """True for ``aof`` and ``replicas+aof``."""
        return "aof" in self.level

    @property
    def timeout_ms(self) -> int:
        """The wait's server-side timeout in milliseconds (at least 1: 0 would mean forever)."""
        return max(1, round(self.timeout_s * 1000))

    def commands(self) -> tuple[tuple[Any, ...], ...]:
        """The wait commands that follow a node's mutating scripts (none for ``"none"``)."""
        out: list[tuple[Any, ...]] = []
        if self.needs_replicas:
            out.append(("WAIT", self.replicas, self.timeout_ms))
        if self.needs_aof:
            out.append(("WAITAOF", 1, 0, self.timeout_ms))
        return tuple(out)

    def shortfall(self, replies: list[Any]) -> str | None:
        """What the replies of :meth:`commands` failed to confirm (None: confirmed).

        ``WAIT`` answers the number of replicas that acknowledged; ``WAITAOF``
        ``[local fsynced (0|1), replicas fsynced]``. An error reply (or an
        exception object) is reported by its text.
        """
        missing: list[str] = []
        for cmd, reply in zip(self.commands(), replies, strict=True):
            if isinstance(reply, BaseException):
                missing.append(f"{cmd[0]} failed: {reply}")
            elif cmd[0] == "WAIT":
                if int(reply) < self.replicas:
                    missing.append(
                        f"{int(reply)} of {self.replicas} replica(s) acknowledged within {self.timeout_s:g} s"
                    )
            elif not int(reply[0]):
                missing.append(f"the primary's AOF was not fsynced within {self.timeout_s:g} s")
        return "; ".join(missing) or None


def _env_number(name: str, kind: type[int] | type[float], default: float) -> Any:
    """``$name`` parsed as ``kind`` (``default`` when unset or blank); ConfigError naming it otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None


#: The default: no wait.
NONE = Durability()

__all__ = ["ENV_DURABILITY", "ENV_NAMES", "ENV_REPLICAS", "ENV_TIMEOUT", "LEVELS", "NONE", "OPTION_NAMES", "Durability"]
