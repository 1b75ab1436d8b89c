"""A lease's life: admit, renew, settle (one or many at once), its stored record, clearing its poison.

Every call is one atomic script on the run's control-plane slot
(``lua/gate_admit_many.lua``, ``gate_renew``, ``gate_settle``,
``gate_clear_poison``); a lease id is chosen before the call, so an admit
whose reply was lost can be settled or replayed by its id, and a settle
whose reply was lost can be sent again until it lands (the lease id is its
idempotency key: ``retry_until_s``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from ..context import Context, OpId, guarded, mutating
from ..errors import InvalidInput, OutcomeUnknown, ScriptError, StateRolledBack, StorageError
from ..replies import Reply, field_map, stored, text
from ..scripts import Batch, Blocking, Cmd, Eval, Op, script
from ..validate import MAX_DURATION_S, duration_ms, http_url, one_of, validate_id, validate_ids
from .types import MAX_ENGINE_URL, OUTCOMES, AdmitRequest, Lease, LeaseRecord, SettlementReceipt

#: What ``admit(..., on_unconfirmed=...)`` does when the admit's outcome is unknown.
ON_UNCONFIRMED = ("raise", "settle")
#: How long ``on_unconfirmed="settle"`` keeps sending its settle (s) before it gives up.
SETTLE_RETRY_S = 30.0
#: Backoff between the attempts of a settle sent again (``retry_until_s``): first and longest (s).
RETRY_FIRST_S = 0.05
RETRY_MOST_S = 1.0

# -- validation (before any I/O) --------------------------------------------------------------


def _lease_id(lease: Lease | str) -> str:
    return validate_id("lease id", lease.id if isinstance(lease, Lease) else lease)


def _one(request: Eval) -> Op[Any]:
    """An operation of one request (to run it under :func:`~tracestore.context.guarded`)."""
    return (yield request)


def _request(sid: str, holder: str, engine: str | None, request: str | None) -> AdmitRequest:
    """One admission, validated: ids (InvalidId), the engine URL and request id (InvalidInput/InvalidId)."""
    return AdmitRequest(
        validate_id("session id", sid),
        validate_id("holder", holder),
        None if engine is None else http_url("engine", engine, MAX_ENGINE_URL),
        None if request is None else validate_id("engine request id", request),
    )


def _requests(requests: object, most: int) -> list[AdmitRequest]:
    """``admit_many``'s requests (``(sid, holder)`` pairs or AdmitRequests), validated."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise InvalidInput("requests", f"must be a list of (sid, holder) pairs, got {type(requests).__name__}")
    if len(requests) > most:
        raise InvalidInput("requests", f"at most {most} per call, got {len(requests)}")
    items = []
    for r in requests:
        if isinstance(r, (str, bytes)) or not isinstance(r, Sequence) or not 2 <= len(r) <= 4:
            raise InvalidInput(
                "requests", f"each request must be a (sid, holder[, engine, request]) tuple, got {r!r:.80}"
            )
        items.append(_request(*r, *(None,) * (4 - len(r))))
    return items


def _retry_s(retry_until_s: float | None) -> float | None:
    if retry_until_s is None:
        return None
    return duration_ms("retry_until_s", retry_until_s, allow_zero=True) / 1000


# -- operations ------------------------------------------------------------------------------


@mutating
def admit(
    ctx: Context,
    sid: str,
    holder: str,
    ttl_s: float,
    *,
    engine: str | None = None,
    request: str | None = None,
    on_unconfirmed: str = "raise",
    op_id: str | None = None,
) -> Op[Lease]:
    """Admit a request of session ``sid`` served by ``holder``; return its :class:`Lease`.

    The lease carries the gate's current weight version and a deadline
    ``ttl_s`` seconds from now (server clock); past it, the lease is poisoned
    unless renewed or settled. ``engine`` (the engine's base URL, http(s),
    at most 256 characters) and ``request`` (the engine's request id) are
    kept on the lease record, so that if ``holder`` stops heart-beating
    (:meth:`Gate.heartbeat`) anyone can abort the request at its engine and
    settle the lease (:meth:`Gate.resolve_dead_holders`). Raises GateSealed
    (with ``retry_after_ms``, the wait the seal is expected to last) while a
    weight update holds the gate, SessionReleased when ``sid`` was released
    (a worker must not generate for it), StateRolledBack when the version
    is lower than one this store saw (the lease is settled ``aborted``
    first, one more round trip), InvalidId/InvalidInput before any I/O, and
    OutcomeUnknown when the reply was lost or not confirmed at the store's
    durability (DurabilityUnconfirmed): its ``lease_id`` is the lease's id,
    chosen before the call (the ``op_id`` when given), so the caller can
    settle it (whether the admit ran or not: a lease never admitted is
    fenced by its settle), or call ``admit`` again with ``op_id=err.op_id``
    to get the lease the first call admitted (else it admits now). With
    ``on_unconfirmed="settle"`` the admit does that settle itself (``aborted``,
    sent again until it lands, for up to 30 s) before it raises: the error's
    ``leases_settled`` says whether it landed; no lease is left to expire
    into poison. LeaseFenced when that lease id was settled before it was
    admitted (nothing admitted). One round trip (more when settling).
    """
    item = _request(sid, holder, engine, request)
    ttl_ms = duration_ms("ttl_s", ttl_s)
    one_of("on_unconfirmed", on_unconfirmed, ON_UNCONFIRMED)
    op = ctx.op(op_id, "admit")
    (lease,) = yield from _admit(ctx, [item], ttl_ms, op, [op.id], on_unconfirmed)
    return lease


