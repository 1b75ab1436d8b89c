"""The request gate: fence weight updates against in-flight generation (DESIGN section 6).

Every request an entrypoint serves holds a *lease* admitted under the gate's
current weight version (the fencing token its tokens record). A weight update
seals the gate (no new admission), drains it (waits until every live lease is
settled), installs the new version and reopens. A request whose outcome is
not known (its lease passed its deadline, or it was settled ``unknown``) is
*poisoned*: install is refused until a late settle or ``clear_poison``
resolves it, so weights never change under a request nobody accounted for.

State lives on the run's control-plane slot ``{R}`` and every transition is
one Lua script (``lua/gate_*.lua``); deadlines use the server clock.
``drain`` does not poll: it blocks on a list that the settle emptying the
live set pushes to, and wakes at the earliest lease deadline to expire it.

Use it through ``store.gate`` (:class:`Gate`, or :class:`AsyncGate` on an
:class:`~tracestore.store.AsyncTraceStore`)::

    lease = store.gate.admit(sid, holder="worker-3", ttl_s=120)
    ...  # generate, recording lease.version on each turn
    store.gate.settle(lease, "completed")

    with store.gate.weight_update(version=8, drain_timeout_s=60):
        push_weights_to_engines()

A holder that heart-beats (``store.gate.heartbeat(holder, ttl_s)``) and
records where each request runs (``admit(..., engine=URL, request=RID)``)
lets anyone resolve its leases when it dies: ``dead_holder_leases()`` lists
them, the caller aborts the requests at their engines, ``settle_dead(...)``
settles them (refused for a holder that came back);
``resolve_dead_holders(abort)`` does the three steps.

The package is split by job: :mod:`~tracestore.gate.types` (value types and
limits), :mod:`~tracestore.gate.leases` (admit, renew, settle, lease
records, clear_poison), :mod:`~tracestore.gate.holders` (heartbeats, the
leases of dead holders), :mod:`~tracestore.gate.aborts` (stopping their
requests at an engine over HTTP) and :mod:`~tracestore.gate.cycle`
(status, seal, drain, install, reopen, weight_update); this module binds
them as :class:`Gate` and :class:`AsyncGate`.
"""

from __future__ import annotations

from .. import validate
from ..context import Context
from ..twin import AsyncPart, OpBuilder, SyncPart, op, scoped
from .cycle import drain, install, poisoned_leases, reopen, seal, status, weight_update
from .holders import dead_holder_leases, heartbeat, holder_done, resolve_dead_holders, settle_dead
from .leases import admit, admit_many, clear_poison, lease_records, renew, settle, settle_many
from .types import (
    DEAD_HOLDER_WAIT_S,
    DEFAULT_RETRY_AFTER_MS,
    HOLDER_DEAD,
    LOG_ENTRIES,
    MAX_BLOCK_S,
    MAX_IDS,
    OUTCOMES,
    AdmitRequest,
    DeadLease,
    DrainResult,
    GateStatus,
    HealReport,
    Lease,
    LeaseRecord,
    PoisonedLease,
    PoisonEntry,
    SettlementReceipt,
)


class GateMethods:
    """The gate's methods, listed once for :class:`Gate` and :class:`AsyncGate`.

    Each is the operation of this package of the same name; each costs the
    round trips its docstring states.
    """

    admit = op(admit)
    admit_many = op(admit_many)
    renew = op(renew)
    settle = op(settle)
    settle_many = op(settle_many)
    seal = op(seal)
    drain = op(drain)
    install = op(install)
    reopen = op(reopen)
    status = op(status)
    clear_poison = op(clear_poison)
    lease_records = op(lease_records)
    poisoned_leases = op(poisoned_leases)
    heartbeat = op(heartbeat)
    holder_done = op(holder_done)
    dead_holder_leases = op(dead_holder_leases)
    settle_dead = op(settle_dead)
    resolve_dead_holders = op(resolve_dead_holders)
    weight_update = scoped(weight_update)

    _scope: Context

    @property
    def seen_version(self) -> int:
        """The highest gate version this store has seen (0 before any); no I/O."""
        return self._scope.fence.seen

    def fence(self, version: int) -> None:
        """Make ``version`` the highest gate version this store has seen; no I/O.

        From then on a reply with a lower version raises StateRolledBack.
        Lower it to accept a rolled-back state (``fence(err.found)`` after
        StateRolledBack); raise it in a process that knows the version its
        engines run (after a restart). InvalidInput for a negative or
        non-integer version.
        """
        self._scope.fence.reset(validate.version("version", version))


class Gate(GateMethods, SyncPart[Context]):
    """The request gate of a run (``store.gate``); see the module docstring."""


class AsyncGate(GateMethods, AsyncPart[Context]):
    """asyncio counterpart of :class:`Gate` (``AsyncTraceStore.gate``); same methods, as coroutines.

    ``weight_update`` is an async context manager (``async with``).
    """


class GateOps(GateMethods, OpBuilder[Context]):
    """The gate's operations built and not run (``store.ops.gate``): ``store.ops.gate.settle(lease, "completed")``."""


__all__ = [
    "DEAD_HOLDER_WAIT_S",
    "DEFAULT_RETRY_AFTER_MS",
    "HOLDER_DEAD",
    "MAX_BLOCK_S",
    "LOG_ENTRIES",
    "MAX_IDS",
    "OUTCOMES",
    "AdmitRequest",
    "AsyncGate",
    "DeadLease",
    "DrainResult",
    "Gate",
    "GateMethods",
    "GateOps",
    "GateStatus",
    "HealReport",
    "Lease",
    "LeaseRecord",
    "PoisonedLease",
    "PoisonEntry",
    "SettlementReceipt",
    "admit",
    "admit_many",
    "clear_poison",
    "dead_holder_leases",
    "drain",
    "heartbeat",
    "holder_done",
    "install",
    "lease_records",
    "poisoned_leases",
    "renew",
    "reopen",
    "resolve_dead_holders",
    "seal",
    "settle",
    "settle_dead",
    "settle_many",
    "status",
    "weight_update",
]
