"""The ``tracestore`` command line, run as a user would (real servers, real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracestore import StorageError, TraceStore
from tracestore.cli import main

BIN = [sys.executable, "-m", "tracestore.cli"]


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
    assert r.exit_code == 1
    assert "unsupported URL scheme" in r.output


def test_demo_against_a_server(standalone_url: str) -> None:
    r = CliRunner().invoke(main, ["demo", "--url", standalone_url, "--only", "basics"])
    assert r.exit_code == 0, r.output
    assert "reloaded on NOSCRIPT" in r.output
    assert "20000" in r.output


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
        if proc.poll() is None:
            proc.kill()
