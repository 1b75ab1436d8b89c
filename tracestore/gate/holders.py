"""Lease holders that heal the gate: heartbeats, and the leases of holders that stopped.

A holder (a gateway process, a rollout worker) heart-beats its tag
(:func:`heartbeat`, the zset ``ts:{R}:gate:holders``, beside the owners'
heartbeats but apart from them: an owner that stops loses its sessions for
good, a holder that stops only has its unsettled leases resolved, and may
come back). The lease of a holder that heart-beats joins its holder's
entries in the held index ``ts:{R}:gate:held`` when admitted and leaves it
when first settled, so the leases of a holder are found without a scan
(heart-beat before the first admit: earlier leases are not indexed).

When a holder's heartbeat deadline passes (server clock), its leases are
resolved in two steps, because the first one needs an HTTP client the store
does not have:

1. :func:`dead_holder_leases` lists them with the engine and request id
   their admits recorded; the caller aborts each request at its engine;
2. :func:`settle_dead` settles the aborted ones ``aborted`` (resolution
   ``holder-dead``) in a script that checks the holder again: a holder that
   heart-beat in between (it came back) keeps its leases (HolderNotDead).

:func:`resolve_dead_holders` runs both with a caller's abort function (a
gateway passes its engines' aborts; ``tracestore gc`` an HTTP one,
:mod:`tracestore.gate.aborts`). Leases of a holder that never heart-beat
(older clients) are left to their deadlines, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..context import Context, mutating
from ..errors import HolderNotDead, InvalidInput, TracestoreError
from ..replies import Reply, field_map, stored, text
from ..scripts import Batch, Blocking, Cmd, Eval, Op, script
from ..validate import duration_ms, int_in, one_of, validate_id
from .leases import _lease_id, _receipt, _settle_eval
from .types import HOLDER_DEAD, DeadLease, HealReport, Lease, SettlementReceipt

#: Most leases one :func:`dead_holder_leases` lists (the next call lists the rest).
MAX_DEAD_LEASES = 1000
#: Outcomes a dead holder's lease may be settled with (the request was stopped, or failed).
DEAD_OUTCOMES = ("aborted", "failed")
#: The abort function of :func:`resolve_dead_holders`: given the dead holders' leases, the ids
#: of those whose requests are known to be stopped (aborted at their engine, or the engine gone).
Abort = Callable[[Sequence[DeadLease]], Iterable[str]]


@mutating
def heartbeat(ctx: Context, holder: str, ttl_s: float, *, op_id: str | None = None) -> Op[int]:
    """Record that lease holder ``holder`` is alive for ``ttl_s`` more seconds; returns the deadline (server ms).

    Once a holder has heart-beat, its unsettled leases can be resolved by
    anyone when a deadline passes without a new heartbeat
    (:func:`resolve_dead_holders`); heart-beat well within ``ttl_s`` (every
    third of it) and choose ``ttl_s`` longer than any pause of the process.
    A holder that comes back just heart-beats again: leases resolved
    meanwhile keep their receipts (its settle of one returns the
    ``holder-dead`` receipt), the others stay its own. Raises
    InvalidId/InvalidInput before I/O. Records no reply: calling again
    after an OutcomeUnknown only moves the deadline again. One round trip.
    """
    validate_id("holder", holder)
    ttl_ms = duration_ms("ttl_s", ttl_s)
    op = ctx.op(op_id, "heartbeat")
    reply = yield Eval(script("gate_heartbeat"), (ctx.keys.gate_holders,), (holder, ttl_ms), op_id=op.id)
    return Reply(reply, "gate_heartbeat").int()


@mutating
def holder_done(ctx: Context, holder: str, *, op_id: str | None = None) -> Op[bool]:
    """Say that ``holder`` stopped cleanly: drop its heartbeat entry. True when it is gone.

    Refused (False, heartbeat kept) while the holder has unsettled leases:
    if its process does not come back, they must stay resolvable. Raises
    InvalidId before I/O. Idempotent. One round trip.
    """
    validate_id("holder", holder)
    return (yield from _forget(ctx, holder, "", op_id))


def _forget(ctx: Context, holder: str, cutoff: str, op_id: str | None) -> Op[bool]:
    k = ctx.keys
    op = ctx.op(op_id, "holder")
    reply = yield Eval(script("gate_holder_done"), (k.gate_holders, k.gate_held), (holder, cutoff), op_id=op.id)
    return Reply(reply, "gate_holder_done").flag()  # gone (whether this call or an earlier one removed it)


def forget_dead_holders(ctx: Context, holders: Sequence[str], before_ms: int) -> Op[list[str]]:
    """Drop the heartbeat entries of ``holders`` whose deadline is before ``before_ms`` and that hold no lease.

    For ``gc``: holders long dead (a tag per process) leave nothing behind.
    Returns the holders dropped. One round trip.
    """
    if not holders:
        return []
    k = ctx.keys
    sc = script("gate_holder_done")
    oid = ctx.op(None, "holder").id  # (names the call in an error: the script records no reply)
    replies = yield Batch(tuple(Eval(sc, (k.gate_holders, k.gate_held), (h, before_ms), op_id=oid) for h in holders))
    return [h for h, r in zip(holders, replies, strict=True) if int(Reply(r, "gate_holder_done").take(2)[1])]


def dead_holders_and_leases(ctx: Context, limit: int = MAX_DEAD_LEASES) -> Op[tuple[list[str], list[DeadLease]]]:
    """(the dead holders, the unsettled leases they hold): :func:`dead_holder_leases` and who holds nothing."""
    int_in("limit", limit, 1, 100_000)
    k = ctx.keys
    reply = yield Eval(script("gate_dead_leases"), (k.gate_holders, k.gate_held, k.gate_leases, k.gate_poison), (limit,))
    r = Reply(reply, "gate_dead_leases")
    now, n = r.int(), r.int()
    holders: list[str] = []
    listed: list[tuple[str, str, int, str]] = []  # lease id, holder, holder deadline, state
    for _ in range(n):
        holder, hb = r.text(), r.int()
        holders.append(holder)
        for _ in range(r.int()):
            lid, state = r.text(), r.text()
            if state != "gone":
                listed.append((lid, holder, hb, state))
    if not listed:
        return holders, []
    records = yield Batch(tuple(Cmd(("HGETALL", k.gate_lease(x[0])), key=k.gate_lease(x[0])) for x in listed))
    out: list[DeadLease] = []
    for (lid, holder, hb, state), raw in zip(listed, records, strict=True):
        with stored(k.gate_lease(lid)):
            h = {f: text(v) for f, v in field_map(raw).items()}
            if not h or "outcome" in h:
                continue  # settled since the script looked
            out.append(
                DeadLease(
                    lease_id=lid,
                    sid=h.get("sid", ""),
                    holder=holder,
                    version=int(h.get("version", 0)),
                    state=state,
                    engine=h.get("engine"),
                    request=h.get("request"),
                    admitted_ms=int(h.get("admitted_ms", 0)),
                    deadline_ms=int(h.get("deadline_ms", 0)),
                    holder_deadline_ms=hb,
                    server_ms=now,
                )
            )
    return holders, out


def dead_holder_leases(ctx: Context, limit: int = MAX_DEAD_LEASES) -> Op[list[DeadLease]]:
    """The unsettled leases of holders whose heartbeat deadline passed (server clock).

    Each :class:`DeadLease` names its session, holder, state (``live``,
    ``overdue`` or ``poisoned``: expired meanwhile) and the ``engine`` and
    ``request`` its admit recorded: abort those requests at their engines,
    then :func:`settle_dead` the ones stopped. Holders that never heart-beat
    are not listed. At most ``limit`` leases (whole holders; call again for
    the rest once these are settled). Read-only (an observer may call it).
    InvalidInput for a bad limit. Two round trips (one when none is found).
    """
    _, leases = yield from dead_holders_and_leases(ctx, limit)
    return leases


@mutating
def settle_dead(
    ctx: Context,
    leases: Sequence[Lease | DeadLease | str],
    outcome: str = "aborted",
    *,
    resolution: str = HOLDER_DEAD,
    op_id: str | None = None,
) -> Op[list[SettlementReceipt | HolderNotDead]]:
    """Settle leases of dead holders (after their requests were stopped at their engines).

    Each settlement is the script of :func:`~tracestore.gate.leases.settle`
    in its ``dead`` mode: it settles a lease only when its holder's
    heartbeat deadline has passed at that moment (server clock), so a holder
    that heart-beat since :func:`dead_holder_leases` (it came back) keeps
    its lease, and so does a holder that never heart-beat: that lease's
    entry is a :class:`~tracestore.errors.HolderNotDead`, in place, nothing
    written. ``outcome``: ``aborted`` (default) or ``failed``;
    ``resolution`` is kept on each receipt (default ``holder-dead``). A
    lease settled already returns its first receipt; a poisoned (expired)
    one is resolved, as by a late settle. Returns one entry per lease, in
    order. InvalidId/InvalidInput before I/O; OutcomeUnknown when the
    reply was lost (call again: the receipts). One round trip.
    """
    one_of("outcome", outcome, DEAD_OUTCOMES)
    validate_id("resolution", resolution)
    if isinstance(leases, (str, bytes)) or not isinstance(leases, Sequence):
        raise InvalidInput("leases", f"must be a list of leases or lease ids, got {type(leases).__name__}")
    lids = [_lease_id(x.lease_id if isinstance(x, DeadLease) else x) for x in leases]
    if not lids:
        return []
    oid = ctx.op(op_id, "settle").id
    replies = yield Batch(
        tuple(_settle_eval(ctx, x, outcome, oid, mode="dead", resolution=resolution) for x in lids),
        errors_in_place=True,
    )
    out: list[SettlementReceipt | HolderNotDead] = []
    for r in replies:
        if isinstance(r, HolderNotDead):
            out.append(r)
        elif isinstance(r, TracestoreError):
            raise r
        else:
            out.append(_receipt(r))
    return out


def resolve_dead_holders(
    ctx: Context, abort: Abort, *, resolution: str = HOLDER_DEAD, limit: int = MAX_DEAD_LEASES
) -> Op[HealReport]:
    """Resolve the leases of dead holders: list them, stop their requests with ``abort``, settle those.

    ``abort(leases)`` gets every :class:`DeadLease` found and returns the ids
    of those whose requests are known to be stopped (aborted at their
    engines, or their engine gone); it runs in a worker thread on an
    asyncio store. Those are settled ``aborted`` with ``resolution`` by
    :func:`settle_dead` (a holder that came back meanwhile keeps its own);
    the others are left as they are (reported ``unresolved``): a lease whose
    request cannot be shown stopped is never settled. Returns a
    :class:`HealReport`. Safe to run from several processes at once (every
    settlement is a first-settlement-wins script). Round trips: two, plus
    one when something was aborted.
    """
    validate_id("resolution", resolution)
    holders, found = yield from dead_holders_and_leases(ctx, limit)
    if not found:
        return HealReport(dead_holders=tuple(holders))
    stopped = set((yield Blocking(lambda: set(abort(found)))))
    chosen = [d for d in found if d.lease_id in stopped]
    results: list[Any] = []
    if chosen:
        results = yield from settle_dead(ctx, chosen, "aborted", resolution=resolution)
    return HealReport(
        found=tuple(found),
        settled=tuple(r for r in results if isinstance(r, SettlementReceipt)),
        unresolved=tuple(d.lease_id for d in found if d.lease_id not in stopped),
        holder_back=tuple(r.lease_id for r in results if isinstance(r, HolderNotDead)),
        dead_holders=tuple(holders),
    )
