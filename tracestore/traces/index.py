"""The session index as a trie (pure): digests of keys, the cached index snapshot, cache keys.

A node's id is the first 64 bits of ``blake2b-128(key UTF-8)``, as 16 hex
characters (:func:`hex_id`); the client hashes a text once,
from stored end to stored end, to find the longest stored key prefixing it
(:meth:`SessionIndex.match`). Index snapshots and node payloads are cached
in the store's :class:`~tracestore.nodecache.NodeCache` under the keys built
here.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any

from ..errors import CorruptData, InvalidInput
from ..nodecache import NodeCache
from ..replies import pairs, text
from .types import Node


def utf8(field_name: str, text: str) -> bytes:
    """``text`` as UTF-8; InvalidInput naming ``field_name`` when it is not a str or not encodable."""
    if not isinstance(text, str):
        raise InvalidInput(field_name, f"expected str, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            field_name, f"not valid UTF-8 text ({exc.reason} at {exc.start})"
        ) from None


def hasher() -> Any:
    """A fresh node-id hash (blake2b, 16-byte digest)."""
    return hashlib.blake2b(digest_size=16)


#: Hex characters of a node id: 64 bits. Per session, the chance that two of n
#: distinct keys share an id is below n**2 / 2**65 (2.7e-12 for 10,000 nodes);
#: docs/traces.md says what a collision would do.
ID_HEX = 16


def hex_id(h: Any) -> str:
    """The node id of a :func:`hasher` state: its digest's first :data:`ID_HEX` hex characters."""
    return str(h.hexdigest()[:ID_HEX])


def node_id(key_text: str) -> str:
    """The id of the node whose key is ``key_text``: blake2b-128 of its UTF-8, first 64 bits, hex."""
    h = hasher()
    h.update(utf8("key_text", key_text))
    return hex_id(h)


def parse_record(record: str) -> tuple[int, str, int | None, str]:
    """An ``idx`` record ``num.wid,parent_num,fields``: ``(num, wid, parent_num or None, fields)``.

    ``wid`` is '' in a record written before write ids (``num,parent_num,...``).
    ValueError when malformed.
    """
    head, pnum, fields = record.split(",", 2)
    num, _, wid = head.partition(".")
    n = int(num)
    if n < 1 or (pnum and int(pnum) < 1):
        raise ValueError("node numbers start at 1")
    if wid and (len(wid) != 8 or wid.strip("0123456789abcdef")):
        raise ValueError(f"write id {wid!r} is not 8 hex characters")
    return n, wid, (int(pnum) if pnum else None), fields


