"""Kept tokens of a turn a weight update stopped: what a continued generation resumes from.

When a weight update stops a generation (DESIGN section 15, ``--on-weight-update
continue``), the gateway keeps the ids it had generated, their logprobs and
the version of each, in the session's data slot (``ts:{R/sid}:part``, one
field per turn, named by the node id of the turn's prompt key). Once the gate
reopens the generation resumes from prompt + kept ids, and the turn is
recorded once, with per-token versions; the field is then dropped. Because the
tokens are in the store, a client that retries the same turn on another
gateway (the first one died holding it) resumes from them too.

Value layout (bytes, nothing pickled): ``b"p1,<input_len>,<kept_ms>,<n>\\n"``
then ``n`` int32 ids, ``n`` float32 logprobs and ``n`` int32 versions, little
endian. ``input_len`` is the length of the engine input the tokens followed
(a resume on another input is refused by the caller). With the routed experts
the kept tokens were generated with (:class:`KeptExperts`), the head is
``b"p2,<input_len>,<kept_ms>,<n>,<start>,<rows>,<row shape, x-separated>\\n"``
and the rows follow the versions as int32, little endian.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .. import codec, validate
from ..context import Context
from ..errors import CorruptData, InvalidInput
from ..scripts import Cmd, Eval, Op, script
from ..validate import duration_ms, validate_id
from .index import ID_HEX, node_id, utf8
from .reads import Rider, key_digest, lookup_riding
from .types import PrefixMatch

_HEAD = b"p1,"
_HEAD_EXPERTS = b"p2,"


@dataclass(frozen=True)
class KeptExperts:
    """The routed experts a kept turn was generated with: ``rows`` int32 rows of ``row_shape``
    (layers, top-k), little endian in ``data``, for the engine-input positions from ``start`` on
    (the turn's new prompt tokens and its kept ids; row ``i`` is the routing that produced
    token ``i``), so that a resume on any gateway records the routing of every token."""

    start: int
    rows: int
    row_shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class Partial:
    """Tokens kept of a stopped turn: ``ids``, one logprob and one weight version per id,
    the length of the engine input they followed, when they were kept (ms, server clock), and
    the routed experts they were generated with (None: none were kept)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    input_len: int
    kept_ms: int
    experts: KeptExperts | None = None


