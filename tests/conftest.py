"""Test fixtures: real servers for every reachable backend.

``backend`` is parametrised over:

* ``valkey``: the embedded ``valkey-server`` (always);
* ``cluster``: a local 3-primary cluster from the same binary (always);
* ``redis7``: Debian's ``redis-server`` when installed (skipped with a reason otherwise);
* ``container``: a testcontainers container of the local server image
  (``tests/_docker.py``, built on first use) when a Docker engine is
  reachable (skipped with the reason otherwise).

``TRACESTORE_TEST_BACKENDS=valkey,cluster`` narrows the list (for quick local loops).
Servers are started once per test session and stopped at its end. Every test
gets its own run id, so tests never see each other's keys.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests._docker import ServerContainer, build_image, engine_reason
from tracestore import AsyncTraceStore, TraceStore
from tracestore.servers import EmbeddedServer, LocalCluster, redis_server_binary

ALL_BACKENDS = ("valkey", "cluster", "redis7", "container")

# Isolation: a test session never uses the user's default server, its cluster
# state or its TRACESTORE_URL, nor another test session's (several run at once
# on a shared machine). Every session gets a state directory of its own, which
# subprocesses inherit, and stops the default server it started there.
# (Test modules import this file again as ``tests.conftest``: set up once per process.)
# A suite started as a background job of a script inherits SIGINT ignored, and so would every CLI process it
# starts (an ignored signal stays ignored across exec): the tests that stop a server or a trainer with SIGINT,
# as Ctrl-C does, need it delivered. A handler (not SIG_IGN) here gives the children the default disposition.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if os.environ.get("TRACESTORE_TESTS_PID") != str(os.getpid()):
    os.environ["TRACESTORE_TESTS_PID"] = str(os.getpid())
    os.environ["TRACESTORE_HOME"] = tempfile.mkdtemp(prefix="tracestore-tests-")
    for _var in ("TRACESTORE_URL", "TRACESTORE_RUN", "TRACESTORE_CLUSTER_STATE"):
        os.environ.pop(_var, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``pytestmark = pytest.mark.backends("valkey", "cluster")``: the module's tests parametrized by
    ``backend`` run on those backends only. The gateway modules use it: they drive the store through
    gateway processes (seconds per test), and what differs between backends is the store's, which the
    store's own tests check on every backend; a standalone server and the cluster cover the gateway's
    two store clients."""
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("backends")
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend") if callspec is not None else None
        (dropped if marker is not None and backend is not None and backend not in marker.args else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    # `make test` runs in pytest-xdist workers (``--dist loadgroup``): every test that starts Ray runs
    # on one worker, one after another, so that two local Ray clusters never share the machine (each
    # wants most of it, and a Ray CLI or ``address="auto"`` could find the other's); the rest is shared.
    if config.pluginmanager.hasplugin("xdist"):
        for item in keep:
            if item.get_closest_marker("ray") is not None:
                item.add_marker(pytest.mark.xdist_group("ray"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tracestore import default_server

    default_server.stop()
    shutil.rmtree(os.environ["TRACESTORE_HOME"], ignore_errors=True)


def _selected() -> list[str]:
    raw = os.environ.get("TRACESTORE_TEST_BACKENDS", "")
    chosen = [b.strip() for b in raw.split(",") if b.strip()] or list(ALL_BACKENDS)
    unknown = set(chosen) - set(ALL_BACKENDS)
    if unknown:
        raise pytest.UsageError(f"unknown backends {sorted(unknown)}; choose from {ALL_BACKENDS}")
    return chosen


class _Servers:
    """Starts each backend on first use; stops them all at session end."""

    def __init__(self) -> None:
        self._urls: dict[str, str] = {}
        self._stoppers: list[Any] = []

    def url(self, backend: str) -> str:
        if backend in self._urls:
            return self._urls[backend]
        if backend == "valkey":
            s = EmbeddedServer().start()
            self._stoppers.append(s.stop)
            url = s.url
        elif backend == "cluster":
            c = LocalCluster(primaries=3).start()
            self._stoppers.append(c.stop)
            url = c.url
        elif backend == "redis7":
            binary = redis_server_binary()
            if binary is None:
                pytest.skip("Debian redis-server is not installed (apt-get install redis-server)")
            s = EmbeddedServer(binary=binary).start()
            self._stoppers.append(s.stop)
            url = s.url
        elif backend == "container":
            reason = engine_reason()
            if reason:
                pytest.skip(reason)
            build_image()  # locally, from the embedded binaries: nothing is pulled
            ctr = ServerContainer().start()
            self._stoppers.append(ctr.stop)
            url = ctr.url
        else:  # pragma: no cover
            raise AssertionError(backend)
        self._urls[backend] = url
        return url

    def stop(self) -> None:
        for stop in reversed(self._stoppers):
            stop()


@pytest.fixture(scope="session")
def servers() -> Iterator[_Servers]:
    s = _Servers()
    yield s
    s.stop()


@pytest.fixture(params=_selected())
def backend(request: pytest.FixtureRequest) -> str:
    """Name of the backend this test runs on."""
    return str(request.param)


@pytest.fixture
def url(servers: _Servers, backend: str) -> str:
    """URL of a running server of ``backend``."""
    return servers.url(backend)


@pytest.fixture
def run_id() -> str:
    """A run id no other test uses."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(url: str, run_id: str) -> Iterator[TraceStore]:
    """A sync store on a fresh run of ``backend``."""
    st = TraceStore.connect(url, run=run_id)
    yield st
    st.close()


@pytest.fixture
def store_factory(url: str, run_id: str) -> Iterator[Any]:
    """Make more sync clients of the same run (``store_factory(**opts)``)."""
    made: list[TraceStore] = []

    def make(**opts: Any) -> TraceStore:
        st = TraceStore.connect(url, run=run_id, **opts)
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()


@pytest.fixture
def arun() -> Any:
    """Run a coroutine to completion in a fresh event loop (no pytest-asyncio needed)."""

    def run(coro: Any) -> Any:
        return asyncio.run(coro)

    return run


async def connect_async(url: str, run: str, **opts: Any) -> AsyncTraceStore:
    """Open an async store (helper for tests that drive coroutines with ``arun``)."""
    return await AsyncTraceStore.connect(url, run=run, **opts)


@pytest.fixture(scope="session")
def standalone_url(servers: _Servers) -> str:
    """The embedded standalone server (for tests that need exactly one node)."""
    return servers.url("valkey")


@pytest.fixture(scope="session")
def cluster_url(servers: _Servers) -> str:
    """The embedded 3-primary cluster."""
    return servers.url("cluster")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One block of skip reasons with counts at the end of the run (issue 12 item 7).

    ``addopts`` reports failures, errors and xfails test by test (``-rfExX``)
    but not skips: a backend that is not there skips ~250 tests, and one line
    each would bury the summary. Here each reason appears once, with how many
    tests it skipped and in which files.
    """
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    by_reason: dict[str, list[str]] = {}
    for rep in skipped:
        longrepr = rep.longrepr
        reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        by_reason.setdefault(reason.removeprefix("Skipped: "), []).append(rep.nodeid.split("::")[0])
    terminalreporter.write_sep("=", f"skipped: {len(skipped)} tests, {len(by_reason)} reasons")
    for reason, files in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        names = sorted(set(files))
        where = ", ".join(n.removeprefix("tests/") for n in names[:4])
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        terminalreporter.write_line(f"{len(files):5d}  {reason}  ({where}{more})")
