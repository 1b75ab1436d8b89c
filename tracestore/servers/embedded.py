"""One local server process: :class:`EmbeddedServer` (standalone or a cluster node) and its TLS files.

Each server runs in its own temporary directory (removed on stop unless the
caller passed ``dir=``), bound to 127.0.0.1 on a free port, with persistence
off unless ``aof=True``. ``stop()`` shuts the process down and waits for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import ServerError
from .binaries import embedded_binary
from .ports import free_port, port_is_free


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


#: prctl option: the signal a process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def parent_death_signal(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when ``parent`` dies (Linux), else None.

    It runs in the child between fork and exec: ``prctl(PR_SET_PDEATHSIG,
    SIGTERM)``, then a check that ``parent`` is still the parent (had it died
    before the call, the signal would never come: the child exits at once).
    The signal follows the thread that started the child, so start a server
    that must die with its process from its main thread (the CLI does).
    libc is loaded here, before the fork.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def holder_of(host: str, port: int) -> str:
    """What holds ``host:port``, as the end of a "port ... is already in use" message ("" if unknown).

    A Redis or Valkey server there is asked (one ``INFO server``) for its
    process: a server left by a killed ``tracestore server`` is named with its
    pid and how to stop it.
    """
    c = redis.Redis(host=host, port=port, protocol=2, socket_timeout=1.0, socket_connect_timeout=1.0,
                    retry=Retry(NoBackoff(), 0))
    try:
        info = c.info("server")
    except redis.exceptions.AuthenticationError:
        return " (by a password-protected Redis/Valkey server)"
    except redis.exceptions.ResponseError as exc:
        if "NOAUTH" in str(exc):
            return " (by a password-protected Redis/Valkey server)"
        return ""
    except redis.exceptions.RedisError:
        return ""
    finally:
        c.close()
    name = "valkey-server" if "valkey_version" in info else "redis-server"
    pid = info.get("process_id", "?")
    up = int(info.get("uptime_in_seconds", 0))
    return (
        f" by {name} pid {pid}, up {up} s (a server left running, e.g. by a killed "
        f"`tracestore server`: stop it with `kill {pid}`, or choose another --port)"
    )


class _PortTaken(ServerError):
    """The free port chosen was taken by another process before the server bound it."""


class EmbeddedServer:
    """One standalone (or cluster-enabled) server process.

    ``EmbeddedServer().start()`` runs ``valkey-server`` on a free port;
    ``binary=redis_server_binary()`` runs Debian's Redis instead. ``aof=True``
    turns on the append-only file with ``appendfsync always`` (nothing
    acknowledged is lost on SIGKILL). ``dir=`` keeps data in a directory the
    caller owns (not removed on stop), so a server can restart on it.
    ``die_with_parent=True`` ends the server (SIGTERM) when the process that
    started it dies, even by SIGKILL (Linux; see :func:`parent_death_signal`):
    a foreground server never outlives its ``tracestore server``.
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
        die_with_parent: bool = False,
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
        self.die_with_parent = die_with_parent
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
                raise ServerError(
                    f"port {self.requested_port} on {self.host} is already in use"
                    f"{holder_of(self.connect_host, self.requested_port)}"
                )
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
                preexec_fn=parent_death_signal(os.getpid()) if self.die_with_parent else None,
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
