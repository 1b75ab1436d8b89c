"""The gate's value types and limits: leases, receipts, status, drain results, lease records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

#: Outcomes a lease can be settled with; ``unknown`` poisons the lease.
OUTCOMES = ("completed", "aborted", "failed", "unknown")
#: Default retry hint given to admissions refused while the gate is sealed.
DEFAULT_RETRY_AFTER_MS = 500
#: Longest single blocking wait of ``drain`` (it re-checks the gate, then blocks
#: again); keeps a blocking read well under the client's socket timeout.
MAX_BLOCK_S = 5.0
#: How many poisoned lease ids a status or drain result carries.
MAX_IDS = 100
#: Entries the gate's log ``ts:{R}:gate:log`` keeps (seal, install, reopen; :mod:`tracestore.gate_log`).
LOG_ENTRIES = 1000
#: Longest engine base URL a lease records (``admit(..., engine=)``).
MAX_ENGINE_URL = 256
#: How long ``weight_update`` waits, by default, for someone to resolve live leases whose
#: holders stopped heart-beating before it gives up (NotDrained) and reopens.
DEAD_HOLDER_WAIT_S = 5.0
#: The resolution written on leases settled because their holder stopped heart-beating.
HOLDER_DEAD = "holder-dead"


class AdmitRequest(NamedTuple):
    """One request of :meth:`Gate.admit_many`: its session, holder and, optionally, where it runs.

    ``engine`` (the engine's base URL) and ``request`` (the engine's request
    id) let anyone abort the request at its engine if the holder dies
    (:meth:`Gate.dead_holder_leases`). A plain ``(sid, holder)`` pair is the
    same as ``AdmitRequest(sid, holder)``.
    """

    sid: str
    holder: str
    engine: str | None = None
    request: str | None = None


# -- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    """An admitted request: ``id`` and the weight ``version`` it was admitted under.

    ``sid`` and ``deadline_ms`` (server clock) are informational; pass the
    lease (or its id) to :meth:`Gate.renew` and :meth:`Gate.settle`.
    """

    id: str
    version: int
    sid: str = ""
    deadline_ms: int = 0


@dataclass(frozen=True)
class SettlementReceipt:
    """The first settlement of a lease (settling again returns the same receipt).

    ``late``: settled after its deadline (it may have been poisoned meanwhile;
    a definite outcome resolved that). ``poisoned``: the lease is in the
    poison set after this settlement (outcome ``unknown``). ``replayed`` is
    True when this call found the lease already settled (not compared).
    ``admitted``: False when the server never admitted the lease (its admit's
    reply was lost and it never ran): this settlement fenced the id, an admit
    with it is refused (LeaseFenced) for the receipt retention, and
    ``version`` is -1. ``resolution``: the note the first settlement carried
    (``holder-dead`` for a lease resolved after its holder stopped
    heart-beating), else None.
    """

    lease_id: str
    outcome: str
    version: int
    settled_ms: int
    late: bool
    poisoned: bool
    replayed: bool = field(default=False, compare=False)
    admitted: bool = True
    resolution: str | None = None


@dataclass(frozen=True)
class PoisonedLease:
    """One entry of the poison set: why the outcome of this lease is unknown.

    ``reason``: ``expired`` (past its deadline), ``unknown`` (settled so) or
    ``overdue`` (past its deadline, not yet moved to the poison set).
    """

    lease_id: str
    reason: str
    at_ms: int | None = None
    deadline_ms: int | None = None


@dataclass(frozen=True)
class PoisonEntry:
    """One poisoned lease with what its record says: who held it and where it ran.

    ``reason``: ``expired``, ``unknown`` or ``overdue`` (as :class:`PoisonedLease`).
    ``since_ms``: when its outcome became unknown (its deadline, or its
    ``unknown`` settlement; server clock); ``server_ms``: the server clock
    when it was read. The record's fields are None when the record is gone.
    """

    lease_id: str
    reason: str
    since_ms: int | None
    server_ms: int
    sid: str | None = None
    holder: str | None = None
    engine: str | None = None
    request: str | None = None
    version: int | None = None

    @property
    def ago_ms(self) -> int | None:
        """How long ago its outcome became unknown (ms), when known."""
        return None if self.since_ms is None else max(0, self.server_ms - self.since_ms)


@dataclass(frozen=True)
class GateStatus:
    """A snapshot of the gate (see :meth:`Gate.status`).

    ``live``: leases within their deadline. ``poisoned``: poisoned leases plus
    overdue ones (which the next gate script moves to the poison set).
    ``poison`` lists up to 100 of them.
    """

    state: str
    version: int
    live: int
    poisoned: int
    sealed_ms: int | None = None
    installed_ms: int | None = None
    next_deadline_ms: int | None = None
    server_ms: int = 0
    poison: tuple[PoisonedLease, ...] = ()

    @property
    def sealed(self) -> bool:
        """True while the gate refuses admissions."""
        return self.state == "sealed"

    @property
    def installable(self) -> bool:
        """True when ``install`` of a larger version would succeed now."""
        return self.sealed and self.live == 0 and self.poisoned == 0


@dataclass(frozen=True)
class DrainResult:
    """What :meth:`Gate.drain` found when it returned.

    ``drained``: no live lease remains. ``live``: leases still live (timeout).
    ``poisoned``/``poisoned_ids``: the poison set (count, first 100 ids).
    ``newly_poisoned``: leases this drain moved to poison (deadline passed).
    ``waited_s``: time spent in drain. ``ok``: install would not be refused
    for live or poisoned leases. ``dead_held``: how many of the live leases
    are held by holders whose heartbeat stopped (nobody but a resolver will
    settle them); ``dead_held_ids``: the first 100 of them.
    """

    drained: bool
    live: int
    poisoned: int
    poisoned_ids: tuple[str, ...]
    newly_poisoned: tuple[str, ...]
    state: str
    version: int
    waited_s: float
    dead_held: int = 0
    dead_held_ids: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when drained and nothing is poisoned."""
        return self.drained and self.poisoned == 0


