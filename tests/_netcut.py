"""A small TCP proxy for tests that cut a connection at a chosen moment.

``CutProxy(host, port)`` forwards every byte both ways between clients and
one upstream server. ``arm()`` makes it drop the *next* reply: the request
has already reached the server (and run there), the reply is discarded and
both sockets are closed, so the client sees a connection error and redis-py
retries on a new connection. ``cuts`` counts the replies dropped. ``arm(skip=n)`` lets n replies
through first (to cut the second request of an operation, e.g. the purge
after a release). ``arm(times=None)`` keeps cutting every reply (each retry's
too, so the client's retries run out) until ``disarm()``. Replies are counted per ``recv``; the tests use one
client and small replies, so one reply is one chunk. ``hold_first_reply_s``: hold the first
reply of every new connection that long (a slow handshake: redis-py's connect waits for it).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class CutProxy:
    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._armed = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        self._skip = 0
        self._times: int | None = 1
        self.cuts = 0
        self.connections = 0
        self.hold_first_reply_s = 0.0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def arm(self, skip: int = 0, times: int | None = 1) -> None:
        """Drop ``times`` replies (None: all, until :meth:`disarm`) after the next ``skip`` ones."""
        with self._lock:
            self._skip = skip
            self._times = times
            self._armed.set()

    def disarm(self) -> None:
        """Let every reply through again."""
        with self._lock:
            self._armed.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, is_reply: bool) -> None:
        first = is_reply
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if first and self.hold_first_reply_s:
                    time.sleep(self.hold_first_reply_s)
                first = False
                if is_reply and self._armed.is_set():
                    with self._lock:
                        if self._armed.is_set() and self._skip > 0:
                            self._skip -= 1
                        elif self._armed.is_set():
                            if self._times is not None:
                                self._times -= 1
                                if self._times <= 0:
                                    self._armed.clear()
                            self.cuts += 1
                            break  # the reply is lost; close both sides
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        with self._lock:
            for s in self._socks:
                _close(s)

    def __enter__(self) -> CutProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


@contextmanager
def proxied_cluster(
    cluster_url: str, run_id: str, *, retries: int = 3
) -> Iterator[tuple[Any, Callable[[str], CutProxy]]]:
    """A TraceStore on a cluster whose every node is reached through its own CutProxy.

    Yields ``(store, proxy_of)``; ``proxy_of(key)`` is the proxy of the node
    serving ``key``. redis-py is told to reach the nodes (which announce
    their own addresses) through the proxies with ``address_remap``.
    """
    import redis
    from redis.cluster import RedisCluster

    from tracestore import TraceStore
    from tracestore.connection import ConnectionOptions, _common, parse_url
    from tracestore.context import Context, StoreConfig
    from tracestore.io import SyncIO
    from tracestore.keys import Keys
    from tracestore.replies import text

    base = parse_url(cluster_url).url
    probe = redis.Redis.from_url(base)
    try:
        shards = probe.execute_command("CLUSTER", "SLOTS")
    finally:
        probe.close()
    nodes = {(text(s[2][0]), int(s[2][1])) for s in shards}
    proxies = {addr: CutProxy(*addr) for addr in nodes}
    by_port = {p.port: p for p in proxies.values()}
    common = _common(ConnectionOptions(retries=retries))
    common.pop("retry_on_error")

    def remap(addr: tuple[str, int]) -> tuple[str, int]:
        p = proxies.get((addr[0], int(addr[1])))
        return ("127.0.0.1", p.port) if p else addr

    client = RedisCluster.from_url(base, **common, address_remap=remap)
    st = TraceStore(SyncIO(client, cluster=True), Context(Keys("ts", run_id), True, StoreConfig()), cluster_url)

    def proxy_of(key: str) -> CutProxy:
        return by_port[int(client.get_node_from_key(key).port)]

    try:
        st.init_run()
        yield st, proxy_of
    finally:
        st.close()
        for p in proxies.values():
            p.close()