class SessionIndex:
    """Immutable snapshot of a session index at one version (cached per session).

    It is current while the server's index has the same ``epoch``,
    ``version`` and chain of write ids ``chain`` (``#e``, and ``#v`` =
    ``version.chain``): after a store rolled back, a version can come again
    for another index, its chain cannot (lua/_lib/nodes.lua).
    """

    __slots__ = ("epoch", "version", "chain", "nodes", "nums", "ends", "key", "_parents")

    def __init__(
        self, epoch: str, version: int, nodes: dict[str, Node], nums: dict[str, int], key: str = "",
        chain: str = "", ends: list[int] | None = None,
    ) -> None:
        self.epoch = epoch
        self.version = version
        self.chain = chain
        self.nodes = nodes
        self.nums = nums  # node id -> node number (its field in tok and txt), in this epoch
        # every distinct node end, ascending (``ends``: the caller computed them)
        self.ends = sorted({n.end for n in nodes.values()}) if ends is None else ends
        self.key = key  # the idx key it was read from (named by CorruptData)
        self._parents: frozenset[str | None] | None = None

    def has_child(self, node: Node | None) -> bool:
        """True when a stored node hangs under ``node`` (under the root for None)."""
        if self._parents is None:
            self._parents = frozenset(n.parent for n in self.nodes.values())
        return (node.id if node is not None else None) in self._parents

    @classmethod
    def from_pairs(
        cls, epoch: str, version: int, flat: Sequence[Any], key: str, chain: str = ""
    ) -> SessionIndex:
        """The snapshot of the ``idx`` hash ``key`` read as ``[field, value, ...]`` (``#`` fields skipped).

        Raises CorruptData naming ``key`` and the field when a record is malformed.
        """
        raw: list[tuple[str, int, str, int | None, str]] = []
        by_num: dict[int, str] = {}
        for f, v in pairs(flat):
            digest = "?"
            try:
                digest = text(f)
                if not digest.startswith("#"):
                    num, nwid, pnum, fields = parse_record(text(v))
                    if num in by_num:
                        raise ValueError(f"node number {num} is also node {by_num[num]}'s")
                    by_num[num] = digest
                    raw.append((digest, num, nwid, pnum, fields))
            except ValueError as exc:  # (UnicodeDecodeError too)
                raise CorruptData(key, f"malformed index record ({exc})", digest) from None
        nodes: dict[str, Node] = {}
        nums: dict[str, int] = {}
        for digest, num, nwid, pnum, fields in raw:
            # a parent number no node has: "#<num>", which path() reports as not stored
            parent = None if pnum is None else by_num.get(pnum, f"#{pnum}")
            try:
                nodes[digest] = Node.parse(digest, parent, fields, nwid)
            except ValueError as exc:
                raise CorruptData(key, f"malformed index record ({exc})", digest) from None
            nums[digest] = num
        return cls(epoch, version, nodes, nums, key, chain)

    def with_nodes(
        self, epoch: str, version: int, new: Sequence[tuple[Node, int]], chain: str
    ) -> SessionIndex:
        """A new snapshot at ``version``/``chain`` with ``new`` ``(node, number)`` pairs added (this one is never changed)."""
        nodes = dict(self.nodes)
        nums = dict(self.nums)
        ends = list(self.ends)
        for n, num in new:
            old = nodes.get(n.id)
            nodes[n.id] = n
            nums[n.id] = num
            if old is not None and old.end != n.end:  # (never: a node's id is its key's digest)
                ends = None  # type: ignore[assignment]
            elif ends is not None:
                i = bisect_left(ends, n.end)
                if i == len(ends) or ends[i] != n.end:
                    ends.insert(i, n.end)
        return SessionIndex(epoch, version, nodes, nums, self.key, chain, ends)

    @property
    def nbytes(self) -> int:
        """Approximate memory of the snapshot (its size in the cache)."""
        return 200 + 330 * len(self.nodes)

    def longest(self, text: str, field_name: str, *, limit: int | None = None) -> Node | None:
        """The node with the longest key that prefixes ``text`` (and ends <= ``limit``)."""
        return self.match(text, field_name, limit=limit)[0]

    def match(
        self,
        text: str,
        field_name: str,
        *,
        limit: int | None = None,
        encoded: bytes = b"",
        start: tuple[Node, Any] | None = None,
    ) -> tuple[Node | None, Any]:
        """:meth:`longest`, and the hash state at its end (None when nothing matched).

        One pass over ``text``: the hash state is advanced from end to end and
        copied at each stored end (no text is hashed twice). ``start``, a
        stored node whose key is known to prefix ``text`` and the hash state
        at its end, skips everything up to it: only ``text[start.end:]`` is
        hashed (the caller checked the key by comparison). ``encoded``, when
        the caller has it, is the hashed part of ``text`` (all of it, or
        ``text[start.end:]``) in UTF-8: an ASCII text (as many bytes as
        characters) is then hashed from it, without encoding it again.
        """
        n = len(text) if limit is None else min(limit, len(text))
        best: Node | None = None
        best_h: Any = None
        pos = 0
        h: Any = None
        if start is not None:
            best, best_h = start
            pos = best.end
            h = best_h.copy()
        else:
            h = hasher()
        base = pos
        raw = memoryview(encoded) if encoded and len(encoded) == len(text) - base else None
        ends = self.ends
        for i in range(bisect_right(ends, pos), len(ends)):
            end = ends[i]
            if end > n:
                break
            h.update(
                raw[pos - base : end - base] if raw is not None else utf8(field_name, text[pos:end])
            )
            pos = end
            at = h.copy()
            node = self.nodes.get(at.hexdigest()[:ID_HEX])
            if node is not None and node.end == end:
                best, best_h = node, at
        return best, best_h

    def path(self, node: Node | None) -> list[Node]:
        """The nodes from the root to ``node`` (empty for None).

        CorruptData (naming the idx key and the node) when a parent is not
        stored or the parents form a cycle.
        """
        out: list[Node] = []
        while node is not None:
            out.append(node)
            if node.parent and node.parent not in self.nodes:
                raise CorruptData(self.key or "session index", f"parent {node.parent} is not stored", node.id)
            node = self.nodes[node.parent] if node.parent else None
            if len(out) > len(self.nodes):
                raise CorruptData(self.key or "session index", "the parents form a cycle", out[-1].id)
        out.reverse()
        return out


def as_bytes(x: Any) -> bytes:
    """A reply item as bytes (payloads come back as bytes; anything else is encoded)."""
    return x if isinstance(x, bytes) else str(x).encode()


def idx_key(sid: str) -> tuple[str, str]:
    """Cache key of a session's index snapshot."""
    return ("idx", sid)


def tok_key(sid: str, epoch: str, node: Node) -> tuple[str, str, str, str, str]:
    """Cache key of a node's payload: valid for one data epoch of the session and the write that stored the node."""
    return ("tok", sid, epoch, node.id, node.wid)


def cache_payload(cache: NodeCache, sid: str, epoch: str, node: Node, data: bytes) -> None:
    """Cache the payload of ``node`` (immutable, so it never goes stale under its epoch and write id)."""
    cache.put(tok_key(sid, epoch, node), data, len(data) + 120)


__all__ = [
    "ID_HEX",
    "SessionIndex",
    "as_bytes",
    "cache_payload",
    "hasher",
    "hex_id",
    "idx_key",
    "node_id",
    "parse_record",
    "tok_key",
    "utf8",
]
