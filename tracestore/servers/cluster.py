"""A local Redis Cluster from the embedded binary: :class:`LocalCluster`, and one node's status."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ..errors import ServerError
from ..keys import key_slot
from ..replies import text
from .binaries import embedded_binary
from .embedded import EmbeddedServer

CLUSTER_SLOTS = 16384


@dataclass(frozen=True)
class ClusterNode:
    """One node of a :class:`LocalCluster`."""

    port: int
    role: str  # "primary" or "replica"
    node_id: str


class LocalCluster:
    """A local Redis Cluster: ``primaries`` primaries and ``replicas`` replicas per primary.

    Started from the same binary as :class:`EmbeddedServer`; slots are split
    evenly with ``CLUSTER ADDSLOTSRANGE``, nodes meet each other, replicas
    attach with ``CLUSTER REPLICATE``; ``start`` returns once every node
    reports ``cluster_state:ok`` and every replica is in sync with its primary.
    ``extra_args`` are given to every node (e.g. ``["--appendonly", "yes"]``).
    """

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 0,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        startup_timeout_s: float = 30.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        if primaries < 1:
            raise ServerError("a cluster needs at least one primary")
        if replicas < 0:
            raise ServerError("replicas must be >= 0")
        n = primaries * (1 + replicas)
        if ports is not None and len(ports) != n:
            raise ServerError(f"expected {n} ports, got {len(ports)}")
        self.primaries = primaries
        self.replicas = replicas
        self.host = host
        self.binary = binary or embedded_binary()
        self.startup_timeout_s = startup_timeout_s
        self.servers = [
            EmbeddedServer(
                host=host,
                binary=self.binary,
                cluster_enabled=True,
                port=ports[i] if ports else None,
                # a replica syncs at once (the default waits 5 s for more replicas)
                extra_args=["--repl-diskless-sync-delay", "0", *extra_args],
            )
            for i in range(n)
        ]
        self.nodes: list[ClusterNode] = []

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL of the first primary (seed node)."""
        return f"redis+cluster://{self.host}:{self.servers[0].port}"

    @property
    def ports(self) -> list[int]:
        """Ports of every node, primaries first."""
        return [s.port for s in self.servers]

    def start(self) -> LocalCluster:
        """Start every node, assign slots, join replicas, wait for ``cluster_state:ok``."""
        try:
            for s in self.servers:
                s.start()
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self) -> None:
        clients = [s.client(socket_timeout=5.0) for s in self.servers]
        try:
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            per = CLUSTER_SLOTS // self.primaries
            for i in range(self.primaries):
                lo = i * per
                hi = CLUSTER_SLOTS - 1 if i == self.primaries - 1 else (i + 1) * per - 1
                clients[i].execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", self.host, self.servers[0].port)
            self._wait(lambda: all(_known_nodes(c) >= len(clients) for c in clients), "nodes meet")
            self.nodes = [ClusterNode(s.port, "primary", ids[i]) for i, s in enumerate(self.servers[: self.primaries])]
            for j in range(self.primaries, len(clients)):
                primary = (j - self.primaries) % self.primaries
                clients[j].execute_command("CLUSTER", "REPLICATE", ids[primary])
                self.nodes.append(ClusterNode(self.servers[j].port, "replica", ids[j]))
            self._wait(
                lambda: all(_cluster_ok(c) for c in clients), "cluster_state:ok on every node"
            )
        finally:
            for c in clients:
                c.close()
        if self.replicas:
            self.wait_replicas_online()

    def server_at(self, port: int) -> EmbeddedServer:
        """The node listening on ``port``."""
        for s in self.servers:
            if s.port == port:
                return s
        raise ServerError(f"no node of this cluster listens on port {port}")

    def shards(self) -> list[tuple[list[tuple[int, int]], EmbeddedServer, list[EmbeddedServer]]]:
        """``(slot ranges, primary, replicas)`` per primary that serves slots, as a live node sees it.

        Read from ``CLUSTER NODES`` of the first node that answers (``CLUSTER
        SLOTS`` hides replicas that never received a write); replicas marked
        ``fail`` are left out.
        """
        for s in self.servers:
            if not s.running:
                continue
            c = s.client(socket_timeout=2.0)
            try:
                raw = text(c.execute_command("CLUSTER", "NODES"))
            except redis.exceptions.RedisError:
                continue
            finally:
                c.close()
            rows = [line.split() for line in raw.splitlines() if line.strip()]
            by_id = {r[0]: r for r in rows}
            out = []
            for r in rows:
                flags = r[2].split(",")
                ranges = [_slot_range(x) for x in r[8:] if not x.startswith("[")]
                if "master" not in flags or not ranges:
                    continue
                reps = [
                    self.server_at(_node_port(x))
                    for x in by_id.values()
                    if x[3] == r[0] and "fail" not in x[2].split(",")
                ]
                out.append((ranges, self.server_at(_node_port(r)), reps))
            return out
        raise ServerError("no node of the cluster answers CLUSTER NODES")

    def primary_of(self, key: str) -> EmbeddedServer:
        """The node serving ``key``'s hash slot now (after failovers too)."""
        slot = key_slot(key)
        for ranges, primary, _ in self.shards():
            if any(lo <= slot <= hi for lo, hi in ranges):
                return primary
        raise ServerError(f"slot {slot} of {key!r} is not covered")

    def replicas_of(self, primary: EmbeddedServer) -> list[EmbeddedServer]:
        """The replicas of ``primary`` (as CLUSTER SLOTS lists them)."""
        for _, p, reps in self.shards():
            if p is primary:
                return reps
        return []

    def cut_replica(self, primary: EmbeddedServer) -> EmbeddedServer:
        """Freeze ``primary``'s replica and drop its link; returns the replica (paused).

        First waits until the replica has every write the primary made so
        far; then SIGSTOPs it and kills the replication connection on the
        primary, so the primary's later writes reach no replica (a replica
        lagging at the moment its primary dies, made deterministic). Resume
        it with ``resume()``; :meth:`takeover` promotes it.
        """
        replicas = self.replicas_of(primary)
        if not replicas:
            raise ServerError(f"the primary on port {primary.port} has no replica")
        replica = replicas[0]
        pc, rc = primary.client(socket_timeout=2.0), replica.client(socket_timeout=2.0)
        try:
            def synced() -> bool:
                want = int(pc.info("replication")["master_repl_offset"])
                return int(rc.info("replication").get("slave_repl_offset", -1)) >= want

            self._wait(synced, f"replica {replica.port} in sync with {primary.port}")
            replica.pause()
            pc.execute_command("CLIENT", "KILL", "TYPE", "replica")
        finally:
            pc.close()
            rc.close()
        return replica

    def takeover(self, replica: EmbeddedServer, timeout_s: float | None = None) -> None:
        """Promote ``replica`` now (``CLUSTER FAILOVER TAKEOVER``: no vote, no agreement of its primary).

        Returns when every running node sees it serving its slots. Whatever
        its old primary wrote after the replica's last sync is lost: this is
        the failover to a lagging replica that asynchronous replication allows.
        """
        c = replica.client(socket_timeout=2.0)
        try:
            c.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        except redis.exceptions.RedisError as exc:
            raise ServerError(f"takeover by {replica.port} refused: {exc}") from exc
        finally:
            c.close()

        def agreed() -> bool:
            for s in self.servers:
                if not s.running:
                    continue
                sc = s.client(socket_timeout=2.0)
                try:
                    rows = [r.split() for r in text(sc.execute_command("CLUSTER", "NODES")).splitlines()]
                except redis.exceptions.RedisError:
                    return False
                finally:
                    sc.close()
                me = [r for r in rows if _node_port(r) == replica.port]
                if not me or "master" not in me[0][2] or len(me[0]) < 9:
                    return False
            return True

        self._wait(agreed, f"every node to see {replica.port} as a primary", timeout_s)

    def wait_replicas_online(self, timeout_s: float | None = None) -> None:
        """Wait until every primary has its replicas in sync and acknowledging.

        Each primary needs as many ``online`` replicas as the cluster was
        built with (or as ``CLUSTER NODES`` lists, if more): right after a
        restart the rejoining node is still marked ``fail`` there, so the
        listing alone would let this return before it has synced. Each of
        them must also have acknowledged the primary's offset (a ``WAIT``).
        Raises ServerError on timeout. A WAIT for replicas succeeds once this returns.
        """

        def online() -> bool:
            for _, primary, reps in self.shards():
                if not primary.running:
                    return False
                want = max(len(reps), self.replicas)
                c = primary.client(socket_timeout=2.0)
                try:
                    info = c.info("replication")
                    states = [v.get("state") for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                    if states.count("online") < want:
                        return False
                    if want and int(c.execute_command("WAIT", want, 200)) < want:
                        return False
                except redis.exceptions.RedisError:
                    return False
                finally:
                    c.close()
            return True

        self._wait(online, "replicas in sync with their primaries", timeout_s)

    def _wait(self, ok: Any, what: str, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        while not ok():
            if time.monotonic() > deadline:
                raise ServerError(f"local cluster: timed out waiting for {what}")
            time.sleep(0.05)

    def status(self) -> list[dict[str, Any]]:
        """Per node: port, role, state (``ok``/``fail``/``down``), keys."""
        return [node_status(self.host, s.port) for s in self.servers]

    def stop(self) -> None:
        """Stop every node and remove their temp dirs."""
        errors: list[BaseException] = []
        for s in self.servers:
            try:
                s.stop()
            except BaseException as exc:  # stop the rest anyway
                errors.append(exc)
        if errors:
            raise ServerError(f"could not stop {len(errors)} node(s): {errors[0]}")

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def node_status(host: str, port: int, password: str | None = None) -> dict[str, Any]:
    """Role, cluster state and key count of one cluster node (``state: down`` if unreachable)."""
    row: dict[str, Any] = {"port": port, "role": "?", "state": "down", "keys": 0}
    c = redis.Redis(host=host, port=port, password=password, protocol=2, socket_timeout=2.0)
    try:
        repl = c.info("replication")
        row["role"] = "primary" if repl.get("role") == "master" else "replica"
        info = text(c.execute_command("CLUSTER", "INFO"))
        row["state"] = info.split("cluster_state:")[1].split()[0]
        row["keys"] = int(c.dbsize())
    except (redis.exceptions.RedisError, IndexError):
        pass
    finally:
        c.close()
    return row


def _node_port(row: list[str]) -> int:
    """Port of a ``CLUSTER NODES`` row (``host:port@bus``)."""
    return int(row[1].split("@")[0].rsplit(":", 1)[1])


def _slot_range(item: str) -> tuple[int, int]:
    lo, _, hi = item.partition("-")
    return int(lo), int(hi or lo)


def _known_nodes(c: redis.Redis) -> int:
    return int(text(c.execute_command("CLUSTER", "INFO")).split("cluster_known_nodes:")[1].split()[0])


def _cluster_ok(c: redis.Redis) -> bool:
    return "cluster_state:ok" in text(c.execute_command("CLUSTER", "INFO"))
