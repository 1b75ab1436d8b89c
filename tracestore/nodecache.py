"""Client-side cache of immutable trace data (DESIGN section 4, cost model).

Nodes never change once written (an equal rewrite is a no-op, a different
one is refused), so a node payload read once can be served from memory for
as long as the session's data incarnation lives (keyed by the write that
stored the node: a store that rolls back may store it again, under another
write id). Session indexes do change (nodes are added); they are cached as
immutable snapshots tagged with the index version and the chain of its
writes' ids, and every read validates both on the server in the same round
trip before trusting the snapshot.

The cache is bounded in bytes (``StoreConfig.cache_bytes``; 0 disables it),
least recently used entries go first, and it is safe to share between
threads. It lives in ``Context.caches`` so sync and async clients each keep
their own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from .context import Context

CACHE_NAME = "nodes"


class NodeCache:
    """A thread-safe LRU of immutable values, bounded by their declared size in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Any:
        """The value cached under ``key`` (now most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        """Cache ``value`` (``nbytes`` large), evicting the least recently used as needed.

        A value larger than the whole budget is not cached.
        """
        if nbytes > self.max_bytes:
            self.discard(key)
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes and self._items:
                _, (_, size) = self._items.popitem(last=False)
                self._bytes -= size

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if cached."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes currently accounted for."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)


def node_cache(ctx: Context) -> NodeCache:
    """The node cache of this client (created on first use, sized by the config)."""
    cache = ctx.caches.get(CACHE_NAME)
    if cache is None:
        cache = ctx.caches.setdefault(CACHE_NAME, NodeCache(ctx.config.cache_bytes))
    assert isinstance(cache, NodeCache)
    return cache
