"""The ``tracestore`` command line, run as a user would (real servers, real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from tracestore import StorageError, TraceStore, default_server
from tracestore.cli import main
from tracestore.servers import EmbeddedServer, free_port, port_is_free

BIN = [sys.executable, "-m", "tracestore.cli"]


def _stop(proc: subprocess.Popen[str]) -> None:
    """End a foreground `tracestore server` the way a user does, so it stops its server too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_help_explains_every_command() -> None:
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for cmd in ["server", "cluster", "ping", "info", "demo"]:
        assert cmd in r.output
    r = CliRunner().invoke(main, ["ping", "--help"])
    assert "TRACESTORE_URL" in r.output


def test_ping_and_info(standalone_url: str) -> None:
    with TraceStore.connect(standalone_url, run="visible-run"):
        pass
    r = CliRunner().invoke(main, ["ping", "--url", standalone_url])
    assert r.exit_code == 0, r.output
    assert "PONG" in r.output
    r = CliRunner().invoke(main, ["info"], env={"TRACESTORE_URL": standalone_url})
    assert r.exit_code == 0, r.output
    assert "valkey" in r.output and "standalone" in r.output and "visible-run" in r.output


def test_ping_unreachable_exits_1() -> None:
    r = CliRunner().invoke(main, ["ping", "--url", "redis://127.0.0.1:1"])
    assert r.exit_code == 1
    assert "cannot reach" in r.output


def test_bad_url_is_a_readable_error() -> None:
    r = CliRunner().invoke(main, ["ping", "--url", "http://x"])
    assert r.exit_code == 2  # a usage error
    assert "unsupported URL scheme" in r.output


def test_demo_against_a_server(standalone_url: str) -> None:
    r = CliRunner().invoke(main, ["demo", "--url", standalone_url, "--only", "basics"])
    assert r.exit_code == 0, r.output
    assert "reloaded on NOSCRIPT" in r.output
    assert "20000" in r.output


def _demo_keys(url: str) -> list[str]:
    with TraceStore.connect(url, run="probe", create_run=False) as st:
        return sorted(k.decode() for k in st.redis.scan_iter(match="ts:{demo-*", count=1000))


