"""``tracestore replay stats`` and ``tracestore checkpoint save|load`` (CliRunner, real server)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import orjson
from click.testing import CliRunner

from tracestore import TraceStore
from tracestore.cli import main
from tracestore.replay import Group


def _fill(st: TraceStore) -> None:
    for i in range(3):
        sids = [f"g{i}.a", f"g{i}.b"]
        st.open_sessions(sids, "rollout:0")
        st.replay.put(Group(f"g{i}", "math", tuple(sids), min_version=4 + i, payload={"r": i}), "rollout:0")
    st.open_sessions(["x.a"], "rollout:0")
    st.replay.put(Group("x", "code", ("x.a",), status="aborted", min_version=2), "rollout:0")


def test_replay_stats(standalone_url: str) -> None:
    run, other = f"t-{uuid.uuid4().hex[:12]}", f"t-{uuid.uuid4().hex[:12]}"
    TraceStore.connect(standalone_url, run=other).close()  # the server holds a run whatever ran before
    r = CliRunner().invoke(main, ["replay", "stats", "--url", standalone_url, "--run", run])
    assert r.exit_code == 2, r.output  # an unknown run is an error, not an empty table
    assert f"no run {run!r} on {standalone_url}; runs there:" in r.output
    with TraceStore.connect(standalone_url, run=run) as st:
        r = CliRunner().invoke(main, ["replay", "stats", "--url", standalone_url, "--run", run])
        assert r.exit_code == 0, r.output
        assert "empty" in r.output
        _fill(st)
    r = CliRunner().invoke(main, ["replay", "stats", "--run", run], env={"TRACESTORE_URL": standalone_url})
    assert r.exit_code == 0, r.output
    lines = {tuple(ln.split()[:4]) for ln in r.output.splitlines()}
    assert ("math", "completed", "3", "4") in lines
    assert ("code", "aborted", "1", "2") in lines
    assert ("code", "completed", "0", "-") in lines
    assert "total: 4 groups" in r.output
    r = CliRunner().invoke(main, ["replay", "stats", "--url", standalone_url, "--run", run, "--json", "--task", "math"])
    cells = orjson.loads(r.output)
    assert {(c["status"], c["groups"]) for c in cells} == {("completed", 3), ("aborted", 0), ("expired", 0)}
    assert next(c for c in cells if c["status"] == "completed")["bytes"] > 0


def test_checkpoint_save_and_load(standalone_url: str, tmp_path: Path) -> None:
    src, dst = f"t-{uuid.uuid4().hex[:12]}", f"t-{uuid.uuid4().hex[:12]}"
    with TraceStore.connect(standalone_url, run=src) as st:
        _fill(st)
    path = tmp_path / "c.tsck"
    r = CliRunner().invoke(main, ["checkpoint", "save", str(path), "--url", standalone_url, "--run", src])
    assert r.exit_code == 0, r.output
    assert "4 groups" in r.output and path.exists()
    r = CliRunner().invoke(main, ["checkpoint", "load", str(path), "--url", standalone_url, "--run", dst])
    assert r.exit_code == 0, r.output
    assert "4 groups" in r.output
    with TraceStore.connect(standalone_url, run=dst) as st:
        assert [g.gid for g in st.replay.groups("math")] == ["g0", "g1", "g2"]
        assert st.sessions("replay") == sorted(["g0.a", "g0.b", "g1.a", "g1.b", "g2.a", "g2.b", "x.a"])
    # loading into a run that is not empty fails with a readable message and exit code 1
    r = CliRunner().invoke(main, ["checkpoint", "load", str(path), "--url", standalone_url, "--run", dst])
    assert r.exit_code == 1
    assert "RunNotEmpty" in r.output


def test_replay_demo_section(standalone_url: str) -> None:
    r = CliRunner().invoke(main, ["demo", "--url", standalone_url, "--only", "replay"])
    assert r.exit_code == 0, r.output
    assert "['inflight0', 'inflight1']" in r.output
    assert "['done0', 'done1', 'done2', 'done3']" in r.output
    assert "took 0, ready=1" in r.output


def test_checkpoint_save_refuses_an_existing_file_unless_forced(standalone_url: str, tmp_path: Path) -> None:
    """A second `checkpoint save` to the same path silently overwrote it: now it is refused with
    one line naming the run the file holds, and the file is left as it was; --force replaces it."""
    first, second = f"t-{uuid.uuid4().hex[:12]}", f"t-{uuid.uuid4().hex[:12]}"
    with TraceStore.connect(standalone_url, run=first) as a, TraceStore.connect(standalone_url, run=second) as b:
        _fill(a)
        b.open_session("only", "rollout:0")
    path = tmp_path / "run.ckpt"

    def save(run: str, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tracestore.cli", "checkpoint", "save", str(path), "--url", standalone_url,
             "--run", run, *flags],
            capture_output=True, text=True, timeout=120,
        )

    assert save(first).returncode == 0
    kept = path.read_bytes()
    r = save(second)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        f"error: {path} exists (a checkpoint of run {first!r}); add --force to overwrite it, or give "
        "another PATH\n"
    )
    assert path.read_bytes() == kept
    r = save(second, "--force")
    assert r.returncode == 0, r.stderr
    assert f"saved run {second!r}" in r.stdout and orjson.loads(path.read_bytes().split(b"\n")[0])["run"] == second
