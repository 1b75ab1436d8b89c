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

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from . import validate
from .context import Context, OpId, guarded, mutating
from .errors import (
    GatePoisoned,
    InvalidInput,
    NotDrained,
    OutcomeUnknown,
    StaleVersion,
    StateRolledBack,
    TracestoreError,
)
from .replies import Reply, field_map, stored, text
from .scripts import Batch, Cmd, Eval, Op, script
from .twin import AsyncPart, Body, Scoped, SyncPart, op, scoped
from .validate import duration_ms, int_in, one_of, validate_id, validate_ids

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


def _lease_id(lease: Lease | str) -> str:
    return validate_id("lease id", lease.id if isinstance(lease, Lease) else lease)


def _one(request: Eval) -> Op[Any]:
    """An operation of one request (to run it under :func:`~tracestore.context.guarded`)."""
    return (yield request)


# -- operations ------------------------------------------------------------------------------


@mutating
def admit(ctx: Context, sid: str, holder: str, ttl_s: float, *, op_id: str | None = None) -> Op[Lease]:
    """Admit a request of session ``sid`` served by ``holder``; return its :class:`Lease`.

    The lease carries the gate's current weight version and a deadline
    ``ttl_s`` seconds from now (server clock); past it, the lease is poisoned
    unless renewed or settled. Raises GateSealed (with ``retry_after_ms``)
    while a weight update holds the gate, SessionReleased when ``sid`` was
    released (a worker must not generate for it), StateRolledBack when the
    version is lower than one this store saw (the lease is settled
    ``aborted`` first, one more round trip), InvalidId/InvalidInput
    before any I/O, and OutcomeUnknown when the reply was lost: its
    ``lease_id`` is the lease's id, chosen before the call (the ``op_id``
    when given), so the caller can settle it, or call ``admit`` again with
    ``op_id=err.op_id`` to get the lease the first call admitted (else it
    admits now). One round trip.
    """
    validate_id("session id", sid)
    validate_id("holder", holder)
    ttl_ms = duration_ms("ttl_s", ttl_s)
    op = ctx.op(op_id, "admit")
    (lease,) = yield from _admit(ctx, [(sid, holder)], ttl_ms, op, [op.id])
    return lease


@mutating
def admit_many(
    ctx: Context, requests: Sequence[tuple[str, str]], ttl_s: float, *, op_id: str | None = None
) -> Op[list[Lease]]:
    """Admit several requests at once: all of them, or none while sealed.

    ``requests`` are ``(sid, holder)`` pairs, at most 1,000 per call (one
    atomic script, so a seal cannot split the batch). Every lease gets the
    gate's current version and the same deadline. Raises GateSealed or
    SessionReleased (nothing admitted), InvalidId/InvalidInput before any
    I/O, OutcomeUnknown (reply lost; ``lease_ids`` are the leases' ids:
    ``<op_id>#<i>`` for request ``i``; call again with ``op_id=err.op_id``
    to get them). One round trip for the whole batch; pair it with
    :func:`settle_many` to serve bursts of requests.
    """
    ttl_ms = duration_ms("ttl_s", ttl_s)
    sc = script("gate_admit_many")
    items = _requests(requests, sc.chunk)
    if not items:
        return []
    op = ctx.op(op_id, "admit")
    return (yield from _admit(ctx, items, ttl_ms, op, [op.part(i) for i in range(len(items))]))


