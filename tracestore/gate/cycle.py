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
from ..replies import Reply, text
from ..scripts import Cmd, Eval, Op, script
from ..twin import Body, Scoped
from ..validate import duration_ms, int_in
from .types import (
    DEFAULT_RETRY_AFTER_MS,
    LOG_ENTRIES,
    MAX_BLOCK_S,
    MAX_IDS,
    DrainResult,
    GateStatus,
    PoisonedLease,
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
