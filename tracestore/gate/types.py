"""The gate's value types and limits: leases, receipts, status, drain results, lease records."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    ``version`` is -1.
    """

    lease_id: str
    outcome: str
    version: int
    settled_ms: int
    late: bool
    poisoned: bool
    replayed: bool = field(default=False, compare=False)
    admitted: bool = True


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
    for live or poisoned leases.
    """

    drained: bool
    live: int
    poisoned: int
    poisoned_ids: tuple[str, ...]
    newly_poisoned: tuple[str, ...]
    state: str
    version: int
    waited_s: float

    @property
    def ok(self) -> bool:
        """True when drained and nothing is poisoned."""
        return self.drained and self.poisoned == 0


@dataclass(frozen=True)
class LeaseRecord:
    """The stored record of one lease (operators: who held a poisoned lease)."""

    lease_id: str
    sid: str
    holder: str
    version: int
    admitted_ms: int
    deadline_ms: int
    outcome: str | None
    settled_ms: int | None
    resolution: str | None
