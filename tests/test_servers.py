"""Server lifecycle: embedded standalone, local cluster, Debian redis-server."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tracestore import ServerError, TraceStore
from tracestore.servers import EmbeddedServer, LocalCluster, redis_server_binary


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_use_stop_leaves_nothing() -> None:
    srv = EmbeddedServer().start()
    pid = srv.proc.pid if srv.proc else 0
    d = srv.dir
    assert d is not None and d.is_dir()
    with TraceStore.connect(srv.url, run="life") as st:
        st.open_session("s", "o")
        assert st.owner_of("s") == "o"
    srv.stop()
    assert not _alive(pid)
    assert not d.exists()
    srv.stop()  # idempotent


def test_two_servers_side_by_side_do_not_collide() -> None:
    with EmbeddedServer() as a, EmbeddedServer() as b:
        assert a.port != b.port and a.dir != b.dir
        a.client().set("k", "a")
        b.client().set("k", "b")
        assert a.client().get("k") == b"a"
        assert b.client().get("k") == b"b"


def test_persistence_is_off_by_default_and_aof_on_request(tmp_path: Path) -> None:
    with EmbeddedServer() as s:
        cfg = s.client().config_get("appendonly")
        assert cfg["appendonly"] == "no"
        assert s.client().config_get("save")["save"] == ""
    with EmbeddedServer(aof=True, dir=tmp_path / "data") as s:
        c = s.client()
        assert c.config_get("appendonly")["appendonly"] == "yes"
        assert c.config_get("appendfsync")["appendfsync"] == "always"
        c.set("durable", "1")
        s.kill()  # SIGKILL: the acknowledged write must survive
        s.start()
        assert s.client().get("durable") == b"1"
    assert (tmp_path / "data").exists()  # a caller's dir is kept


def test_port_taken_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} .*already in use"):
            EmbeddedServer(port=port).start()


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="missing or not executable"):
        EmbeddedServer(binary=str(tmp_path / "no-such-server"))


def test_server_that_exits_reports_its_log() -> None:
    srv = EmbeddedServer(extra_args=["--no-such-option", "1"])
    with pytest.raises(ServerError, match="exited with code"):
        srv.start()
    assert srv.proc is None and srv.dir is None


def test_cluster_of_three_primaries_and_three_replicas() -> None:
    c = LocalCluster(primaries=3, replicas=1).start()
    pids = [s.proc.pid for s in c.servers if s.proc]
    dirs = [s.dir for s in c.servers]
    try:
        rows = c.status()
        assert [r["role"] for r in rows] == ["primary"] * 3 + ["replica"] * 3
        assert all(r["state"] == "ok" for r in rows)
        with TraceStore.connect(c.url, run="cl") as st:
            assert st.cluster
            st.open_session("a", "o")
            assert st.owner_of("a") == "o"
    finally:
        c.stop()
    assert not any(_alive(p) for p in pids)
    assert not any(d is not None and d.exists() for d in dirs)


def test_debian_redis_server_when_present() -> None:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("Debian redis-server is not installed (apt-get install redis-server)")
    with EmbeddedServer(binary=binary) as s, TraceStore.connect(s.url, run="deb") as st:
        info = st.server_info()
        assert info.engine == "redis" and info.version.startswith("7.")
        st.open_session("x", "o")
        assert st.owner_of("x") == "o"


def test_a_free_port_taken_before_the_server_binds_it_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port race of every free-port scheme, made deterministic: the first port handed
    out is already taken, once by another server (which answers PING: it must not be
    mistaken for ours) and once by a plain listener (the server cannot bind and exits)."""
    import tracestore.servers.embedded as embedded  # where EmbeddedServer.start finds its port

    real_free_port = embedded.free_port
    with EmbeddedServer() as other, socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        for taken in (other.port, listener.getsockname()[1]):
            handed: list[int] = []

            def free_port(host: str = "127.0.0.1", taken: int = taken, handed: list[int] = handed) -> int:
                handed.append(taken if not handed else real_free_port(host))
                return handed[-1]

            monkeypatch.setattr(embedded, "free_port", free_port)
            with EmbeddedServer() as srv:
                assert handed[0] == taken and srv.port == handed[-1] != taken
                assert srv.proc is not None
                assert int(srv.client().info("server")["process_id"]) == srv.proc.pid
        assert other.client().ping()  # the other server was left alone
