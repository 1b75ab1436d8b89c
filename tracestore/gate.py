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
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from ._io import async_op, sync_op
from .context import Context
from .errors import GatePoisoned, InvalidInput, NotDrained, StaleVersion
from .keys import validate_id, validate_ids
from .scripts import Batch, Cmd, Eval, Op, chunks, new_op_id, script

if TYPE_CHECKING:
    from ._io import AsyncIO, SyncIO

#: Outcomes a lease can be settled with; ``unknown`` poisons the lease.
OUTCOMES = ("completed", "aborted", "failed", "unknown")
#: Default retry hint given to admissions refused while the gate is sealed.
DEFAULT_RETRY_AFTER_MS = 500
#: Longest single blocking wait of ``drain`` (it re-checks the gate, then blocks
#: again); keeps a blocking read well under the client's socket timeout.
MAX_BLOCK_S = 5.0
#: How many poisoned lease ids a status or drain result carries.
MAX_IDS = 100


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
    """

    lease_id: str
    outcome: str
    version: int
    settled_ms: int
    late: bool
    poisoned: bool
    replayed: bool = field(default=False, compare=False)


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


# -- validation (before any I/O) --------------------------------------------------------------


def _ms(name: str, seconds: float, *, allow_zero: bool = False) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidInput(name, f"must be a number of seconds, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise InvalidInput(name, f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {seconds!r}")
    ms = round(seconds * 1000)
    if ms < 1 and not allow_zero:
        raise InvalidInput(name, f"must be at least 1 ms, got {seconds!r} s")
    if ms > 366 * 86_400_000:
        raise InvalidInput(name, f"must be at most a year, got {seconds!r} s")
    return ms


def _version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**53:
        raise InvalidInput("version", f"must be an integer in 0..2**53-1, got {version!r}")
    return version


def _lease_id(lease: Lease | str) -> str:
    return validate_id("lease id", lease.id if isinstance(lease, Lease) else lease)


def _outcome(outcome: str) -> str:
    if outcome not in OUTCOMES:
        raise InvalidInput("outcome", f"must be one of {', '.join(OUTCOMES)}; got {outcome!r}")
    return outcome


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _opt(x: Any) -> int | None:
    v = int(x)
    return None if v < 0 else v


# -- operations ------------------------------------------------------------------------------


def admit(ctx: Context, sid: str, holder: str, ttl_s: float) -> Op[Lease]:
    """Admit a request of session ``sid`` served by ``holder``; return its :class:`Lease`.

    The lease carries the gate's current weight version and a deadline
    ``ttl_s`` seconds from now (server clock); past it, the lease is poisoned
    unless renewed or settled. Raises GateSealed (with ``retry_after_ms``)
    while a weight update holds the gate, SessionReleased when ``sid`` was
    released (a worker must not generate for it), InvalidId/InvalidInput
    before any I/O. Idempotent under client retry (the lease id is made once per call).
    One round trip.
    """
    validate_id("session id", sid)
    validate_id("holder", holder)
    (lease,) = yield from _admit(ctx, [(sid, holder)], _ms("ttl_s", ttl_s))
    return lease


def admit_many(ctx: Context, requests: Sequence[tuple[str, str]], ttl_s: float) -> Op[list[Lease]]:
    """Admit several requests at once: all of them, or none while sealed.

    ``requests`` are ``(sid, holder)`` pairs, at most 1,000 per call (one
    atomic script, so a seal cannot split the batch). Every lease gets the
    gate's current version and the same deadline. Raises GateSealed or
    SessionReleased (nothing admitted), InvalidId/InvalidInput before any I/O. Idempotent under client
    retry. One round trip for the whole batch; pair it with
    :func:`settle_many` to serve bursts of requests.
    """
    ttl_ms = _ms("ttl_s", ttl_s)
    sc = script("gate_admit_many")
    if len(requests) > sc.chunk:
        raise InvalidInput("requests", f"at most {sc.chunk} per call, got {len(requests)}")
    items = [(validate_id("session id", sid), validate_id("holder", holder)) for sid, holder in requests]
    if not items:
        return []
    return (yield from _admit(ctx, items, ttl_ms))


def _admit(ctx: Context, items: Sequence[tuple[str, str]], ttl_ms: int) -> Op[list[Lease]]:
    """Admit validated ``(sid, holder)`` pairs (1..1,000) in one gate_admit_many call."""
    k = ctx.keys
    lids = [new_op_id() for _ in items]
    args: list[Any] = [ttl_ms]
    for lid, (sid, holder) in zip(lids, items, strict=True):
        args += (lid, sid, holder)
    reply = yield Eval(
        script("gate_admit_many"),
        (k.gate, k.gate_leases, k.released, *(k.gate_lease(x) for x in lids)),
        tuple(args),
    )
    version, deadline = int(reply[0]), int(reply[1])
    return [Lease(lid, version, sid, deadline) for lid, (sid, _) in zip(lids, items, strict=True)]


def renew(ctx: Context, lease: Lease | str, ttl_s: float | None = None) -> Op[Lease]:
    """Move a live lease's deadline to ``ttl_s`` from now (default: its admission ttl).

    Raises UnknownLease, InvalidInput (already settled, bad ttl) and
    GatePoisoned when the lease already passed its deadline (it is not
    revived; settle it to resolve). One round trip.
    """
    lid = _lease_id(lease)
    ttl_ms = 0 if ttl_s is None else _ms("ttl_s", ttl_s)
    k = ctx.keys
    reply = yield Eval(
        script("gate_renew"), (k.gate_leases, k.gate_poison, k.gate_lease(lid)), (lid, ttl_ms)
    )
    sid = lease.sid if isinstance(lease, Lease) else ""
    return Lease(_s(reply[0]), int(reply[1]), sid, int(reply[2]))


def settle(ctx: Context, lease: Lease | str, outcome: str) -> Op[SettlementReceipt]:
    """Settle a lease with ``outcome`` (completed, aborted, failed or unknown).

    ``unknown`` poisons the lease (install is refused until it is cleared);
    a definite outcome after the deadline resolves the lease's poison entry.
    Settling a settled lease returns its first receipt, unchanged. The
    settle that empties the live set wakes ``drain``. Raises InvalidInput
    (bad outcome) or InvalidId before I/O, UnknownLease for a lease never
    admitted (nothing changes). One round trip.
    """
    lid = _lease_id(lease)
    _outcome(outcome)
    k = ctx.keys
    reply = yield Eval(
        script("gate_settle"),
        (k.gate_leases, k.gate_poison, k.gate_signal, k.gate_lease(lid)),
        (lid, outcome, ctx.config.op_ttl_s * 1000),
    )
    return _receipt(reply)


def settle_many(ctx: Context, leases: Sequence[Lease | str], outcome: str) -> Op[list[SettlementReceipt]]:
    """Settle several leases with one ``outcome``; their receipts, in order.

    Each settlement is its own atomic script (as :func:`settle`), pipelined:
    one round trip per call. If some lease is unknown, every other one is
    still settled and the first error (UnknownLease) is raised afterwards;
    settling again returns the first receipts. InvalidId/InvalidInput before
    any I/O.
    """
    _outcome(outcome)
    lids = [_lease_id(x) for x in leases]
    if not lids:
        return []
    k = ctx.keys
    sc = script("gate_settle")
    retention = ctx.config.op_ttl_s * 1000
    replies = yield Batch(
        tuple(
            Eval(sc, (k.gate_leases, k.gate_poison, k.gate_signal, k.gate_lease(x)), (x, outcome, retention))
            for x in lids
        )
    )
    return [_receipt(r) for r in replies]


def _receipt(reply: list[Any]) -> SettlementReceipt:
    return SettlementReceipt(
        lease_id=_s(reply[0]),
        outcome=_s(reply[1]),
        version=int(reply[2]),
        settled_ms=int(reply[3]),
        late=bool(int(reply[4])),
        poisoned=bool(int(reply[5])),
        replayed=not int(reply[6]),
    )


def _decode_status(r: list[Any]) -> GateStatus:
    state, version, sealed, installed, now, live, nextd = (
        _s(r[0]), int(r[1]), _opt(r[2]), _opt(r[3]), int(r[4]), int(r[5]), _opt(r[6])
    )
    n_poison = int(r[7])
    shown = int(r[8])
    i = 9
    poison: list[PoisonedLease] = []
    for _ in range(shown):
        lid, raw = _s(r[i]), r[i + 1]
        i += 2
        try:
            info = orjson.loads(raw)
        except orjson.JSONDecodeError:
            info = {}
        poison.append(
            PoisonedLease(lid, str(info.get("reason", "?")), info.get("at_ms"), info.get("deadline_ms"))
        )
    n_overdue = int(r[i])
    shown_overdue = int(r[i + 1])
    i += 2
    for _ in range(shown_overdue):
        poison.append(PoisonedLease(_s(r[i]), "overdue", None, int(float(r[i + 1]))))
        i += 2
    return GateStatus(
        state=state,
        version=version,
        live=int(live),
        poisoned=n_poison + n_overdue,
        sealed_ms=sealed,
        installed_ms=installed,
        next_deadline_ms=nextd,
        server_ms=now,
        poison=tuple(poison[:MAX_IDS]),
    )


def status(ctx: Context) -> Op[GateStatus]:
    """Read the gate: state, version, live leases, poison set (first 100). One round trip."""
    k = ctx.keys
    reply = yield Eval(script("gate_status"), (k.gate, k.gate_leases, k.gate_poison), (MAX_IDS,))
    return _decode_status(reply)


def _seal_eval(ctx: Context, what: str, retry_after_ms: int, token: str = "") -> Eval:
    k = ctx.keys
    return Eval(
        script("gate_seal"),
        (k.gate, k.gate_leases, k.gate_poison),
        (what, retry_after_ms, MAX_IDS, token),
    )


def seal(ctx: Context, retry_after_ms: int = DEFAULT_RETRY_AFTER_MS) -> Op[GateStatus]:
    """Seal the gate: from the moment this returns, every ``admit`` raises GateSealed.

    ``retry_after_ms`` is the hint refused admissions carry. Sealing a
    sealed gate keeps its seal time and hint; a weight update in progress
    then leaves the gate sealed when it ends (an operator's seal is never
    reopened by ``weight_update``). Returns the status right after sealing.
    One round trip (the script answers with the status it leaves).
    """
    if isinstance(retry_after_ms, bool) or not isinstance(retry_after_ms, int) or not (
        0 < retry_after_ms <= 3_600_000
    ):
        raise InvalidInput("retry_after_ms", f"must be an int in 1..3600000, got {retry_after_ms!r}")
    reply = yield _seal_eval(ctx, "seal", retry_after_ms)
    return _decode_status(reply)


def reopen(ctx: Context) -> Op[GateStatus]:
    """Reopen the gate (admissions resume, under the current version).

    Allowed in any state, whoever sealed; reopening an open gate changes
    nothing. One round trip.
    """
    reply = yield _seal_eval(ctx, "reopen", DEFAULT_RETRY_AFTER_MS)
    return _decode_status(reply)


def _seal_as(ctx: Context, token: str) -> Op[bool]:
    """Seal under ``token``; True when this token holds the seal (False: an operator's seal)."""
    reply = yield _seal_eval(ctx, "seal", DEFAULT_RETRY_AFTER_MS, token)
    return _s(reply[-1]) == token


def _reopen_as(ctx: Context, token: str) -> Op[GateStatus]:
    """Reopen only a seal made under ``token`` (another sealer's seal stays)."""
    reply = yield _seal_eval(ctx, "reopen", DEFAULT_RETRY_AFTER_MS, token)
    return _decode_status(reply)


def drain(ctx: Context, timeout_s: float) -> Op[DrainResult]:
    """Wait until no lease is live or ``timeout_s`` passes; report what remains.

    No polling: when leases are live, drain blocks (BLPOP) on the gate's
    signal list, which the settle that empties the live set pushes to; it
    also wakes at the earliest lease deadline and moves overdue leases to the
    poison set (each check is one atomic script that also clears stale
    wake-up tokens, so a wake-up can be neither lost nor stale). Usually
    called after :func:`seal`; on an open gate it returns at the first moment
    nothing is live. Raises InvalidInput for a negative timeout. Round trips:
    one check, plus one blocking read and one check per wake-up.
    """
    timeout_ms = _ms("timeout_s", timeout_s, allow_zero=True)
    k = ctx.keys
    check = Eval(
        script("gate_drain_check"), (k.gate, k.gate_leases, k.gate_poison, k.gate_signal), (MAX_IDS,)
    )
    start = time.monotonic()
    newly: list[str] = []
    while True:
        r = yield check
        state, version, live, wait_ms = _s(r[0]), int(r[1]), int(r[2]), int(r[3])
        n_new = int(r[4])
        newly.extend(_s(x) for x in r[5 : 5 + n_new])
        n_poison = int(r[5 + n_new])
        poison_ids = tuple(_s(x) for x in r[6 + n_new :])
        waited = time.monotonic() - start
        remaining = timeout_ms / 1000 - waited
        if live == 0 or remaining <= 0:
            return DrainResult(
                drained=live == 0,
                live=live,
                poisoned=n_poison,
                poisoned_ids=poison_ids,
                newly_poisoned=tuple(newly),
                state=state,
                version=version,
                waited_s=waited,
            )
        block = max(0.001, min(remaining, wait_ms / 1000, MAX_BLOCK_S))
        yield Cmd(("BLPOP", k.gate_signal, f"{block:.3f}"), key=k.gate_signal, block_s=block)


def install(ctx: Context, version: int) -> Op[int]:
    """Install weight ``version``; new leases carry it. Returns the previous version.

    Refused, changing nothing (overdue leases aside, which move to the
    poison set), unless the gate is sealed, no lease is live, nothing is
    poisoned and ``version`` is larger than the current one: raises
    StaleVersion, NotDrained or GatePoisoned. Among concurrent installers of
    one version exactly one succeeds. Idempotent under client retry.
    InvalidInput before I/O for a negative or non-integer version.
    One round trip.
    """
    _version(version)
    k = ctx.keys
    op = new_op_id()
    reply = yield Eval(
        script("gate_install"),
        (k.gate, k.gate_leases, k.gate_poison, k.op(op)),
        (version, ctx.config.op_ttl_s * 1000),
    )
    return int(reply[1])


def clear_poison(ctx: Context, lease_ids: Sequence[str], resolution: str) -> Op[list[str]]:
    """Resolve poisoned leases by hand; returns the ids that were poisoned and now are not.

    ``resolution`` (1..200 printable characters, e.g. ``aborted`` or
    ``retried-by-operator``) is kept on each lease record for its
    retention. Overdue leases are moved to poison first, so they can be
    cleared in the same call; ids not poisoned are ignored. Raises InvalidId
    before I/O. Idempotent under client retry. One round trip per 2,000 ids.
    """
    ids = validate_ids("lease id", lease_ids)
    validate_id("resolution", resolution)
    if not ids:
        return []
    k = ctx.keys
    sc = script("gate_clear_poison")
    evals = []
    for part in chunks(ids, sc.chunk):
        op = new_op_id()
        evals.append(
            Eval(
                sc,
                (k.gate_leases, k.gate_poison, k.op(op), *(k.gate_lease(x) for x in part)),
                (ctx.config.op_ttl_s * 1000, resolution, ctx.config.op_ttl_s * 1000, *part),
            )
        )
    replies = yield Batch(tuple(evals))
    return [_s(x) for r in replies for x in r]


def lease_records(ctx: Context, lease_ids: Sequence[str]) -> Op[list[LeaseRecord | None]]:
    """The stored record of each lease (None when unknown or expired). One round trip."""
    ids = validate_ids("lease id", lease_ids)
    if not ids:
        return []
    k = ctx.keys
    replies = yield Batch(tuple(Cmd(("HGETALL", k.gate_lease(x)), key=k.gate_lease(x)) for x in ids))
    out: list[LeaseRecord | None] = []
    for lid, raw in zip(ids, replies, strict=True):
        h = {_s(a): _s(b) for a, b in (raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True))}
        if not h:
            out.append(None)
            continue
        out.append(
            LeaseRecord(
                lease_id=lid,
                sid=h.get("sid", ""),
                holder=h.get("holder", ""),
                version=int(h.get("version", 0)),
                admitted_ms=int(h.get("admitted_ms", 0)),
                deadline_ms=int(h.get("deadline_ms", 0)),
                outcome=h.get("outcome"),
                settled_ms=int(h["settled_ms"]) if "settled_ms" in h else None,
                resolution=h.get("resolution"),
            )
        )
    return out


