"""The default server: one embedded server per machine and user, shared by every process.

With no URL configured (no ``url=``, no ``$TRACESTORE_URL``), every process of
a user finds the same embedded ``valkey-server`` again, so two processes that
``connect()`` without a URL share one store and ``tracestore sessions`` sees
what ``tracestore train`` wrote.

Where it lives: :func:`state_dir` (``$TRACESTORE_HOME``, else
``$XDG_RUNTIME_DIR/tracestore``, else ``~/.cache/tracestore``), in a
sub-directory ``server/`` made private to the user (mode 0700) holding

* ``lock``: an ``flock`` held while a process checks, starts or stops the
  server, so concurrent first starts start one server; the kernel drops the
  lock when its holder dies, so a crashed starter leaves no stale lock;
* ``server.json``: the pid file (pid, URL, binary, start time), written
  atomically once the server answers;
* ``server.sock``: the unix socket the server answers on (no TCP port, so no
  other user of the machine can reach it); when that path would be too long
  for a unix socket, a TCP port on 127.0.0.1 with a random password instead;
* ``server.log``, ``stderr.log``: the server's logs.

A ``server.json`` whose server is gone (killed, machine rebooted) is stale:
the next :func:`ensure` removes it, starts a new server and says so on
stderr, once (:data:`RESTART_NOTICE`: the data of the previous one is gone). The server
outlives the process that started it (it has its own session); ``tracestore
server stop`` (:func:`stop`) ends it. It keeps no data across a stop
(persistence off), like every embedded server.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import redis

from .errors import ServerError
from .servers import EmbeddedServer
from .urls import mask_url

ENV_HOME = "TRACESTORE_HOME"
#: A unix socket path must fit in ``sun_path`` (108 bytes on Linux, with its NUL).
MAX_SOCKET_PATH = 100
LOCK_TIMEOUT_S = 60.0


def state_dir() -> Path:
    """Directory of tracestore's local state for this user.

    ``$TRACESTORE_HOME`` when set (tests point it at a directory of their
    own), else ``$XDG_RUNTIME_DIR/tracestore``, else the user cache directory
    (``$XDG_CACHE_HOME`` or ``~/.cache``) ``/tracestore``.
    """
    home = os.environ.get(ENV_HOME)
    if home:
        return Path(home)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "tracestore"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "tracestore"


def server_dir() -> Path:
    """Directory of the default server: ``<state_dir>/server``."""
    return state_dir() / "server"


def is_default(url: str) -> bool:
    """True when ``url`` is the unix socket URL the default server of this user answers on."""
    return url == f"unix://{server_dir() / 'server.sock'}"


@dataclass(frozen=True)
class DefaultServer:
    """The default server as recorded in its pid file ``server.json``."""

    pid: int
    url: str
    binary: str
    dir: str
    started_ms: int

    @property
    def display_url(self) -> str:
        """The URL with its password (TCP fallback only) masked."""
        return mask_url(self.url)


@dataclass(frozen=True)
class DefaultServerStatus:
    """What ``tracestore server status`` shows."""

    running: bool
    dir: str
    pid: int | None = None
    url: str | None = None
    started_ms: int | None = None
    uptime_s: int | None = None
    clients: int | None = None
    used_memory_bytes: int | None = None
    keys: int | None = None
    detail: str = ""


def _pid_running(pid: int) -> bool:
    """True when ``pid`` is a live process (a zombie is not live)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the state follows the parenthesised command name
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _read(d: Path) -> DefaultServer | None:
    try:
        doc = orjson.loads((d / "server.json").read_bytes())
        return DefaultServer(**{k: doc[k] for k in DefaultServer.__dataclass_fields__})
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        return None


def _client(url: str, timeout_s: float = 2.0) -> redis.Redis:
    return redis.Redis.from_url(
        url, protocol=2, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )


def _answers(info: DefaultServer) -> bool:
    """True when the recorded server answers PING and is the recorded process."""
    c = _client(info.url)
    try:
        return int(c.info("server").get("process_id", -1)) == info.pid
    except redis.exceptions.RedisError:
        return False
    finally:
        c.close()