@mutating
def admit_many(
    ctx: Context,
    requests: Sequence[tuple[str, str] | AdmitRequest],
    ttl_s: float,
    *,
    on_unconfirmed: str = "raise",
    op_id: str | None = None,
) -> Op[list[Lease]]:
    """Admit several requests at once: all of them, or none while sealed.

    ``requests`` are ``(sid, holder)`` pairs or :class:`AdmitRequest`
    (``(sid, holder, engine, request)``: see :func:`admit`), at most 1,000
    per call (one atomic script, so a seal cannot split the batch). Every
    lease gets the gate's current version and the same deadline. Raises
    GateSealed or SessionReleased or LeaseFenced (one of the lease ids was
    settled before it was admitted; nothing admitted), InvalidId/InvalidInput
    before any I/O, OutcomeUnknown (reply lost or unconfirmed; ``lease_ids``
    are the leases' ids: ``<op_id>#<i>`` for request ``i``; settle them, or
    call again with ``op_id=err.op_id`` to get them; ``on_unconfirmed`` as
    :func:`admit`). One round trip for the whole batch; pair it with
    :func:`settle_many` to serve bursts of requests.
    """
    ttl_ms = duration_ms("ttl_s", ttl_s)
    one_of("on_unconfirmed", on_unconfirmed, ON_UNCONFIRMED)
    sc = script("gate_admit_many")
    items = _requests(requests, sc.chunk)
    if not items:
        return []
    op = ctx.op(op_id, "admit")
    return (yield from _admit(ctx, items, ttl_ms, op, [op.part(i) for i in range(len(items))], on_unconfirmed))


def _admit(
    ctx: Context, items: Sequence[AdmitRequest], ttl_ms: int, op: OpId, lids: list[str], on_unconfirmed: str
) -> Op[list[Lease]]:
    """Admit validated requests (1..1,000) as leases ``lids``, in one call.

    The lease ids are chosen before the call (a retry finds the first lease
    recorded and replays the admission); an error whose outcome is unknown
    carries them, and with ``on_unconfirmed="settle"`` they are settled
    ``aborted`` before it is raised.
    """
    k = ctx.keys
    args: list[Any] = [ttl_ms]
    for lid, it in zip(lids, items, strict=True):
        args += (lid, it.sid, it.holder, it.engine or "", it.request or "")
    call = Eval(
        script("gate_admit_many"),
        (k.gate, k.gate_leases, k.released, k.gate_held, k.gate_holders, *(k.gate_lease(x) for x in lids)),
        tuple(args),
        op_id=op.id,
    )
    try:
        reply = yield from guarded(op, _one(call), lids)
    except OutcomeUnknown as err:
        if on_unconfirmed == "settle":
            oid = ctx.op(None, "settle").id
            try:
                yield from _settled(ctx, lids, "aborted", oid, "", SETTLE_RETRY_S)
                err.leases_settled = True
            except StorageError:
                err.leases_settled = False  # gave up: the error names the lease ids to settle
        raise
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
    return [Lease(lid, version, it.sid, deadline) for lid, it in zip(lids, items, strict=True)]


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
    ctx: Context,
    lease: Lease | str,
    outcome: str,
    *,
    resolution: str | None = None,
    retry_until_s: float | None = None,
    op_id: str | None = None,
) -> Op[SettlementReceipt]:
    """Settle a lease with ``outcome`` (completed, aborted, failed or unknown).

    ``unknown`` poisons the lease (install is refused until it is cleared);
    a definite outcome after the deadline resolves the lease's poison entry.
    Settling a settled lease returns its first receipt, unchanged. The
    settle that empties the live set wakes ``drain``. A lease id the server
    never admitted (an admit whose reply was lost and which never ran; or
    one whose receipt expired) is *fenced*: the receipt says
    ``admitted=False`` (``version`` -1), and an admit with that id is
    refused (LeaseFenced) for the receipt retention (``op_ttl_s``), so the
    lost admit cannot arrive later and leave a lease nobody serves; nothing
    else changes. ``resolution`` (an id: 1..200 printable characters, e.g.
    ``engine-restarted``) is kept on the receipt. ``retry_until_s``: when the
    settle fails with a StorageError (a lost reply, a failover, a durability
    wait not confirmed), send it again, with backoff (50 ms doubling to 1 s),
    until it lands or that many seconds passed; then raise the last error.
    Raises InvalidInput (bad outcome) or InvalidId before I/O,
    OutcomeUnknown (settle again: the lease's first receipt; ``op_id`` only
    names the call, the lease id is the idempotency key of a settlement).
    One round trip per attempt.
    """
    lid = _lease_id(lease)
    one_of("outcome", outcome, OUTCOMES)
    note = "" if resolution is None else validate_id("resolution", resolution)
    until = _retry_s(retry_until_s)
    (receipt,) = yield from _settled(ctx, [lid], outcome, ctx.op(op_id, "settle").id, note, until)
    return receipt


