"""A small TCP proxy for tests that cut a connection at a chosen moment.

``CutProxy(host, port)`` forwards every byte both ways between clients and
one upstream server. ``arm()`` makes it drop the *next* reply: the request
has already reached the server (and run there), the reply is discarded and
both sockets are closed, so the client sees a connection error and redis-py
retries on a new connection. ``cuts`` counts the replies dropped. ``arm(skip=n)`` lets n replies
through first (to cut the second request of an operation, e.g. the purge
after a release). Replies are counted per ``recv``; the tests use one
client and small replies, so one reply is one chunk.
"""

from __future__ import annotations

import socket
import threading
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
        self.cuts = 0
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def arm(self, skip: int = 0) -> None:
        """Drop the reply after the next ``skip`` ones that come back (and that connection)."""
        with self._lock:
            self._skip = skip
            self._armed.set()

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
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if is_reply and self._armed.is_set():
                    with self._lock:
                        if self._armed.is_set() and self._skip > 0:
                            self._skip -= 1
                        elif self._armed.is_set():
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