@contextlib.contextmanager
def _locked(d: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"another process has held {d / 'lock'} for {timeout_s:.0f}s "
                        "(starting or stopping the default server); try again"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # releases the lock


def find() -> DefaultServer | None:
    """The running default server of this user, or None (never starts one). One PING."""
    info = _read(server_dir())
    return info if info is not None and _answers(info) else None


#: Servers started by this process (kept referenced so their Popen is not collected).
_started: list[Any] = []


def ensure(startup_timeout_s: float = 15.0) -> DefaultServer:
    """The default server, started if none runs. Safe to call from many processes at once.

    Raises ServerError when the server cannot start, or when a recorded
    server process is alive but does not answer within ``startup_timeout_s``
    (``tracestore server stop`` ends it). When a pid file says a server had
    been running and it is gone, the process that starts the new one prints
    :data:`RESTART_NOTICE` to stderr (once: the others find the new server).
    """
    d = server_dir()
    info = _read(d)
    if info is not None and _answers(info):
        return info
    with _locked(d):
        info = _read(d)
        if info is not None:
            if _answers(info):
                return info  # another process started it while we waited
            if _pid_running(info.pid) and _looks_like_server(info.pid):
                # alive but not answering (loading, or hung): wait, then give up
                deadline = time.monotonic() + startup_timeout_s
                while time.monotonic() < deadline and _pid_running(info.pid):
                    if _answers(info):
                        return info
                    time.sleep(0.1)
                if _pid_running(info.pid):
                    raise ServerError(
                        f"the default server (pid {info.pid}, {info.display_url}) does not answer; "
                        "end it with `tracestore server stop`"
                    )
        _remove_state(d)
        started = _start(d, startup_timeout_s)
        if info is not None:  # one had been running and is gone: say so, once (this process started it)
            announce_restart(info)
        return started


#: What a process that had to start a new default server where one had been running prints.
RESTART_NOTICE = (
    "tracestore: started a new default server; the previous one (pid {pid}) is gone, and its "
    "data with it: to keep data across restarts, run `tracestore server --appendonly --dir DIR` "
    "and set TRACESTORE_URL to the URL it prints"
)


def announce_restart(previous: DefaultServer) -> None:
    """Tell the user on stderr, in one line, that the default server was replaced and its data lost.

    Called by :func:`ensure` in the one process that starts the new server
    (under the lock), when a pid file says a server had been running: a
    crash, a ``kill``, a reboot with the state kept. A ``tracestore server
    stop`` removes the pid file, so a deliberate stop is not announced.
    """
    sys.stderr.write(RESTART_NOTICE.format(pid=previous.pid) + "\n")
    sys.stderr.flush()


def _looks_like_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return True  # cannot tell: assume it is
    return b"valkey-server" in cmd or b"redis-server" in cmd


def _start(d: Path, startup_timeout_s: float) -> DefaultServer:
    over_unix = len(str(d / "server.sock")) <= MAX_SOCKET_PATH
    srv = EmbeddedServer(
        dir=d,
        unix_socket=over_unix,
        tcp=not over_unix,
        # a TCP port is reachable by every user of the machine: guard it
        password=None if over_unix else secrets.token_hex(16),
        startup_timeout_s=startup_timeout_s,
    ).start()
    assert srv.proc is not None
    _started.append(srv)
    info = DefaultServer(
        pid=srv.proc.pid,
        url=srv.url,
        binary=srv.binary,
        dir=str(d),
        started_ms=int(time.time() * 1000),
    )
    tmp = d / f"server.json.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(orjson.dumps(asdict(info), option=orjson.OPT_INDENT_2))
    os.replace(tmp, d / "server.json")
    return info


def _remove_state(d: Path) -> None:
    for name in ("server.json", "server.sock", "server.log", "stderr.log", "nodes.conf"):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()


def stop(timeout_s: float = 10.0) -> DefaultServer | None:
    """Stop the default server (SIGTERM, then SIGKILL); return what was stopped, or None.

    Removes its pid file, socket and logs; a stale pid file (server gone) is
    removed too and reported as None. Never signals a process that is not the
    recorded server: a live pid is signalled only when the server on the
    recorded URL reports that pid, or the process is a ``valkey-server`` /
    ``redis-server``.
    """
    d = server_dir()
    if not d.exists():
        return None
    with _locked(d):
        info = _read(d)
        if info is None:
            _remove_state(d)
            return None
        ours = _answers(info) or (_pid_running(info.pid) and _looks_like_server(info.pid))
        if not ours:
            _remove_state(d)
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _pid_running(info.pid) and time.monotonic() < deadline:
            _reap(info.pid)
            time.sleep(0.05)
        if _pid_running(info.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
        _reap(info.pid)
        _remove_state(d)
        return info


def _reap(pid: int) -> None:
    """Collect ``pid`` when it is a child of this process (else it is not ours to wait for)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def status() -> DefaultServerStatus:
    """Whether the default server runs, and its pid, URL, uptime, clients, memory and keys."""
    d = server_dir()
    info = _read(d)
    if info is None:
        return DefaultServerStatus(False, str(d), detail="not started (it starts on first use)")
    recorded = DefaultServerStatus(
        False, str(d), pid=info.pid, url=info.display_url, started_ms=info.started_ms
    )
    c = _client(info.url)
    try:
        srv = c.info("server")
        if int(srv.get("process_id", -1)) != info.pid:
            raise redis.exceptions.ConnectionError("another process answers")
        return replace(
            recorded,
            running=True,
            uptime_s=int(srv.get("uptime_in_seconds", 0)),
            clients=int(c.info("clients").get("connected_clients", 0)),
            used_memory_bytes=int(c.info("memory").get("used_memory", 0)),
            keys=int(c.dbsize()),
        )
    except redis.exceptions.RedisError:
        return replace(
            recorded,
            detail="stale pid file: the recorded server is gone (the next use starts a new one)",
        )
    finally:
        c.close()
