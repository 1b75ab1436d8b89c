"""``tracestore train`` as a person runs it: Ctrl-C, a resume that resumes, a store that goes away.

The runs are real (Ray, torch, real servers). The first run of each test is
started through :func:`tracestore.cli.train.train_command` in a subprocess
with the small configuration of the other trainer tests (options that only
Python can set), in a session of its own so that SIGINT reaches its whole
process group as Ctrl-C in a terminal does; the resume is the real command
line, with no --url and no --mode: both must come from the checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._dump import dump_run
from tests.test_trainer_e2e import FAST
from tracestore import TraceStore, default_server
from tracestore.runlock import read_run_lock
from tracestore.servers import EmbeddedServer

pytestmark = pytest.mark.ray

#: The other trainer tests' small configuration (steps and checkpoints set per test).
SMALL: dict[str, Any] = {
    **{k: v for k, v in FAST.items() if k not in ("steps", "checkpoint_every")},
    "lease_ttl_s": 2.0,
}


def _start(tmp: Path, **opts: Any) -> subprocess.Popen[str]:
    """``train_command(**opts)`` in a new process session (stdout: one line per step)."""
    code = (
        "import json, sys\n"
        "from tracestore.cli.train import train_command\n"
        "train_command(**json.loads(sys.argv[1]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRACESTORE_URL"}
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps({**SMALL, **opts})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        cwd=tmp, env=env,
    )


def _wait_for_step(proc: subprocess.Popen[str], step: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"step {step:>3}"):
            return
    raise AssertionError(f"the run ended before step {step}: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}")


def test_ctrl_c_then_resume_keeps_mode_and_url_of_a_disaggregated_cluster_run(
    cluster_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = _start(tmp_path, mode="disaggregated", url=cluster_url, steps=3, checkpoint_every=1,
                  out=str(out))
    try:
        _wait_for_step(proc, 2)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(
        r"interrupted at step (\d+); resume with: tracestore train --resume --out (\S+)"
        r"( \(from the checkpoint of step \d+\))?",
        last,
    )
    assert m is not None, err
    assert int(m.group(1)) >= 2 and m.group(2) == str(out)
    assert "Traceback" not in err

    # a flag that disagrees with the checkpoint is refused, naming both values
    bad = subprocess.run(
        [sys.executable, "-m", "tracestore.cli", "train", "--resume", "--out", str(out),
         "--mode", "colocated"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2
    assert "--mode 'colocated' disagrees with the checkpoint, which ran with 'disaggregated'" in bad.stderr

    # the printed command, as printed: no --url, no --mode
    argv = shlex.split(last.split("resume with: ", 1)[1].split(" (from", 1)[0])
    assert argv[:3] == ["tracestore", "train", "--resume"]
    res = subprocess.run(
        [sys.executable, "-m", "tracestore.cli", *argv[1:]],
        capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "TRACESTORE_URL"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "train disaggregated" in res.stderr  # the progress bar names the mode it runs
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "disaggregated" and report["resumed_from_step"] >= 1
    assert [h["step"] for h in report["history"]] == [1, 2, 3]
    assert report["sessions_leaked"] == 0 and report["release_events"] == report["sessions_opened"]
    # it ran on the cluster of the checkpoint, not on this user's default server
    with TraceStore.connect(cluster_url, run=report["run"], create_run=False) as st:
        assert st.cluster and st.run_id in st.run_ids() and st.sessions() == []
    found = default_server.find()
    if found is not None:
        with TraceStore.connect(found.url, run="probe", create_run=False) as st:
            assert report["run"] not in st.run_ids()


def _until(proc: subprocess.Popen[str], when: str) -> str:
    """Wait until the run is at ``when``; return what it wrote to stderr meanwhile."""
    if when == "mid-run":
        _wait_for_step(proc, 2)
        return ""
    assert proc.stderr is not None
    head = []
    for line in proc.stderr:  # "at start": the store answered, the roles are starting
        head.append(line)
        if line.startswith("# run"):
            break
    return "".join(head)


@pytest.mark.parametrize("when", ["mid-run", "at start"])
def test_store_lost_is_one_line_with_the_url_and_never_blamed_on_a_role(tmp_path: Path, when: str) -> None:
    """The server dies after step 2, or while the roles start (a role then dies of it, its calls
    failing): either way the run ends as store-unreachable (exit 3, one line), not as a lost
    role (exit 4), and mid-run the line gives the resume command."""
    srv = EmbeddedServer().start()
    out = tmp_path / "out"
    proc = _start(tmp_path, mode="colocated", url=srv.url, steps=6, checkpoint_every=1, out=str(out))
    try:
        head = _until(proc, when)
        srv.kill()
        _, rest = proc.communicate(timeout=300)
        err = head + rest
    finally:
        srv.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: store unreachable at {srv.url}"), err
    assert " was lost " not in lines[0]  # (the RoleLost message)
    assert "Traceback" not in err and "RayTaskError" not in err and "StorageError" not in err
    if when == "mid-run":
        assert re.fullmatch(
            rf"error: store unreachable at {re.escape(srv.url)} after step \d+ \(Connection refused\); "
            rf"once it is back, resume with: tracestore train --resume --out {re.escape(str(out))}",
            lines[0],
        ), lines[0]


def test_durability_options_are_checked_against_the_server_before_the_run(
    standalone_url: str, tmp_path: Path
) -> None:
    """``--durability replicas`` on a server without replicas: exit 2, one line, no run written."""
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "tracestore.cli", "train", "--url", standalone_url, "--run", "dur-refused",
         "--durability", "replicas", "--durability-replicas", "2", "--steps", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert re.fullmatch(r"error: durability='replicas' needs 2 replica\(s\) per primary, but \S+ has 0 "
                        r"connected; .*", lines[-1]), res.stderr
    assert "Traceback" not in res.stderr
    with TraceStore.connect(standalone_url, run="dur-refused", create_run=False) as st:
        assert st.redis.keys(f"{st.keys.prefix}:{{dur-refused*") == []
    bad = subprocess.run(
        [sys.executable, "-m", "tracestore.cli", "train", "--url", standalone_url, "--steps", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRACESTORE_DURABILITY_TIMEOUT_S": "soon"},
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == "error: $TRACESTORE_DURABILITY_TIMEOUT_S='soon' is not a number"


def _cli_train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``tracestore train ARGS`` as a person runs it (no $TRACESTORE_URL)."""
    return subprocess.run(
        [sys.executable, "-m", "tracestore.cli", "train", *args],
        capture_output=True, text=True, timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "TRACESTORE_URL"},
    )