def _requests(requests: object, most: int) -> list[tuple[str, str]]:
    """``admit_many``'s ``(sid, holder)`` pairs, validated (InvalidInput/InvalidId)."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise InvalidInput("requests", f"must be a list of (sid, holder) pairs, got {type(requests).__name__}")
    if len(requests) > most:
        raise InvalidInput("requests", f"at most {most} per call, got {len(requests)}")
    items = []
    for pair in requests:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise InvalidInput("requests", f"each request must be a (sid, holder) pair, got {pair!r:.80}")
        items.append((validate_id("session id", pair[0]), validate_id("holder", pair[1])))
    return items


def _admit(
    ctx: Context, items: Sequence[tuple[str, str]], ttl_ms: int, op: OpId, lids: list[str]
) -> Op[list[Lease]]:
    """Admit validated ``(sid, holder)`` pairs (1..1,000) as leases ``lids``, in one call.

    The lease ids are chosen before the call (a retry finds the first lease
    recorded and replays the admission); an error whose outcome is unknown
    carries them.
    """
    k = ctx.keys
    args: list[Any] = [ttl_ms]
    for lid, (sid, holder) in zip(lids, items, strict=True):
        args += (lid, sid, holder)
    call = Eval(
        script("gate_admit_many"),
        (k.gate, k.gate_leases, k.released, *(k.gate_lease(x) for x in lids)),
        tuple(args),
        op_id=op.id,
    )
    reply = yield from guarded(op, _one(call), lids)
    r = Reply(reply, "gate_admit_many")
    version, deadline = r.int(), r.int()
    try:
        ctx.fence.observe(version)
    except StateRolledBack:
        # The leases were admitted under a version older than one this client
        # saw: abort them (no request runs under them) so none poisons the gate.
        oid = ctx.op(None, "settle").id
        yield Batch(tuple(_settle_eval(ctx, lid, "aborted", oid) for lid in lids))
        raise
    return [Lease(lid, version, sid, deadline) for lid, (sid, _) in zip(lids, items, strict=True)]


@mutating
def renew(
    ctx: Context, lease: Lease | str, ttl_s: float | None = None, *, op_id: str | None = None
) -> Op[Lease]:
    """Move a live lease's deadline to ``ttl_s`` from now (default: its admission ttl).

    Raises UnknownLease, InvalidInput (already settled, bad ttl) and
    GatePoisoned when the lease already passed its deadline (it is not
    revived; settle it to resolve), OutcomeUnknown (call again with its
    ``op_id``: the first reply, the deadline not moved twice). One round trip.
    """
    lid = _lease_id(lease)
    ttl_ms = 0 if ttl_s is None else duration_ms("ttl_s", ttl_s)
    k = ctx.keys
    op = ctx.op(op_id, "renew")
    reply = yield Eval(
        script("gate_renew"),
        (k.gate_leases, k.gate_poison, k.gate_lease(lid), op.key),
        (lid, ttl_ms, ctx.op_ttl_ms),
        op_id=op.id,
    )
    r = Reply(reply, "gate_renew")
    lid, version, deadline = r.text(), r.int(), r.int()
    return Lease(lid, version, lease.sid if isinstance(lease, Lease) else "", deadline)


@mutating
def settle(
    ctx: Context, lease: Lease | str, outcome: str, *, op_id: str | None = None
) -> Op[SettlementReceipt]:
    """Settle a lease with ``outcome`` (completed, aborted, failed or unknown).

    ``unknown`` poisons the lease (install is refused until it is cleared);
    a definite outcome after the deadline resolves the lease's poison entry.
    Settling a settled lease returns its first receipt, unchanged. The
    settle that empties the live set wakes ``drain``. Raises InvalidInput
    (bad outcome) or InvalidId before I/O, UnknownLease for a lease never
    admitted (nothing changes), OutcomeUnknown (settle again: the lease's
    first receipt; ``op_id`` only names the call, the lease id is the
    idempotency key of a settlement). One round trip.
    """
    lid = _lease_id(lease)
    one_of("outcome", outcome, OUTCOMES)
    reply = yield _settle_eval(ctx, lid, outcome, ctx.op(op_id, "settle").id)
    return _receipt(reply)


@mutating
def settle_many(
    ctx: Context, leases: Sequence[Lease | str], outcome: str, *, op_id: str | None = None
) -> Op[list[SettlementReceipt]]:
    """Settle several leases with one ``outcome``; their receipts, in order.

    Each settlement is its own atomic script (as :func:`settle`), pipelined:
    one round trip per call. If some lease is unknown, every other one is
    still settled and the first error (UnknownLease) is raised afterwards;
    settling again returns the first receipts. InvalidId/InvalidInput before
    any I/O; OutcomeUnknown as :func:`settle`.
    """
    one_of("outcome", outcome, OUTCOMES)
    if isinstance(leases, (str, bytes)) or not isinstance(leases, Sequence):
        raise InvalidInput("leases", f"must be a list of leases or lease ids, got {type(leases).__name__}")
    lids = [_lease_id(x) for x in leases]
    if not lids:
        return []
    oid = ctx.op(op_id, "settle").id
    replies = yield Batch(tuple(_settle_eval(ctx, x, outcome, oid) for x in lids))
    return [_receipt(r) for r in replies]


def _settle_eval(ctx: Context, lid: str, outcome: str, op_id: str) -> Eval:
    k = ctx.keys
    return Eval(
        script("gate_settle"),
        (k.gate_leases, k.gate_poison, k.gate_signal, k.gate_lease(lid)),
        (lid, outcome, ctx.op_ttl_ms),
        op_id=op_id,
    )


def _receipt(reply: list[Any]) -> SettlementReceipt:
    r = Reply(reply, "gate_settle")
    return SettlementReceipt(
        lease_id=r.text(),
        outcome=r.text(),
        version=r.int(),
        settled_ms=r.int(),
        late=r.flag(),
        poisoned=r.flag(),
        replayed=not r.flag(),
    )


def _decode_status(reply: list[Any]) -> GateStatus:
    """Decode the status layout of ``gate_status`` / ``gate_seal`` (see lua/gate_status.lua)."""
    r = Reply(reply, "gate_status")
    state, version, sealed, installed = r.text(), r.int(), r.opt_int(), r.opt_int()
    now, live, nextd = r.int(), r.int(), r.opt_int()
    n_poison = r.int()
    poison: list[PoisonedLease] = []
    for _ in range(r.int()):
        lid, raw = r.text(), r.raw()
        try:
            info = orjson.loads(raw)
        except orjson.JSONDecodeError:
            info = {}
        poison.append(
            PoisonedLease(lid, str(info.get("reason", "?")), info.get("at_ms"), info.get("deadline_ms"))
        )
    n_overdue = r.int()
    for _ in range(r.int()):
        lid = r.text()
        poison.append(PoisonedLease(lid, "overdue", None, r.score()))
    return GateStatus(
        state=state,
        version=version,
        live=live,
        poisoned=n_poison + n_overdue,
        sealed_ms=sealed,
        installed_ms=installed,
        next_deadline_ms=nextd,
        server_ms=now,
        poison=tuple(poison[:MAX_IDS]),
    )


def _observed(ctx: Context, st: GateStatus) -> GateStatus:
    """``st``, once its version passed the store's fence (StateRolledBack if it went back)."""
    ctx.fence.observe(st.version)
    return st