@dataclass(frozen=True)
class LeaseRecord:
    """The stored record of one lease (operators: who held a poisoned lease).

    ``engine`` and ``request``: where the request ran, when the admit said
    (None otherwise, and once settled with a definite outcome: a receipt
    keeps only ``sid``, ``version``, ``outcome``, ``settled_ms``, ``late``
    and ``resolution``).
    """

    lease_id: str
    sid: str
    holder: str
    version: int
    admitted_ms: int
    deadline_ms: int
    outcome: str | None
    settled_ms: int | None
    resolution: str | None
    engine: str | None = None
    request: str | None = None


@dataclass(frozen=True)
class DeadLease:
    """An unsettled lease whose holder stopped heart-beating (:meth:`Gate.dead_holder_leases`).

    ``state``: ``live`` (within its deadline), ``overdue`` (past it) or
    ``poisoned`` (expired into the poison set). ``engine`` and ``request``
    say where to abort it (None when the admit did not say: such a lease
    cannot be aborted, only waited for). ``holder_deadline_ms``: when the
    holder's last heartbeat ran out (server clock); ``server_ms``: the
    server clock when it was listed.
    """

    lease_id: str
    sid: str
    holder: str
    version: int
    state: str
    engine: str | None
    request: str | None
    admitted_ms: int
    deadline_ms: int
    holder_deadline_ms: int
    server_ms: int


@dataclass(frozen=True)
class HealReport:
    """What :meth:`Gate.resolve_dead_holders` did.

    ``found``: the leases of dead holders it listed. ``settled``: the
    receipts of those it aborted at their engines and settled.
    ``unresolved``: ids of those whose abort was not confirmed (the engine
    did not answer, or the lease names no engine): left live (or poisoned),
    nothing settled. ``holder_back``: ids of those it aborted but did not
    settle because their holder heart-beat again meanwhile (its own to
    settle). ``dead_holders``: the dead holders listed, with or without leases.
    """

    found: tuple[DeadLease, ...] = ()
    settled: tuple[SettlementReceipt, ...] = ()
    unresolved: tuple[str, ...] = ()
    holder_back: tuple[str, ...] = ()
    dead_holders: tuple[str, ...] = ()