# -- the weight update protocol ---------------------------------------------------------------


def _check_drained(res: DrainResult, version: int) -> None:
    """Refuse to run a weight update body the install would refuse anyway."""
    if res.live:
        raise NotDrained(res.state, res.live)
    if res.poisoned:
        raise GatePoisoned(res.poisoned_ids or ("?",))
    if version <= res.version:
        raise StaleVersion(res.version, version)


class Gate:
    """The request gate of a run (``store.gate``); see the module docstring.

    Methods are the operations of this module; each costs the round trips
    its docstring states.
    """

    def __init__(self, io: SyncIO, ctx: Context) -> None:
        self._io = io
        self._ctx = ctx

    admit = sync_op(admit)
    admit_many = sync_op(admit_many)
    renew = sync_op(renew)
    settle = sync_op(settle)
    settle_many = sync_op(settle_many)
    seal = sync_op(seal)
    drain = sync_op(drain)
    install = sync_op(install)
    reopen = sync_op(reopen)
    status = sync_op(status)
    clear_poison = sync_op(clear_poison)
    lease_records = sync_op(lease_records)

    @contextmanager
    def weight_update(self, version: int, drain_timeout_s: float) -> Iterator[DrainResult]:
        """Seal, drain, run the body (push the weights), install ``version``, reopen.

        Before the body runs, the gate must drain within ``drain_timeout_s``
        with nothing poisoned and ``version`` must be larger than the current
        one; otherwise NotDrained, GatePoisoned or StaleVersion is raised and
        the body does not run. If the body raises, the gate is reopened
        without installing and the error propagates. The gate is reopened in
        every case, unless an operator sealed it (``seal()`` /
        ``tracestore gate seal``, before or during the update): that seal
        survives the weight update. A seal left by a crashed weight update is
        taken over and reopened. Run one weight update per run at a time (a
        second one would take over the first one's seal). Yields the
        :class:`DrainResult`. Validates ``version`` and the timeout before any I/O.
        """
        _version(version)
        _ms("drain_timeout_s", drain_timeout_s, allow_zero=True)
        token = new_op_id()
        mine = self._io.run(_seal_as(self._ctx, token))
        try:
            res = self.drain(drain_timeout_s)
            _check_drained(res, version)
            yield res
            self.install(version)
        finally:
            if mine:
                self._io.run(_reopen_as(self._ctx, token))


