"""The weight-update cycle of the gate: status, seal, drain, install, reopen, and ``weight_update``.

A weight update seals the gate (no new admission), drains it (waits until
every live lease is settled; no polling: it blocks on the signal list the
settle emptying the live set pushes to), installs the new version and
reopens. Each transition is one atomic script (``lua/gate_seal.lua``,
``gate_drain_check``, ``gate_install``, ``gate_status``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import orjson

from .. import validate
from ..context import Context, OpId, guarded, mutating
from ..errors import (
    GatePoisoned,
    NotDrained,
    OutcomeUnknown,
    StaleVersion,
    StateRolledBack,
    TracestoreError,
)
from ..replies import Reply, field_map, pairs, stored, text
from ..scripts import Batch, Cmd, Eval, Op, ServerTime, script
from ..twin import Body, Scoped
from ..validate import duration_ms, int_in
from .leases import lease_records
from .types import (
    DEAD_HOLDER_WAIT_S,
    DEFAULT_RETRY_AFTER_MS,
    LOG_ENTRIES,
    MAX_BLOCK_S,
    MAX_IDS,
    DrainResult,
    GateStatus,
    PoisonedLease,
    PoisonEntry,
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


def poisoned_leases(ctx: Context) -> Op[list[PoisonEntry]]:
    """Every poisoned lease (and every overdue one) with its record: session, holder, engine, request.

    What ``tracestore gate status`` prints, one line each. Read-only (an
    observer may call it; no script). Three round trips.
    """
    k = ctx.keys
    now = yield ServerTime(key=k.gate)
    poison, overdue = yield Batch(
        (
            Cmd(("HGETALL", k.gate_poison), key=k.gate_poison),
            Cmd(("ZRANGE", k.gate_leases, "-inf", f"({now}", "BYSCORE", "WITHSCORES"), key=k.gate_leases),
        )
    )
    found: list[tuple[str, str, int | None]] = []
    for lid, raw in field_map(poison).items():
        with stored(k.gate_poison, lid):
            info = orjson.loads(raw)
        reason = str(info.get("reason", "?"))
        since = info.get("at_ms") if reason == "unknown" else info.get("deadline_ms", info.get("at_ms"))
        found.append((lid, reason, int(since) if isinstance(since, (int, float)) else None))
    found += [(text(lid), "overdue", int(float(score))) for lid, score in pairs(overdue)]
    if not found:
        return []
    records = yield from lease_records(ctx, [lid for lid, _, _ in found])
    return [
        PoisonEntry(lid, reason, since, now, *(
            (rec.sid, rec.holder or None, rec.engine, rec.request, rec.version) if rec else ()
        ))
        for (lid, reason, since), rec in zip(found, records, strict=True)
    ]


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
    ctx: Context,
    what: str,
    retry_after_ms: int,
    op: OpId,
    *,
    key: str,
    token: str = "",
    below: int | None = None,
    drain_ms: int | None = None,
) -> Eval:
    k = ctx.keys
    return Eval(
        script("gate_seal"),
        (k.gate, k.gate_leases, k.gate_poison, key, k.gate_log),
        (what, retry_after_ms, MAX_IDS, token, ctx.op_ttl_ms, "" if below is None else below, LOG_ENTRIES,
         "" if drain_ms is None else drain_ms),
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


def _seal_as(ctx: Context, op: OpId, version: int, drain_ms: int | None = None) -> Op[bool]:
    """Seal under token ``op.id`` unless ``version`` cannot be installed (StaleVersion or
    GatePoisoned, nothing written); ``drain_ms``: the drain timeout (the retry hint's bound).

    True when this token holds the seal (False: an operator's seal).
    """
    reply = yield _seal_eval(
        ctx, "seal", DEFAULT_RETRY_AFTER_MS, op, key=op.key_of("seal"), token=op.id, below=version,
        drain_ms=drain_ms,
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
    nothing is live. The result also counts the live leases held by holders
    whose heartbeat stopped (``dead_held``). Raises InvalidInput for a
    negative timeout, StateRolledBack when the gate's version is lower than
    one this store saw. Round trips: one check, plus one blocking read and
    one check per wake-up.
    """
    timeout_ms = duration_ms("timeout_s", timeout_s, allow_zero=True)
    return (yield from _drain(ctx, timeout_ms, None))


def _drain(ctx: Context, timeout_ms: int, give_up_s: float | None) -> Op[DrainResult]:
    """:func:`drain`; with ``give_up_s``, return early when the drain cannot succeed.

    That is when anything is poisoned (install would be refused whatever
    settles), or when every live lease has been held by a dead holder for
    ``give_up_s`` (nobody but a resolver will settle them). While some are,
    it re-checks at least every ``give_up_s``.
    """
    k = ctx.keys
    check = Eval(
        script("gate_drain_check"),
        (k.gate, k.gate_leases, k.gate_poison, k.gate_signal, k.gate_holders, k.gate_held),
        (MAX_IDS,),
    )
    start = time.monotonic()
    newly: list[str] = []
    stuck_since: float | None = None
    while True:
        r = Reply((yield check), "gate_drain_check")
        state, version, live, wait_ms = r.text(), r.int(), r.int(), r.int()
        newly.extend(r.counted())
        n_dead = r.int()
        dead_ids = tuple(r.counted())
        n_poison = r.int()
        poison_ids = tuple(r.rest_texts())
        now = time.monotonic()
        waited = now - start
        remaining = timeout_ms / 1000 - waited
        ctx.fence.observe(version)
        block = max(0.001, min(remaining, wait_ms / 1000, MAX_BLOCK_S))
        hopeless = False
        if give_up_s is not None:
            stuck_since = (stuck_since or now) if live and n_dead == live else None
            hopeless = n_poison > 0 or (stuck_since is not None and now - stuck_since >= give_up_s)
            if stuck_since is not None:
                block = max(0.001, min(block, give_up_s - (now - stuck_since)))
        if live == 0 or remaining <= 0 or hopeless:
            return DrainResult(
                drained=live == 0,
                live=live,
                poisoned=n_poison,
                poisoned_ids=poison_ids,
                newly_poisoned=tuple(newly),
                state=state,
                version=version,
                waited_s=waited,
                dead_held=n_dead,
                dead_held_ids=dead_ids,
            )
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

def _check_drained(res: DrainResult, version: int) -> None:
    """Refuse to run a weight update body the install would refuse anyway."""
    if res.poisoned:
        raise GatePoisoned(res.poisoned_ids or ("?",))
    if res.live:
        raise NotDrained(res.state, res.live, res.dead_held_ids, res.dead_held)
    if version <= res.version:
        raise StaleVersion(res.version, version)


def weight_update(
    ctx: Context, version: int, drain_timeout_s: float, *, dead_holder_wait_s: float = DEAD_HOLDER_WAIT_S
) -> Scoped[DrainResult]:
    """Seal, drain, run the body (push the weights), install ``version``, reopen.

    ``with store.gate.weight_update(8, drain_timeout_s=60) as drained:``
    (``async with`` on an async store). Before the body runs, the gate must
    drain within ``drain_timeout_s`` with nothing poisoned and ``version``
    must be larger than the current one; otherwise NotDrained, GatePoisoned
    or StaleVersion is raised and the body does not run (StateRolledBack
    too, when the gate's version is lower than one this store saw). A drain
    that cannot succeed does not hold the seal for its timeout: poison (a
    lease expired or settled ``unknown``) ends it at once with GatePoisoned
    naming the leases (and a gate already poisoned, or with overdue leases,
    is not sealed at all); live leases all held by holders whose heartbeat
    stopped end it after ``dead_holder_wait_s`` (time for a resolver,
    ``gate.resolve_dead_holders`` or ``tracestore gc``, to settle them) with
    NotDrained naming them. While sealed, refused admissions carry a retry
    hint from the last cycle's length and this drain's timeout
    (docs/gate.md, Retry hints). If the body raises, the gate is reopened
    without installing and the error propagates. The gate is reopened in
    every case, unless an operator sealed it (``seal()`` / ``tracestore
    gate seal``, before or during the update): that seal survives the weight
    update. A seal left by a crashed weight update is taken over and
    reopened. Run one weight update per run at a time (a second one would
    take over the first one's seal). Yields the :class:`DrainResult`.
    Validates ``version`` and the timeouts before any I/O; the seal itself
    refuses a ``version`` not larger than the current one (StaleVersion,
    nothing sealed or written). If the install's reply is lost,
    OutcomeUnknown names its op id: ``gate.install(version,
    op_id=err.op_id)`` tells whether it happened (the first reply) or
    installs now (the body did push the weights).
    """
    validate.version("version", version)
    timeout_ms = duration_ms("drain_timeout_s", drain_timeout_s, allow_zero=True)
    give_up_s = duration_ms("dead_holder_wait_s", dead_holder_wait_s, allow_zero=True) / 1000
    op = ctx.op(None, "install")  # its install is the one install(op_id=...) replays
    try:
        mine = yield from _seal_as(ctx, op, version, timeout_ms)
    except OutcomeUnknown:
        # The seal may have happened (an unconfirmed or lost reply): undo it, so
        # that no admission waits for a weight update that is not running.
        with contextlib.suppress(TracestoreError):
            yield from _reopen_as(ctx, op)
        raise
    try:
        res = yield from _drain(ctx, timeout_ms, give_up_s)
        _check_drained(res, version)
        yield Body(res)
        yield from guarded(op, _install(ctx, version, op))
    finally:
        if mine:
            yield from _reopen_as(ctx, op)
