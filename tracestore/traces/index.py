"""The session index as a trie (pure): digests of keys, the cached index snapshot, cache keys.

A node's id is ``blake2b-128(key UTF-8)``; the client hashes a text once,
from stored end to stored end, to find the longest stored key prefixing it
(:meth:`SessionIndex.match`). Index snapshots and node payloads are cached
in the store's :class:`~tracestore.nodecache.NodeCache` under the keys built
here.
"""

from __future__ import annotations

import hashlib
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


def node_id(key_text: str) -> str:
    """The id of the node whose key is ``key_text``: blake2b-128 of its UTF-8, hex."""
    h = hasher()
    h.update(utf8("key_text", key_text))
    return str(h.hexdigest())


class SessionIndex:
    """Immutable snapshot of a session index at one version (cached per session)."""

    __slots__ = ("epoch", "version", "nodes", "ends", "key")

    def __init__(self, epoch: str, version: int, nodes: dict[str, Node], key: str = "") -> None:
        self.epoch = epoch
        self.version = version
        self.nodes = nodes
        self.ends = sorted({n.end for n in nodes.values()})
        self.key = key  # the idx key it was read from (named by CorruptData)

    @classmethod
    def from_pairs(cls, epoch: str, version: int, flat: Sequence[Any], key: str) -> SessionIndex:
        """The snapshot of the ``idx`` hash ``key`` read as ``[field, value, ...]`` (``#`` fields skipped).

        Raises CorruptData naming ``key`` and the field when a record is malformed.
        """
        nodes: dict[str, Node] = {}
        for f, v in pairs(flat):
            digest = "?"
            try:
                digest = text(f)
                if not digest.startswith("#"):
                    nodes[digest] = Node.parse(digest, text(v))
            except ValueError as exc:  # (UnicodeDecodeError too)
                raise CorruptData(key, f"malformed index record ({exc})", digest) from None
        return cls(epoch, version, nodes, key)

    def with_nodes(self, epoch: str, version: int, new: Sequence[Node]) -> SessionIndex:
        """A new snapshot with ``new`` nodes added (this one is never changed)."""
        nodes = dict(self.nodes)
        nodes.update((n.id, n) for n in new)
        return SessionIndex(epoch, version, nodes, self.key)

    @property
    def nbytes(self) -> int:
        """Approximate memory of the snapshot (its size in the cache)."""
        return 200 + 250 * len(self.nodes)

    def longest(self, text: str, field_name: str, *, limit: int | None = None) -> Node | None:
        """The node with the longest key that prefixes ``text`` (and ends <= ``limit``)."""
        return self.match(text, field_name, limit=limit)[0]

    def match(
        self, text: str, field_name: str, *, limit: int | None = None, encoded: bytes = b""
    ) -> tuple[Node | None, Any]:
        """:meth:`longest`, and the hash state at its end (None when nothing matched).

        One pass over ``text``: the hash state is advanced from end to end and
        copied at each stored end (no text is hashed twice). ``encoded``, when
        the caller has it, is ``text`` in UTF-8: an ASCII text (as many bytes
        as characters) is then hashed from it, without encoding it again.
        """
        n = len(text) if limit is None else min(limit, len(text))
        raw = memoryview(encoded) if encoded and len(encoded) == len(text) else None
        h = hasher()
        pos = 0
        best: Node | None = None
        best_h: Any = None
        for end in self.ends:
            if end > n:
                break
            h.update(raw[pos:end] if raw is not None else utf8(field_name, text[pos:end]))
            pos = end
            at = h.copy()
            node = self.nodes.get(at.hexdigest())
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


def tok_key(sid: str, epoch: str, digest: str) -> tuple[str, str, str, str]:
    """Cache key of a node payload (valid for one data epoch of the session)."""
    return ("tok", sid, epoch, digest)


def cache_payload(cache: NodeCache, sid: str, epoch: str, digest: str, data: bytes) -> None:
    """Cache the payload of node ``digest`` (immutable, so it never goes stale within its epoch)."""
    cache.put(tok_key(sid, epoch, digest), data, len(data) + 120)


__all__ = [
    "SessionIndex",
    "as_bytes",
    "cache_payload",
    "hasher",
    "idx_key",
    "node_id",
    "tok_key",
    "utf8",
]