def test_resume_says_it_restored_the_store_and_a_finished_run_is_left_alone(
    standalone_url: str, tmp_path: Path
) -> None:
    """A run crashes after the checkpoint of step 1 and the server loses it: `--resume` says
    that it restored the run from the checkpoint's store file, and finishes. `--resume` of
    the finished run then says so and changes nothing: before, it ran for 21 s, exited 0,
    printed `steps/s 0`, `turns 0` and a share of 96628100.0%, and overwrote report.json."""
    out = tmp_path / "out"
    proc = _start(tmp_path, mode="colocated", url=standalone_url, steps=2, checkpoint_every=1,
                  crash_after_step=1, out=str(out))
    _, err = proc.communicate(timeout=600)
    assert "SimulatedCrash" in err, err[-3000:]
    run_id = json.loads((out / "ckpt" / "state.json").read_text())["cfg"]["run"]
    with TraceStore.connect(standalone_url, run=run_id, create_run=False) as st:
        st.delete_run(force=True)  # the server lost the run

    res = _cli_train("--resume", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    restored = [ln for ln in res.stderr.splitlines() if ln.startswith("# the server had lost run")]
    assert len(restored) == 1, res.stderr[-3000:]
    assert restored[0].startswith(
        f"# the server had lost run {run_id}: restored it from {out}/ckpt/store.ckpt (checkpoint of step 1: "
    ), restored
    report = (out / "report.json").read_bytes()
    rep = json.loads(report)
    assert rep["store_restored"] and rep["resumed_from_step"] == 1
    assert [h["step"] for h in rep["history"]] == [1, 2]
    assert 0 <= rep["tracestore_time_share"] <= 1
    mtime = (out / "report.json").stat().st_mtime_ns
    with TraceStore.connect(standalone_url, run=run_id, create_run=False) as st:
        before = dump_run(st)
        assert st.run(read_run_lock(st.context)) is None  # released when the run ended

    done = _cli_train("--resume", "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"run {run_id} already finished at step 2: nothing to resume, nothing changed (report: "
        f"{out}/report.json); to train further: tracestore train --resume --out {out} --steps N (N > 2)\n"
    )
    assert "# run" not in done.stderr  # it started nothing
    assert (out / "report.json").read_bytes() == report and (out / "report.json").stat().st_mtime_ns == mtime
    with TraceStore.connect(standalone_url, run=run_id, create_run=False) as st:
        assert dump_run(st) == before


def test_a_second_trainer_of_a_run_is_refused_naming_the_first(standalone_url: str, tmp_path: Path) -> None:
    """Two `tracestore train --run shared-1` a few seconds apart both ran: one died of
    StaleVersion, the other ended `invariants violated`, neither named the other. Now the
    second is refused at once (exit 2, one line naming the first's pid, host and start)
    and the first goes on; its lock is released when it ends."""
    run_id = f"shared-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    first = _start(tmp_path, mode="colocated", url=standalone_url, run=run_id, steps=40,
                   checkpoint_every=40, out=str(tmp_path / "a"))
    try:
        _until(first, "at start")  # "# run ..." is printed once the run's lock is held
        second = _cli_train("--url", standalone_url, "--run", run_id, "--steps", "1",
                            "--out", str(tmp_path / "b"), timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stdout == "" and len(second.stderr.splitlines()) == 1, second.stderr
        assert re.fullmatch(
            rf"error: run {re.escape(run_id)} is being trained by tracestore train \(pid {first.pid} on "
            rf"{re.escape(socket.gethostname())}, since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it to end, "
            r"or train another run \(--run NEW\)\n",
            second.stderr,
        ), second.stderr
        assert not (tmp_path / "b" / "ckpt").exists()
        assert first.poll() is None  # the first one goes on
        with TraceStore.connect(standalone_url, run=run_id, create_run=False) as st:
            lock = st.run(read_run_lock(st.context))
            assert lock is not None and lock.pid == first.pid
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 130
    with TraceStore.connect(standalone_url, run=run_id, create_run=False) as st:
        assert st.run(read_run_lock(st.context)) is None