def status(ctx: Context) -> Op[GateStatus]:
    """Read the gate: state, version, live leases, poison set (first 100). One round trip.

    Raises StateRolledBack when the version is lower than one this store saw.
    """
    k = ctx.keys
    reply = yield Eval(script("gate_status"), (k.gate, k.gate_leases, k.gate_poison), (MAX_IDS,))
    return _observed(ctx, _decode_status(reply))


def _seal_eval(
    ctx: Context, what: str, retry_after_ms: int, op: OpId, *, key: str, token: str = "", below: int | None = None
) -> Eval:
    k = ctx.keys
    return Eval(
        script("gate_seal"),
        (k.gate, k.gate_leases, k.gate_poison, key, k.gate_log),
        (what, retry_after_ms, MAX_IDS, token, ctx.op_ttl_ms, "" if below is None else below, LOG_ENTRIES),
        op_id=op.id,
    )


@mutating
def seal(
    ctx: Context, retry_after_ms: int = DEFAULT_RETRY_AFTER_MS, *, op_id: str | None = None
) -> Op[GateStatus]:
    """Seal the gate: from the moment this returns, every ``admit`` raises GateSealed.

    ``retry_after_ms`` is the hint refused admissions carry. Sealing a
    sealed gate keeps its seal time and hint; a weight update in progress
    then leaves the gate sealed when it ends (an operator's seal is never
    reopened by ``weight_update``). Returns the status right after sealing
    (StateRolledBack when its version is lower than one this store saw; the
    gate is sealed all the same). OutcomeUnknown: call again with its
    ``op_id`` (the first reply). One round trip (the script answers with
    the status it leaves).
    """
    int_in("retry_after_ms", retry_after_ms, 1, 3_600_000)
    op = ctx.op(op_id, "seal")
    reply = yield _seal_eval(ctx, "seal", retry_after_ms, op, key=op.key)
    return _observed(ctx, _decode_status(reply))


@mutating
def reopen(ctx: Context, *, op_id: str | None = None) -> Op[GateStatus]:
    """Reopen the gate (admissions resume, under the current version).

    Allowed in any state, whoever sealed; reopening an open gate changes
    nothing. StateRolledBack (after reopening) when the version is lower
    than one this store saw. OutcomeUnknown: call again with its ``op_id``
    (the first reply; a seal made since is not reopened by the retry). One
    round trip.
    """
    op = ctx.op(op_id, "reopen")
    reply = yield _seal_eval(ctx, "reopen", DEFAULT_RETRY_AFTER_MS, op, key=op.key)
    return _observed(ctx, _decode_status(reply))