class AsyncGate:
    """asyncio counterpart of :class:`Gate` (``AsyncTraceStore.gate``); same methods."""

    def __init__(self, io: AsyncIO, ctx: Context) -> None:
        self._io = io
        self._ctx = ctx

    admit = async_op(admit)
    admit_many = async_op(admit_many)
    renew = async_op(renew)
    settle = async_op(settle)
    settle_many = async_op(settle_many)
    seal = async_op(seal)
    drain = async_op(drain)
    install = async_op(install)
    reopen = async_op(reopen)
    status = async_op(status)
    clear_poison = async_op(clear_poison)
    lease_records = async_op(lease_records)

    @asynccontextmanager
    async def weight_update(self, version: int, drain_timeout_s: float) -> AsyncIterator[DrainResult]:
        """Async counterpart of :meth:`Gate.weight_update` (``async with``)."""
        _version(version)
        _ms("drain_timeout_s", drain_timeout_s, allow_zero=True)
        token = new_op_id()
        mine = await self._io.run(_seal_as(self._ctx, token))
        try:
            res = await self.drain(drain_timeout_s)
            _check_drained(res, version)
            yield res
            await self.install(version)
        finally:
            if mine:
                await self._io.run(_reopen_as(self._ctx, token))


__all__ = [
    "OUTCOMES",
    "AsyncGate",
    "DrainResult",
    "Gate",
    "GateStatus",
    "Lease",
    "LeaseRecord",
    "PoisonedLease",
    "SettlementReceipt",
]
