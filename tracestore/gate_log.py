"""The gate's log: the history of weight-update cycles (seal, drain, install, reopen).

The scripts that change the gate's state append one entry each to the
capped stream ``ts:{R}:gate:log`` (:attr:`~tracestore.keys.Keys.gate_log`,
:data:`~tracestore.gate.LOG_ENTRIES` entries at most), in the same atomic
call as the change, so a retried call (its op id replays the reply) logs
nothing twice:

* ``seal`` (``gate_seal`` closing an open gate): ``version``, ``live``
  (leases live at that moment), ``ms``;
* ``install`` (``gate_install``): ``version``, ``previous``, ``sealed_ms``,
  ``drained_ms`` (the first drain check that found the sealed gate empty,
  else the install itself), ``ms``;
* ``reopen`` (``gate_seal`` opening a sealed gate): ``version``,
  ``sealed_ms``, ``drained_ms`` (empty when no drain check saw it empty and
  nothing was installed), ``ms``.

All times are the server's clock (ms). :func:`gate_events` reads the newest
entries; :func:`cycles` folds them into :class:`GateCycle` records, one per
seal, with its drain time. Pure decoding here; one read (XREVRANGE) per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .context import Context
from .replies import field_map, stored, text
from .scripts import Cmd, Op
from .validate import int_in

#: The kinds of entry the gate scripts append.
EVENTS = ("seal", "install", "reopen")


@dataclass(frozen=True)
class GateEvent:
    """One entry of the gate's log (see the module docstring for what each kind carries)."""

    #: The stream entry id (``<ms>-<seq>``).
    id: str
    #: ``seal``, ``install`` or ``reopen``.
    ev: str
    #: Server time of the change (ms).
    ms: int
    #: The gate's version after the change (an install: the version installed).
    version: int
    #: seal: leases live when the gate was sealed.
    live: int | None = None
    #: install: the version it replaced.
    previous: int | None = None
    #: install, reopen: when the gate was sealed (None when not known).
    sealed_ms: int | None = None
    #: install, reopen: when a drain first found the sealed gate empty (None when not known).
    drained_ms: int | None = None


@dataclass(frozen=True)
class GateCycle:
    """One weight-update cycle: from a seal to the reopen that ended it.

    ``reopened_ms`` is None while the gate is still sealed; ``installed``
    lists the versions installed during the cycle (usually one, none when
    the update was abandoned). A cycle whose seal was trimmed from the log
    takes ``sealed_ms`` from its install or reopen entry.
    """

    sealed_ms: int | None
    drained_ms: int | None
    installed_ms: int | None
    reopened_ms: int | None
    version_from: int
    installed: tuple[int, ...]
    live_at_seal: int | None

    @property
    def drain_ms(self) -> int | None:
        """Milliseconds from the seal until no lease was live (None when either is unknown)."""
        if self.sealed_ms is None or self.drained_ms is None:
            return None
        return max(0, self.drained_ms - self.sealed_ms)

    @property
    def sealed_for_ms(self) -> int | None:
        """Milliseconds the gate stayed sealed (None while sealed or when the seal is unknown)."""
        if self.sealed_ms is None or self.reopened_ms is None:
            return None
        return max(0, self.reopened_ms - self.sealed_ms)

    @property
    def version_to(self) -> int:
        """The version after the cycle (``version_from`` when nothing was installed)."""
        return self.installed[-1] if self.installed else self.version_from


def _opt(v: Any) -> int | None:
    s = text(v) if v is not None else ""
    return int(s) if s else None


def decode_entry(entry_id: Any, fields: Any, key: str = "gate log") -> GateEvent:
    """One XRANGE/XREVRANGE entry of the log as a :class:`GateEvent`.

    Raises CorruptData naming ``key`` and the entry id when a field is missing or not a number.
    """
    eid = text(entry_id)
    with stored(key, eid):
        f = {k: text(v) for k, v in field_map(fields).items()}
        ev = f["ev"]
        if ev not in EVENTS:
            raise ValueError(f"unknown event {ev!r:.40}")
        return GateEvent(
            id=eid,
            ev=ev,
            ms=int(f["ms"]),
            version=int(f["version"]),
            live=_opt(f.get("live")),
            previous=_opt(f.get("previous")),
            sealed_ms=_opt(f.get("sealed_ms")),
            drained_ms=_opt(f.get("drained_ms")),
        )


def gate_events(ctx: Context, count: int = 100) -> Op[list[GateEvent]]:
    """The newest ``count`` entries of the run's gate log (1..10,000), newest first.

    Raises InvalidInput for a bad ``count`` (before I/O), CorruptData for an
    entry that does not decode. One round trip (XREVRANGE; read-only, an
    observer may call it).
    """
    int_in("count", count, 1, 10_000)
    key = ctx.keys.gate_log
    reply = yield Cmd(("XREVRANGE", key, "+", "-", "COUNT", count), key=key)
    return [decode_entry(eid, fields, key) for eid, fields in reply]


def cycles(events: Sequence[GateEvent]) -> list[GateCycle]:
    """Fold log entries (any order) into cycles, oldest first (pure).

    A seal opens a cycle; installs join it; a reopen closes it. An install
    or reopen whose seal is not among ``events`` (trimmed, or outside the
    window read) opens a cycle of its own from the ``sealed_ms`` it carries.
    """
    out: list[GateCycle] = []
    cur: dict[str, Any] | None = None

    def close(reopened: int | None) -> None:
        nonlocal cur
        if cur is not None:
            out.append(GateCycle(reopened_ms=reopened, installed=tuple(cur.pop("installed")), **cur))
            cur = None

    for e in sorted(events, key=lambda e: _order(e.id)):
        if e.ev == "seal":
            close(None)  # a seal with no reopen logged before the next one (the log lost it)
            cur = {"sealed_ms": e.ms, "drained_ms": None, "installed_ms": None, "version_from": e.version,
                   "installed": [], "live_at_seal": e.live}
            continue
        if cur is None:
            version_from = e.previous if e.ev == "install" and e.previous is not None else e.version
            cur = {"sealed_ms": e.sealed_ms, "drained_ms": None, "installed_ms": None,
                   "version_from": version_from, "installed": [], "live_at_seal": None}
        if e.drained_ms is not None and cur["drained_ms"] is None:
            cur["drained_ms"] = e.drained_ms
        if e.ev == "install":
            cur["installed"].append(e.version)
            cur["installed_ms"] = e.ms
        else:
            close(e.ms)
    close(None)
    return out


def _order(entry_id: str) -> tuple[int, int]:
    """A stream entry id ``<ms>-<seq>`` as a sort key (the order the entries were appended)."""
    ms, _, seq = entry_id.partition("-")
    return (int(ms) if ms.isdigit() else 0, int(seq) if seq.isdigit() else 0)


__all__ = ["EVENTS", "GateCycle", "GateEvent", "cycles", "decode_entry", "gate_events"]