def _seal_as(ctx: Context, op: OpId, version: int) -> Op[bool]:
    """Seal under token ``op.id`` unless ``version`` cannot be installed (StaleVersion, nothing written).

    True when this token holds the seal (False: an operator's seal).
    """
    reply = yield _seal_eval(
        ctx, "seal", DEFAULT_RETRY_AFTER_MS, op, key=op.key_of("seal"), token=op.id, below=version
    )
    return text(reply[-1]) == op.id  # the status layout, then the sealer's token


def _reopen_as(ctx: Context, op: OpId) -> Op[GateStatus]:
    """Reopen only a seal made under token ``op.id`` (another sealer's seal stays)."""
    reply = yield _seal_eval(
        ctx, "reopen", DEFAULT_RETRY_AFTER_MS, op, key=op.key_of("reopen"), token=op.id
    )
    return _decode_status(reply)


def drain(ctx: Context, timeout_s: float) -> Op[DrainResult]:
    """Wait until no lease is live or ``timeout_s`` passes; report what remains.

    No polling: when leases are live, drain blocks (BLPOP) on the gate's
    signal list, which the settle that empties the live set pushes to; it
    also wakes at the earliest lease deadline and moves overdue leases to the
    poison set (each check is one atomic script that also clears stale
    wake-up tokens, so a wake-up can be neither lost nor stale). Usually
    called after :func:`seal`; on an open gate it returns at the first moment
    nothing is live. Raises InvalidInput for a negative timeout,
    StateRolledBack when the gate's version is lower than one this store
    saw. Round trips:
    one check, plus one blocking read and one check per wake-up.
    """
    timeout_ms = duration_ms("timeout_s", timeout_s, allow_zero=True)
    k = ctx.keys
    check = Eval(
        script("gate_drain_check"), (k.gate, k.gate_leases, k.gate_poison, k.gate_signal), (MAX_IDS,)
    )
    start = time.monotonic()
    newly: list[str] = []
    while True:
        r = Reply((yield check), "gate_drain_check")
        state, version, live, wait_ms = r.text(), r.int(), r.int(), r.int()
        newly.extend(r.counted())
        n_poison = r.int()
        poison_ids = tuple(r.rest_texts())
        waited = time.monotonic() - start
        remaining = timeout_ms / 1000 - waited
        ctx.fence.observe(version)
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


@mutating
def install(ctx: Context, version: int, *, op_id: str | None = None) -> Op[int]:
    """Install weight ``version``; new leases carry it. Returns the previous version.

    Refused, changing nothing (overdue leases aside, which move to the
    poison set), unless the gate is sealed, no lease is live, nothing is
    poisoned and ``version`` is larger than the current one: raises
    StaleVersion, NotDrained or GatePoisoned. Among concurrent installers of
    one version exactly one succeeds. InvalidInput before I/O for a
    negative or non-integer version; OutcomeUnknown when the reply was lost
    (call again with its ``op_id``: the first reply, not StaleVersion).
    StateRolledBack when the version it replaced is lower than one this
    store saw: the install is done, over a rolled-back state
    (:func:`weight_update` checks before its body, when nothing is
    installed yet). One round trip.
    """
    validate.version("version", version)
    return (yield from _install(ctx, version, ctx.op(op_id, "install")))


def _install(ctx: Context, version: int, op: OpId) -> Op[int]:
    k = ctx.keys
    reply = yield Eval(
        script("gate_install"),
        (k.gate, k.gate_leases, k.gate_poison, op.key, k.gate_log),
        (version, ctx.op_ttl_ms, LOG_ENTRIES),
        op_id=op.id,
    )
    r = Reply(reply, "gate_install")
    installed, previous = r.int(), r.int()
    seen = ctx.fence.seen
    ctx.fence.observe(installed)
    if installed > seen and previous < seen:
        # this install replaced a version older than one seen: it ran over a rolled-back state
        # (a replayed reply of an install already seen, installed <= seen, is not checked)
        raise StateRolledBack("gate version", seen, previous)
    return previous


