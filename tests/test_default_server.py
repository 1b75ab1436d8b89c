"""The default server: one per machine and user, shared by every process (DESIGN section 12).

Each test points ``TRACESTORE_HOME`` at a directory of its own, so it starts,
finds and stops a default server nobody else uses. Processes are real
(``python -c``), so what is shared is what two users' shells would share.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from tests.test_servers import _alive
from tracestore import TraceStore, default_server
from tracestore.cli import main

CONNECT = (
    "import sys, tracestore\n"
    "st = tracestore.connect(run=sys.argv[1])\n"
    "print(st.url, st.redis.info('server')['process_id'], flush=True)\n"
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private TRACESTORE_HOME for this test; its default server is stopped at the end."""
    d = tmp_path / "home"
    monkeypatch.setenv("TRACESTORE_HOME", str(d))
    yield d
    default_server.stop()


def _connect_in_process(run: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CONNECT, run], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_two_processes_without_url_share_one_store(home: Path) -> None:
    url_a, pid_a = _connect_in_process("shared")
    url_b, pid_b = _connect_in_process("shared")
    assert (url_a, pid_a) == (url_b, pid_b)
    assert url_a == f"unix://{home}/server/server.sock"
    # what one process wrote, the next one (and the CLI) reads without a URL
    with TraceStore.connect(run="shared") as st:
        st.open_session("s-1", "rollout:0")
    code = "import tracestore; print(tracestore.connect(run='shared').owner_of('s-1'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "rollout:0", res.stderr
    r = CliRunner().invoke(main, ["sessions"])  # the only run on the server
    assert r.exit_code == 0, r.output
    assert "rollout:0" in r.output
    r = CliRunner().invoke(main, ["runs"])  # every run of the server
    assert r.exit_code == 0, r.output
    row = next(ln for ln in r.output.splitlines() if ln.startswith("shared "))
    assert re.search(r"ago\)\s+1\s+rollout:0\s", row), row  # created, live sessions, owners
    # the server outlives the processes that used it, and is private to the user
    assert _alive(pid_a)
    assert (home / "server").stat().st_mode & 0o777 == 0o700
    assert (home / "server" / "server.sock").stat().st_mode & 0o077 == 0


def test_concurrent_first_starts_start_one_server(home: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", CONNECT, f"r{i}"], stdout=subprocess.PIPE, text=True)
        for i in range(6)
    ]
    outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1, outs
    pid = int(outs.pop().split()[1])
    found = subprocess.run(["pgrep", "-f", f"{home}/server"], capture_output=True, text=True).stdout.split()
    assert found == [str(pid)]


def test_stale_pid_file_is_replaced_and_status_stop_report_it(home: Path) -> None:
    first = default_server.ensure()
    os.kill(first.pid, signal.SIGKILL)  # a crash leaves server.json and the socket behind
    deadline = time.monotonic() + 10
    while default_server.find() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    st = default_server.status()
    assert not st.running and "stale" in st.detail
    r = CliRunner().invoke(main, ["server", "status"])
    assert r.exit_code == 1 and "stale pid file" in r.output

    url, pid = _connect_in_process("after-crash")
    assert pid != first.pid and url == first.url
    doc = orjson.loads((home / "server" / "server.json").read_bytes())
    assert doc["pid"] == pid

    r = CliRunner().invoke(main, ["server", "status", "--json"])
    assert r.exit_code == 0, r.output
    status = orjson.loads(r.output)
    assert status["running"] and status["pid"] == pid and status["keys"] >= 1
    r = CliRunner().invoke(main, ["server", "stop"])
    assert r.exit_code == 0 and f"pid {pid}" in r.output
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert not (home / "server" / "server.json").exists()
    r = CliRunner().invoke(main, ["server", "stop"])  # idempotent
    assert r.exit_code == 0 and "nothing to stop" in r.output


def test_a_pid_file_naming_another_process_is_stale(home: Path) -> None:
    """A recorded pid reused by an unrelated process is never signalled."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        d = home / "server"
        d.mkdir(parents=True, mode=0o700)
        (d / "server.json").write_bytes(orjson.dumps({
            "pid": sleeper.pid, "url": f"unix://{d}/server.sock", "binary": "valkey-server",
            "dir": str(d), "started_ms": 0,
        }))
        assert default_server.stop() is None
        assert sleeper.poll() is None  # not killed
        info = default_server.ensure()
        assert info.pid != sleeper.pid and default_server.find() == info
    finally:
        sleeper.kill()
        sleeper.wait()


def test_long_state_dir_falls_back_to_a_password_protected_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / ("x" * 90)
    monkeypatch.setenv("TRACESTORE_HOME", str(d))
    try:
        info = default_server.ensure()
        assert info.url.startswith("redis://:") and "@127.0.0.1:" in info.url
        assert "***" in info.display_url
        with TraceStore.connect(run="tcp") as st:
            assert st.ping()
        port = info.url.rsplit(":", 1)[1]
        with pytest.raises(Exception, match="authentication failed"):
            TraceStore.connect(f"redis://127.0.0.1:{port}", run="tcp", retries=0)
    finally:
        default_server.stop()


def test_a_lost_default_server_is_replaced_with_one_notice(home: Path) -> None:
    """The default server's restart is announced (issue 31 item 7): the process that starts a
    new default server where one had been running says so on stderr, once; a first start,
    the processes after it and a start after `tracestore server stop` say nothing."""
    first = subprocess.run([sys.executable, "-c", CONNECT, "r"], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and "default server" not in first.stderr, first.stderr
    pid = int(first.stdout.split()[1])
    os.kill(pid, signal.SIGKILL)  # a crash: server.json stays, the server and its data are gone
    deadline = time.monotonic() + 10
    while default_server.find() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = [
        subprocess.Popen([sys.executable, "-c", CONNECT, f"r{i}"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o.split()[1] for o, _ in outs}) == 1  # one new server for all of them
    notices = [ln for _, err in outs for ln in err.splitlines() if "default server" in ln]
    assert notices == [default_server.RESTART_NOTICE.format(pid=pid)], outs
    assert "--appendonly" in notices[0] and "its data with it" in notices[0]
    later = subprocess.run([sys.executable, "-c", CONNECT, "r"], capture_output=True, text=True, timeout=60)
    assert later.returncode == 0 and later.stderr == "", later.stderr
    r = CliRunner().invoke(main, ["server", "stop"])  # a deliberate stop is not a loss
    assert r.exit_code == 0, r.output
    after = subprocess.run([sys.executable, "-c", CONNECT, "r"], capture_output=True, text=True, timeout=60)
    assert after.returncode == 0 and after.stderr == "", after.stderr
