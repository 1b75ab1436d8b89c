"""What put, take, expiry and the reads share: argument checks before any I/O, decoding of stored groups, and the keys of groups a script picks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .. import validate
from ..context import Context
from ..errors import CorruptData, InvalidInput, ScriptError
from ..replies import Reply, text
from ..scripts import Batch, Cmd, Eval, Op, script
from ..validate import int_in, one_of, validate_id, validate_ids
from .layout import priority_of
from .types import (
    _GROUP_FIELDS,
    MAX_ROUNDS,
    MAX_SIDS,
    MAX_TAKE,
    MAX_VERSION,
    STATUSES,
    STORED_STATUSES,
    Group,
)

# -- validation (before any I/O) ----------------------------------------------------------------


def _status(status: str, allowed: Sequence[str] = STATUSES) -> str:
    return one_of("status", status, allowed)


def _payload(ctx: Context, payload: object) -> bytes:
    if not isinstance(payload, dict):
        raise InvalidInput("payload", f"must be a JSON object (dict), got {type(payload).__name__}")
    try:
        data = orjson.dumps(payload)
    except TypeError as exc:
        raise InvalidInput("payload", f"not JSON-serialisable: {exc}") from None
    limit = ctx.config.replay_payload_bytes
    if len(data) > limit:
        raise InvalidInput(
            "payload",
            f"{len(data)} bytes of JSON exceed the limit of {limit} (StoreConfig.replay_payload_bytes); "
            "keep large data in the traces",
        )
    return data


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(name, f"must be a bool, got {value!r}")
    return value


def _cutoff(current_version: int | None, max_staleness: int | None) -> str:
    if max_staleness is None:
        return ""
    validate.version("max_staleness", max_staleness)
    if current_version is None:
        raise InvalidInput("current_version", "required when max_staleness is given")
    validate.version("current_version", current_version)
    return str(current_version - max_staleness)


def _n(n: object) -> int:
    return int_in("n", n, 0, MAX_TAKE)


@dataclass(frozen=True)
class _Checked:
    """A validated group of :func:`put`: its ids, payload bytes and given min_version."""

    gid: str
    task: str
    status: str
    sids: list[str]
    payload: bytes
    min_version: int | None
    #: ``payload["priority"]`` (the ``priority`` take policy), None when the payload has none.
    priority: float | None = None


def _check_group(ctx: Context, group: object, owner: str) -> _Checked:
    if not isinstance(group, Group):
        raise InvalidInput("group", f"must be a replay.Group, got {type(group).__name__}")
    gid = validate_id("group id", group.gid)
    task = validate_id("task", group.task)
    status = _status(group.status)
    sids = validate_ids("session id", group.sids)
    if not sids or len(sids) > MAX_SIDS:
        raise InvalidInput("sids", f"a group needs 1..{MAX_SIDS} sessions, got {len(sids)}")
    if len(set(sids)) != len(sids):
        raise InvalidInput("sids", f"duplicate session ids in group {gid!r}")
    minv = (
        None
        if group.min_version is None
        else int_in("min_version", group.min_version, 0, MAX_VERSION)
    )
    _flag("retryable", group.retryable)
    _flag("agentic", group.agentic)
    priority = priority_of(group.payload)  # first: an int too large for JSON is a bad priority
    payload = _payload(ctx, group.payload)
    validate_id("owner tag", owner)
    return _Checked(gid, task, status, sids, payload, minv, priority)


# -- decoding ---------------------------------------------------------------------------------------


def _group(gid: str, rec: Any, sids: Any, payload: Any) -> Group:
    """A group from its three fields: record (JSON object), sids and payload (JSON).

    ValueError/TypeError/KeyError when a field is not what put stores (the caller names the key).
    """
    loads = orjson.loads
    r = loads(rec)
    ids = loads(sids)
    body = loads(payload)
    if (
        type(ids) is not list
        or type(body) is not dict
        or r["status"] not in STORED_STATUSES
        or type(r["task"]) is not str
        or not all(type(x) is str for x in ids)
    ):
        raise ValueError("not the shape put stores")
    return Group(
        gid,
        r["task"],
        tuple(ids),
        r["status"],
        int(r["min_version"]),
        bool(r["retryable"]),
        body,
        bool(r["agentic"]),
        tuple(r["reroll"]),
        tuple(r["mv"]),
        int(r["seq"]),
    )


def _corrupt(
    ctx: Context, gid: str, rec: Any, sids: Any, payload: Any, exc: Exception
) -> CorruptData:
    """The CorruptData of a stored group the client cannot decode: which hash, the gid as the field."""
    k = ctx.keys
    checks = ((k.rb_groups, rec, dict), (k.rb_sids, sids, list), (k.rb_payloads, payload, dict))
    for key, value, kind in checks:
        try:
            if value is None or not isinstance(orjson.loads(value), kind):
                return CorruptData(key, f"not a JSON {kind.__name__}", gid)
        except orjson.JSONDecodeError as err:  # (a UnicodeDecodeError too)
            return CorruptData(key, f"{type(err).__name__}: {err}", gid)
    if not all(isinstance(x, str) for x in orjson.loads(sids)):
        return CorruptData(k.rb_sids, "not a list of session ids", gid)
    return CorruptData(k.rb_groups, f"{type(exc).__name__}: {exc}", gid)


def _groups_of(ctx: Context, rows: Sequence[tuple[str, Any, Any, Any]]) -> list[Group]:
    """Groups from ``(gid, record, sids, payload)`` rows; CorruptData naming the first malformed one."""
    try:
        return [_group(*row) for row in rows]
    except (ValueError, TypeError, KeyError):  # off the hot path: find the culprit
        for row in rows:
            try:
                _group(*row)
            except (ValueError, TypeError, KeyError) as err:
                raise _corrupt(ctx, *row, err) from None
        raise


def _decode_groups(ctx: Context, r: Reply) -> list[Group]:
    """A count ``m``, then ``m`` groups of :data:`_GROUP_FIELDS` fields: gid, record, sids, payload.

    The hot path of a take (512 groups are 2,048 items): one pass, no per-item cursor calls.
    The scripts hand out only groups that pass their decoding check (``lua/_lib/rb.lua``);
    CorruptData all the same if one does not decode.
    """
    m = r.int()
    items = r.take(_GROUP_FIELDS * m)
    return _groups_of(
        ctx,
        [
            (text(items[i]), items[i + 1], items[i + 2], items[i + 3])
            for i in range(0, _GROUP_FIELDS * m, _GROUP_FIELDS)
        ],
    )


def read_groups(ctx: Context, gids: Sequence[str]) -> Op[list[Group]]:
    """The stored groups ``gids`` (those still stored), in that order; one round trip.

    For inspection and checkpoints: O(len(gids)), three pipelined HMGETs.
    CorruptData (naming the hash and the gid) for a group that does not decode.
    """
    if not gids:
        return []
    k = ctx.keys
    recs, sids, pays = yield Batch(
        tuple(
            Cmd(("HMGET", key, *gids), key=key) for key in (k.rb_groups, k.rb_sids, k.rb_payloads)
        )
    )
    return _groups_of(
        ctx,
        [
            (g, rec, js, pay)
            for g, rec, js, pay in zip(gids, recs, sids, pays, strict=True)
            if rec is not None or js is not None or pay is not None
        ],
    )


# -- keys of the groups a script picks -------------------------------------------------------------


def _keyed_eval(
    ctx: Context,
    name: str,
    fixed_keys: tuple[str, ...],
    fixed_args: tuple[Any, ...],
    op_id: str,
    sids: Sequence[str] = (),
) -> Eval:
    """A call of a script that picks its groups inside Redis (``lua/_lib/rb.lua``).

    ARGV ends with the session key prefix (:attr:`~tracestore.keys.Keys.session_prefix`;
    empty with ``StoreConfig.replay_declared_keys``) and the declared
    session keys' sids, whose keys end KEYS.
    """
    k = ctx.keys
    prefix = "" if ctx.config.replay_declared_keys else k.session_prefix
    keys = fixed_keys + tuple(k.session(s) for s in sids)
    return Eval(script(name), keys, (*fixed_args, prefix, len(sids), *sids), op_id=op_id)


def _with_keys(
    ctx: Context, name: str, fixed_keys: tuple[str, ...], fixed_args: tuple[Any, ...], op_id: str
) -> Op[list[Any]]:
    """Call a script that picks its groups inside Redis; return its final (non-NEED) reply.

    In-script keys (the default): one call; the script appends the sids to
    the session key prefix. Declared keys (``StoreConfig.replay_declared_keys``):
    the sids a NEED reply names are accumulated and passed as the KEYS tail
    (their session keys). The op key of ``op_id`` is part of ``fixed_keys``:
    NEED replies are not recorded, so every round may carry the same op id,
    and a retried final round replays its reply.
    """
    sids: list[str] = []
    for _ in range(MAX_ROUNDS):
        reply = yield _keyed_eval(ctx, name, fixed_keys, fixed_args, op_id, sids)
        if text(reply[0]) != "NEED":
            return list(reply)
        new = [text(x) for x in reply[1:]]
        if len(sids) + len(new) > 3 * MAX_SIDS:
            sids = []  # stale names piled up under contention: start afresh
        sids = list(dict.fromkeys(sids + new))
    raise ScriptError(name, f"no stable plan after {MAX_ROUNDS} rounds (heavy contention)")