def _row_values(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _encode(p: Partial) -> bytes:
    n = len(p.ids)
    ids = codec.int32_array("partial.ids", p.ids, non_negative=True)
    lps = codec.float32_logprobs("partial.logprobs", p.logprobs)
    vs = array("i", (validate.version("partial.versions", v) for v in p.versions))
    if not (len(lps) == len(vs) == n):
        raise InvalidInput("partial", f"{n} ids, {len(lps)} logprobs, {len(vs)} versions")
    body = codec.pack(ids, lps, None, codec.VERSIONS, vs)
    e = p.experts
    if e is None:
        return _HEAD + f"{p.input_len},{p.kept_ms},{n}\n".encode() + body
    if e.start < 0 or e.rows < 0 or not e.row_shape or min(e.row_shape) < 1:
        raise InvalidInput("partial.experts", f"start {e.start}, {e.rows} rows of shape {e.row_shape}")
    if len(e.data) != 4 * e.rows * _row_values(e.row_shape):
        raise InvalidInput("partial.experts", f"{len(e.data)} bytes for {e.rows} int32 rows of shape {e.row_shape}")
    shape = "x".join(str(x) for x in e.row_shape)
    return _HEAD_EXPERTS + f"{p.input_len},{p.kept_ms},{n},{e.start},{e.rows},{shape}\n".encode() + body + e.data


def _decode(key: str, field: str, raw: bytes) -> Partial:
    try:
        head, body = raw.split(b"\n", 1)
        experts: KeptExperts | None = None
        if head.startswith(_HEAD):
            input_len, kept_ms, n = (int(x) for x in head[len(_HEAD) :].split(b","))
        elif head.startswith(_HEAD_EXPERTS):
            f = head[len(_HEAD_EXPERTS) :].split(b",")
            if len(f) != 6:
                raise ValueError("bad head")
            input_len, kept_ms, n, start, rows = (int(x) for x in f[:5])
            shape = tuple(int(x) for x in f[5].split(b"x"))
            size = codec.payload_size(n, codec.VERSIONS)
            data, body = body[size:], body[:size]
            if len(data) != 4 * rows * _row_values(shape) or min(shape, default=0) < 1:
                raise ValueError(f"{len(data)} bytes of routed experts for {rows} rows of {shape}")
            experts = KeptExperts(start, rows, shape, bytes(data))
        else:
            raise ValueError("unknown layout")
        p = codec.unpack(body, n, codec.VERSIONS)
    except (ValueError, InvalidInput) as exc:
        raise CorruptData(key, f"kept tokens do not decode ({exc})", field) from None
    assert p.versions is not None
    return Partial(p.token_ids, p.logprobs, p.versions, input_len, kept_ms, experts)


def keep_partial(
    ctx: Context,
    sid: str,
    key_text: str,
    ids: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    input_len: int,
    *,
    kept_ms: int = 0,
    ttl_s: float = 600.0,
    experts: KeptExperts | None = None,
) -> Op[None]:
    """Keep a stopped turn's tokens under its prompt key ``key_text`` (replacing what was kept),
    with the routed experts they were generated with when given.

    Raises InvalidId/InvalidInput before I/O; SessionReleased when the
    session's data was purged. Idempotent. One round trip.
    """
    validate_id("session id", sid)
    utf8("key_text", key_text)
    value = _encode(Partial(tuple(ids), tuple(logprobs), tuple(versions), int(input_len), int(kept_ms), experts))
    k = ctx.keys
    reply = yield Eval(
        script("session_field_keep"),
        (k.part(sid), k.dead(sid)),
        (sid, node_id(key_text), duration_ms("ttl_s", ttl_s), value),
    )
    del reply  # {}: the status was the whole reply
    return None


def read_partial(ctx: Context, sid: str, key_text: str) -> Op[Partial | None]:
    """The tokens kept of the turn whose prompt key is ``key_text``, or None. One round trip
    (pipelined with the turn's lookup when gathered with it). Raises CorruptData on a value
    that does not decode."""
    validate_id("session id", sid)
    field = node_id(key_text)
    k = ctx.keys
    raw = yield Cmd(("HGET", k.part(sid), field), key=k.part(sid))
    return None if raw is None else _decode(k.part(sid), field, bytes(raw))


def lookup_partial(
    ctx: Context, sid: str, key_text: str, digest: str | None = None
) -> Op[tuple[PrefixMatch, Partial | None]]:
    """:func:`~tracestore.traces.lookup` of ``key_text`` and :func:`read_partial` of the same key,
    in the lookup's round trip (1 warm, 2 cold: the kept tokens ride in its first script call).
    ``digest``: :func:`~tracestore.traces.key_digest` of ``key_text`` when the caller has it
    (else it is computed, from the session's cached continuation). Raises as both."""
    validate_id("session id", sid)
    k = ctx.keys
    rider = Rider(k.part(sid), (digest or key_digest(ctx, sid, key_text))[:ID_HEX])
    match = yield from lookup_riding(ctx, sid, key_text, rider)
    raw = rider.value
    return match, (None if raw is None else _decode(k.part(sid), rider.field, raw))


def drop_partial(ctx: Context, sid: str, key_text: str) -> Op[None]:
    """Forget the tokens kept of that turn (it was recorded, or given up). Idempotent; one round trip."""
    validate_id("session id", sid)
    k = ctx.keys
    yield Cmd(("HDEL", k.part(sid), node_id(key_text)), key=k.part(sid))
    return None


__all__ = ["KeptExperts", "Partial", "drop_partial", "keep_partial", "lookup_partial", "read_partial"]
