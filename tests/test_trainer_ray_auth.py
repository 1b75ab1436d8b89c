"""Joining a Ray 2.60 cluster that uses token authentication by address (issue 29, item 2).

The cluster is started as a user starts one, with the ``ray start --head`` CLI
(:class:`tests._raycluster.CliHead`: free ports, its own temp dir, stopped by
its own process, never ``ray stop``). ``HOME`` points at a directory of the
test's own with ``~/.ray/auth_token`` in it, as on a machine where Ray has run
before: Ray 2.60 then turns token authentication on for the head. A driver
given an explicit address connects with authentication ``disabled`` unless
told otherwise, so before the fix ``tracestore train --ray-address
127.0.0.1:PORT`` ended with "cannot join the Ray cluster at ...: Failed to
connect to Ray cluster at <ip>:PORT" and no word of the token. Now it finds
the token as Ray's own ``auto`` does and the run trains; on a machine without
the token the one-line error says what to set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._raycluster import CliHead
from tests.test_train_cli import SMALL

pytestmark = pytest.mark.ray


def _home(root: Path, token: str | None) -> dict[str, str]:
    """The environment of a process on a machine whose ``~`` is ``root`` (with the token, if given)."""
    root.mkdir(parents=True, exist_ok=True)
    if token is not None:
        (root / ".ray").mkdir(exist_ok=True)
        (root / ".ray" / "auth_token").write_text(token)
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "TRACESTORE_URL")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "HOME": str(root)}


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CliHead, dict[str, str]]]:
    env = _home(tmp_path_factory.mktemp("head") / "home", uuid.uuid4().hex)
    h = CliHead(env)
    try:
        assert b"Token authentication is enabled" in h.log.read_bytes()  # what Ray 2.60 does here
        yield h, env
    finally:
        h.stop()


def _train(env: dict[str, str], cwd: Path, **opts: Any) -> subprocess.CompletedProcess[str]:
    """``tracestore train`` (its command body, with the small configuration of the other trainer
    tests) in a process of its own, run to its end."""
    code = (
        "import json, sys\n"
        "from tracestore.cli.train import train_command\n"
        "train_command(**json.loads(sys.argv[1]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, json.dumps({**SMALL, **opts})],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=600,
    )


def test_train_joins_a_token_auth_cluster_by_address(
    head: tuple[CliHead, dict[str, str]], standalone_url: str, tmp_path: Path
) -> None:
    h, env = head
    out = tmp_path / "out"
    r = _train(env, tmp_path, ray_address=h.address, url=standalone_url, out=str(out), steps=1,
               checkpoint_every=1, workers=1, run=f"t-{uuid.uuid4().hex[:10]}")
    assert r.returncode == 0, r.stderr[-3000:]
    # (an explicit address is only ever joined: the run cannot have started a Ray of its own)
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 1 and report["sessions_leaked"] == 0
    assert report["sessions_released"] == report["sessions_opened"] > 0
    assert len(set(report["placement"].values())) == 1  # the head, the cluster's only node
    assert "Token authentication" not in r.stderr  # Ray's notice is not the run's news


def test_a_join_without_the_token_says_what_to_set(
    head: tuple[CliHead, dict[str, str]], tmp_path: Path
) -> None:
    h, _ = head
    env = _home(tmp_path / "elsewhere", None)  # another machine: no ~/.ray/auth_token
    args = [sys.executable, "-m", "tracestore.trainer", "--ray-address", h.address, "--steps", "1",
            "--out", str(tmp_path / "out")]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    # Ray's core logs its own retries above it (a warning a second); the run's error is one line
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and r.stderr.splitlines()[-1] == lines[0], r.stderr[-3000:]
    token_file = f"{tmp_path}/elsewhere/.ray/auth_token"
    assert re.fullmatch(
        rf"error: cannot join the Ray cluster at '{re.escape(h.address)}': Failed to connect to Ray cluster "
        rf"at \S+:{h.port} \(a cluster with token authentication, as `ray start --head` starts one where "
        rf"a token exists, needs its token here: copy the head's ~/\.ray/auth_token to {re.escape(token_file)}, "
        r"or set RAY_AUTH_TOKEN to the output of `ray get-auth-token` on the head\)",
        lines[0],
    ), lines[0]