def test_demo_cleans_up_its_runs_unless_kept(tmp_path: Path) -> None:
    """`tracestore demo` left six runs behind, two with live sessions of owner tags that never
    heart-beat (gc cannot release them): now every section's run is deleted after its table,
    unless --keep, which names them."""
    srv = EmbeddedServer().start()  # a server of its own: no other test's demo runs on it
    try:
        r = subprocess.run([*BIN, "demo", "--url", srv.url], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip().endswith("removed the demo's 6 runs (--keep keeps them)"), r.stdout[-300:]
        assert _demo_keys(srv.url) == []
        r = subprocess.run([*BIN, "demo", "--url", srv.url, "--keep", "--only", "ownership"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        last = r.stdout.rstrip().splitlines()[-1]
        assert last.startswith("kept the demo's runs: demo-ownership-"), last
        run = last.split(": ", 1)[1].split(" ", 1)[0]
        with TraceStore.connect(srv.url, run=run, create_run=False) as st:
            assert st.run_ids() == [run] and st.stats().sessions_opened > 0
    finally:
        srv.stop()


def test_cluster_up_status_down(tmp_path: Path) -> None:
    state = str(tmp_path / "cluster.json")
    env = {"TRACESTORE_CLUSTER_STATE": state}
    up = subprocess.run([*BIN, "cluster", "up"], env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    url = up.stdout.strip()
    assert url.startswith("redis+cluster://")
    try:
        # the cluster outlives the command that started it
        with TraceStore.connect(url, run="cli") as st:
            assert st.cluster
            st.open_session("a", "o")
        st_ = CliRunner().invoke(main, ["cluster", "status"], env=env)
        assert st_.exit_code == 0, st_.output
        assert st_.output.count(" ok") == 3
        again = CliRunner().invoke(main, ["cluster", "up"], env=env)
        assert again.exit_code == 1 and "already recorded" in again.output
    finally:
        down = CliRunner().invoke(main, ["cluster", "down"], env=env)
    assert down.exit_code == 0, down.output
    assert "stopped 3 nodes" in down.output
    assert not Path(state).exists()
    r = CliRunner().invoke(main, ["cluster", "status"], env=env)
    assert r.exit_code == 1
    again = CliRunner().invoke(main, ["cluster", "down"], env=env)  # idempotent
    assert again.exit_code == 0 and "nothing to stop" in again.output


def test_ping_checks_every_primary_and_json_on_status_commands(cluster_url: str, run_id: str) -> None:
    with TraceStore.connect(cluster_url, run=run_id) as st:
        st.gate.admit("s", "w", 30)
        st.router(["ep-a"]).acquire("s")
    r = CliRunner().invoke(main, ["ping", "--url", cluster_url])
    assert r.exit_code == 0, r.output
    assert "cluster, 3 primaries answer" in r.output
    r = CliRunner().invoke(main, ["ping", "--url", cluster_url, "--json"])
    doc = orjson.loads(r.output)
    assert doc["ok"] and len(doc["primaries"]) == 3 and all(p["ok"] for p in doc["primaries"])
    r = CliRunner().invoke(main, ["info", "--url", cluster_url, "--json"])
    doc = orjson.loads(r.output)
    assert doc["mode"] == "cluster" and doc["nodes"] == 3 and run_id in doc["runs"]
    r = CliRunner().invoke(main, ["routes", "--url", cluster_url, "--run", run_id, "--json", "s"])
    assert orjson.loads(r.output)["routes"] == {"s": "ep-a"}
    r = CliRunner().invoke(main, ["gate", "status", "--url", cluster_url, "--run", run_id, "--json"])
    doc = orjson.loads(r.output)
    assert doc["live"] == 1 and doc["next_deadline_ms"] > doc["server_ms"]  # raw ms
    r = CliRunner().invoke(main, ["gate", "status", "--url", cluster_url, "--run", run_id])
    assert "next lease deadline   in " in r.output and " s" in r.output  # human


def test_gate_status_shows_local_times_with_their_age(standalone_url: str, run_id: str) -> None:
    with TraceStore.connect(standalone_url, run=run_id) as st:
        st.gate.seal()
        sealed = st.gate.status().sealed_ms
    r = CliRunner().invoke(main, ["gate", "status", "--url", standalone_url, "--run", run_id])
    assert r.exit_code == 0, r.output
    row = next(ln for ln in r.output.splitlines() if ln.startswith("sealed at"))
    assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sealed / 1000)) in row
    assert row.endswith("ago)")
    assert str(sealed) not in r.output


def test_redis_cli_runs_the_bundled_valkey_cli(standalone_url: str, cluster_url: str, run_id: str) -> None:
    for url in (standalone_url, cluster_url):
        with TraceStore.connect(url, run=run_id):
            pass
        res = subprocess.run(
            [*BIN, "redis-cli", "--url", url, "HGET", f"ts:{{{run_id}}}:meta", "schema"],
            capture_output=True, text=True, timeout=60,
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "2"  # on a cluster, -c followed the slot's redirect
    # no URL: the default server, over its unix socket
    with TraceStore.connect(run=run_id):
        pass
    res = subprocess.run(
        [*BIN, "redis-cli", "--scan", "--pattern", f"ts:{{{run_id}}}:*"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [f"ts:{{{run_id}}}:meta"]


def test_redis_cli_passes_a_password_through_the_environment(tmp_path: Path) -> None:
    with EmbeddedServer(password="s3cret") as srv:
        res = subprocess.run(
            [*BIN, "redis-cli", "--url", srv.url, "PING"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0 and res.stdout.strip() == "PONG", res.stderr
        assert "Warning" not in res.stderr  # not given with -a on the command line


def test_foreground_server_with_host_password_and_appendonly(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [*BIN, "server", "--host", "0.0.0.0", "--password", "pw", "--appendonly", "--dir", str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("redis://:pw@127.0.0.1:")
        with TraceStore.connect(url, run="fg") as st:
            assert st.redis.config_get("appendonly")["appendonly"] == "yes"
            assert st.redis.config_get("bind")["bind"] == "0.0.0.0"
        with pytest.raises(StorageError, match="authentication failed"):
            TraceStore.connect(url.replace(":pw@", ""), run="fg", retries=0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert any(data.glob("appendonly*"))  # kept: the caller's directory
    finally:
        _stop(proc)


def test_server_runs_in_foreground_until_ctrl_c() -> None:
    proc = subprocess.Popen([*BIN, "server"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("redis://127.0.0.1:")
        with TraceStore.connect(url, run="fg") as st:
            assert st.ping()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read() if proc.stderr else ""
        assert "stopped" in err
        data_dir = err.split("# data dir ", 1)[1].split(";", 1)[0]
        assert not Path(data_dir).exists()
        time.sleep(0.2)
        with pytest.raises(StorageError):
            TraceStore.connect(url, run="fg", retries=0, connect_timeout_s=1)
    finally:
        _stop(proc)


def _gone(pid: int, timeout_s: float = 20.0) -> bool:
    """Wait until ``pid`` has ended (a zombie counts as ended); False if it outlives the wait."""
    deadline = time.monotonic() + timeout_s
    while default_server._pid_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_killed_foreground_server_takes_its_server_process_with_it() -> None:
    """`kill -9` of `tracestore server` ends its valkey-server too (issue 31 item 7): the port
    is free again and the next `tracestore server --port` on it starts."""
    port = free_port()
    proc = subprocess.Popen([*BIN, "server", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    server_pid = 0
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url == f"redis://127.0.0.1:{port}", url
        with TraceStore.connect(url, run="fg") as st:
            server_pid = int(st.redis.info("server")["process_id"])
        assert server_pid != proc.pid and default_server._pid_running(server_pid)
        proc.kill()  # SIGKILL: no cleanup runs in the parent
        proc.wait(timeout=20)
        assert _gone(server_pid), f"valkey-server {server_pid} outlived its tracestore server"
        assert port_is_free(port)
    finally:
        _stop(proc)
        if server_pid and default_server._pid_running(server_pid):
            os.kill(server_pid, signal.SIGKILL)  # ours: left behind by the failure above
    again = subprocess.Popen([*BIN, "server", "--port", str(port)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert again.stdout is not None
        assert again.stdout.readline().strip() == f"redis://127.0.0.1:{port}"
    finally:
        _stop(again)


def test_a_port_held_by_a_server_left_running_is_named_with_its_pid() -> None:
    """A server left on the port (here one started on its own, as an orphan of an older
    version would be) is named in the one-line error with its pid and how to stop it."""
    with EmbeddedServer() as left:
        assert left.proc is not None
        res = subprocess.run([*BIN, "server", "--port", str(left.port)], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 1, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert f"port {left.port}" in lines[0] and "already in use" in lines[0]
        assert f"valkey-server pid {left.proc.pid}" in lines[0] and f"kill {left.proc.pid}" in lines[0]
        assert left.client().ping()  # named, never touched