@mutating
def settle_many(
    ctx: Context,
    leases: Sequence[Lease | str],
    outcome: str,
    *,
    resolution: str | None = None,
    retry_until_s: float | None = None,
    op_id: str | None = None,
) -> Op[list[SettlementReceipt]]:
    """Settle several leases with one ``outcome``; their receipts, in order.

    Each settlement is its own atomic script (as :func:`settle`), pipelined:
    one round trip per call; a lease never admitted is fenced (as
    :func:`settle`). Settling again returns the first receipts.
    ``resolution`` and ``retry_until_s`` as :func:`settle` (the whole batch
    is sent again: the settled ones replay their receipts). Use
    ``retry_until_s`` where a lost settle would leave a lease to expire into
    poison (a gateway during a failover of the run's primary).
    InvalidId/InvalidInput before any I/O; OutcomeUnknown as :func:`settle`.
    """
    one_of("outcome", outcome, OUTCOMES)
    if isinstance(leases, (str, bytes)) or not isinstance(leases, Sequence):
        raise InvalidInput("leases", f"must be a list of leases or lease ids, got {type(leases).__name__}")
    lids = [_lease_id(x) for x in leases]
    note = "" if resolution is None else validate_id("resolution", resolution)
    until = _retry_s(retry_until_s)
    if not lids:
        return []
    return (yield from _settled(ctx, lids, outcome, ctx.op(op_id, "settle").id, note, until))


def _settled(
    ctx: Context, lids: Sequence[str], outcome: str, op_id: str, resolution: str, until_s: float | None
) -> Op[list[SettlementReceipt]]:
    """Settle ``lids`` (validated) in one round trip; with ``until_s``, again on StorageError until then."""
    evals = tuple(_settle_eval(ctx, x, outcome, op_id, resolution=resolution) for x in lids)
    req: Eval | Batch = evals[0] if len(evals) == 1 else Batch(evals)
    deadline = None if until_s is None else time.monotonic() + min(until_s, MAX_DURATION_S)
    delay = RETRY_FIRST_S
    while True:
        try:
            reply = yield req
            return [_receipt(reply)] if isinstance(req, Eval) else [_receipt(r) for r in reply]
        except StorageError as exc:
            if isinstance(exc, ScriptError) or deadline is None or time.monotonic() + delay > deadline:
                raise
        yield Blocking(functools.partial(time.sleep, delay))
        delay = min(2 * delay, RETRY_MOST_S)


def _settle_eval(ctx: Context, lid: str, outcome: str, op_id: str, *, mode: str = "", resolution: str = "") -> Eval:
    k = ctx.keys
    return Eval(
        script("gate_settle"),
        (k.gate_leases, k.gate_poison, k.gate_signal, k.gate_lease(lid), k.gate_holders, k.gate_held),
        (lid, outcome, ctx.op_ttl_ms, mode, resolution),
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
        admitted=r.flag(),
        resolution=r.text() or None,
    )


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
        lambda op_key, part: (k.gate_leases, k.gate_poison, op_key, k.gate_held, *(k.gate_lease(x) for x in part)),
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
            out.append(lease_record(lid, {f: text(v) for f, v in field_map(raw).items()}))
    return out


def lease_record(lid: str, h: dict[str, str]) -> LeaseRecord | None:
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
        engine=h.get("engine"),
        request=h.get("request"),
    )
