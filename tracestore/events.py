"""The release event stream as a holder reads it: its consumer group on ``ts:{R}:events``.

Operations (run them with ``store.run``) that :class:`tracestore.ray.RefHolder`
uses to learn which sessions were released; no Ray import, so a process
without Ray can read the stream the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from .context import Context
from .errors import TracestoreError
from .replies import field_map, text
from .scripts import Cmd, Op


def _entries(reply: Any) -> list[tuple[str, dict[str, str]]]:
    """Entries of an XREADGROUP reply (raw RESP2 list or RESP3 map; None on timeout)."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else [(s[0], s[1]) for s in reply]
    out: list[tuple[str, dict[str, str]]] = []
    for _stream, entries in streams:
        for entry in entries or []:
            eid, fields = entry[0], entry[1]
            if fields is None:  # a pending entry trimmed from the stream meanwhile
                out.append((text(eid), {}))
                continue
            out.append((text(eid), {f: text(v) for f, v in field_map(fields).items()}))
    return out


def events_groups(ctx: Context) -> Op[set[str]]:
    """The consumer groups of ``ts:{R}:events`` (none when the stream does not exist). Two round trips."""
    k = ctx.keys.events
    exists = yield Cmd(("EXISTS", k), key=k)
    if not int(exists):
        return set()
    groups = yield Cmd(("XINFO", "GROUPS", k), key=k)
    return {text(field_map(g)["name"]) for g in groups}


def ensure_events_group(ctx: Context, name: str, consumer: str) -> Op[bool]:
    """Create group ``name`` (at the stream's end) and its ``consumer`` if missing; True if created.

    A consumer from the start, so gc sees the group as active even before it
    reads. Raises StorageError. Three or four round trips.
    """
    k = ctx.keys.events
    created = False
    if name not in (yield from events_groups(ctx)):
        try:
            yield Cmd(("XGROUP", "CREATE", k, name, "$", "MKSTREAM"), key=k)
            created = True
        except TracestoreError as exc:
            # Another process of the same holder name created it meanwhile.
            if not isinstance(exc.__cause__, ResponseError) or name not in (yield from events_groups(ctx)):
                raise
    yield Cmd(("XGROUP", "CREATECONSUMER", k, name, consumer), key=k)
    return created


def destroy_events_group(ctx: Context, name: str) -> Op[None]:
    """Remove consumer group ``name`` of ``ts:{R}:events``. One round trip."""
    k = ctx.keys.events
    yield Cmd(("XGROUP", "DESTROY", k, name), key=k)


def read_events(
    ctx: Context, name: str, consumer: str, start_id: str, count: int, block_s: float
) -> Op[list[tuple[str, dict[str, str]]]]:
    """Entries for ``consumer`` of group ``name``: its own pending ones from ``start_id``, or new ones (``>``).

    New entries are awaited up to ``block_s`` (XREADGROUP BLOCK, on a
    connection whose timeout allows it). One round trip.
    """
    k = ctx.keys.events
    args: tuple[Any, ...] = ("XREADGROUP", "GROUP", name, consumer, "COUNT", count)
    if start_id == ">":
        ms = max(1, int(block_s * 1000))
        reply = yield Cmd((*args, "BLOCK", ms, "STREAMS", k, ">"), key=k, block_s=block_s)
    else:
        reply = yield Cmd((*args, "STREAMS", k, start_id), key=k)
    return _entries(reply)


def ack_events(ctx: Context, name: str, ids: Sequence[str]) -> Op[None]:
    """Acknowledge entries ``ids`` for group ``name``. One round trip."""
    k = ctx.keys.events
    yield Cmd(("XACK", k, name, *ids), key=k)


__all__ = ["ack_events", "destroy_events_group", "ensure_events_group", "events_groups", "read_events"]