@mutating
def clear_poison(
    ctx: Context, lease_ids: Sequence[str], resolution: str, *, op_id: str | None = None
) -> Op[list[str]]:
    """Resolve poisoned leases by hand; returns the ids that were poisoned and now are not.

    ``resolution`` (1..200 printable characters, e.g. ``aborted`` or
    ``retried-by-operator``) is kept on each lease record for its
    retention. Overdue leases are moved to poison first, so they can be
    cleared in the same call; ids not poisoned are ignored. Raises InvalidId
    before I/O, OutcomeUnknown (call again with its ``op_id``: the first
    reply). One round trip per 2,000 ids.
    """
    ids = validate_ids("lease id", lease_ids)
    validate_id("resolution", resolution)
    if not ids:
        return []
    k = ctx.keys
    evals = ctx.op_evals(
        "gate_clear_poison",
        ids,
        lambda op_key, part: (k.gate_leases, k.gate_poison, op_key, *(k.gate_lease(x) for x in part)),
        lambda part: (ctx.op_ttl_ms, resolution, ctx.op_ttl_ms, *part),
        op=ctx.op(op_id, "clear"),
    )
    replies = yield Batch(tuple(evals))
    return [text(x) for r in replies for x in r]


def lease_records(ctx: Context, lease_ids: Sequence[str]) -> Op[list[LeaseRecord | None]]:
    """The stored record of each lease (None when unknown or expired). One round trip."""
    ids = validate_ids("lease id", lease_ids)
    if not ids:
        return []
    k = ctx.keys
    replies = yield Batch(tuple(Cmd(("HGETALL", k.gate_lease(x)), key=k.gate_lease(x)) for x in ids))
    out: list[LeaseRecord | None] = []
    for lid, raw in zip(ids, replies, strict=True):
        with stored(k.gate_lease(lid)):
            out.append(_lease_record(lid, {f: text(v) for f, v in field_map(raw).items()}))
    return out


def _lease_record(lid: str, h: dict[str, str]) -> LeaseRecord | None:
    """A lease hash (HGETALL, decoded) as its record; None when empty (ValueError when malformed)."""
    if not h:
        return None
    return LeaseRecord(
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


# -- the weight update protocol ---------------------------------------------------------------


def _check_drained(res: DrainResult, version: int) -> None:
    """Refuse to run a weight update body the install would refuse anyway."""
    if res.live:
        raise NotDrained(res.state, res.live)
    if res.poisoned:
        raise GatePoisoned(res.poisoned_ids or ("?",))
    if version <= res.version:
        raise StaleVersion(res.version, version)


def weight_update(ctx: Context, version: int, drain_timeout_s: float) -> Scoped[DrainResult]:
    """Seal, drain, run the body (push the weights), install ``version``, reopen.

    ``with store.gate.weight_update(8, drain_timeout_s=60) as drained:``
    (``async with`` on an async store). Before the body runs, the gate must
    drain within ``drain_timeout_s`` with nothing poisoned and ``version``
    must be larger than the current one; otherwise NotDrained, GatePoisoned
    or StaleVersion is raised and the body does not run (StateRolledBack
    too, when the gate's version is lower than one this store saw). If the body raises,
    the gate is reopened without installing and the error propagates. The
    gate is reopened in every case, unless an operator sealed it (``seal()``
    / ``tracestore gate seal``, before or during the update): that seal
    survives the weight update. A seal left by a crashed weight update is
    taken over and reopened. Run one weight update per run at a time (a
    second one would take over the first one's seal). Yields the
    :class:`DrainResult`. Validates ``version`` and the timeout before any I/O;
    the seal itself refuses a ``version`` not larger than the current one
    (StaleVersion, nothing sealed or written). If the install's reply is
    lost, OutcomeUnknown names its op id: ``gate.install(version,
    op_id=err.op_id)`` tells whether it happened (the first reply) or
    installs now (the body did push the weights).
    """
    validate.version("version", version)
    duration_ms("drain_timeout_s", drain_timeout_s, allow_zero=True)
    op = ctx.op(None, "install")  # its install is the one install(op_id=...) replays
    try:
        mine = yield from _seal_as(ctx, op, version)
    except OutcomeUnknown:
        # The seal may have happened (an unconfirmed or lost reply): undo it, so
        # that no admission waits for a weight update that is not running.
        with contextlib.suppress(TracestoreError):
            yield from _reopen_as(ctx, op)
        raise
    try:
        res = yield from drain(ctx, drain_timeout_s)
        _check_drained(res, version)
        yield Body(res)
        yield from guarded(op, _install(ctx, version, op))
    finally:
        if mine:
            yield from _reopen_as(ctx, op)


class GateMethods:
    """The gate's methods, listed once for :class:`Gate` and :class:`AsyncGate`.

    Each is the operation of this module of the same name; each costs the
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


__all__ = [
    "OUTCOMES",
    "AsyncGate",
    "DrainResult",
    "Gate",
    "GateMethods",
    "GateStatus",
    "Lease",
    "LeaseRecord",
    "PoisonedLease",
    "SettlementReceipt",
]
