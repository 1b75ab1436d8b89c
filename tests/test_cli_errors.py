"""Snapshot of every CLI error a person commonly meets: one line each, exit code, no traceback.

The expected text lives in ``tests/snapshots/cli_errors.txt`` (addresses and
paths replaced by ``{placeholders}``). A change of wording shows up as a diff
of that file; ``TRACESTORE_UPDATE_SNAPSHOTS=1 pytest tests/test_cli_errors.py``
rewrites it, to be read and committed with the change.

The servers are private to this module (their runs are known), and one
cluster has a primary killed so that ``ping`` must notice it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracestore import TraceStore
from tracestore.cli import main
from tracestore.demo import section_name, sections
from tracestore.servers import EmbeddedServer, LocalCluster

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "cli_errors.txt"

#: (what a person tried, argv with {placeholders})
CASES: list[tuple[str, str]] = [
    ("a URL with a scheme tracestore does not speak", "ping --url http://{standalone}"),
    ("a cluster URL for a standalone server", "ping --url redis+cluster://{standalone}"),
    ("TLS against a plain server", "ping --url rediss://{standalone}"),
    ("nothing listens there", "ping --url redis://127.0.0.1:1"),
    ("a port out of range in the URL", "ping --url redis://127.0.0.1:80000"),
    ("a primary of the cluster is down", "ping --url redis+cluster://{cluster}"),
    ("a port out of range for the server", "server --port 80000"),
    ("a host that is not this machine", "server --host nosuch.invalid"),
    ("a foreground option given to a subcommand", "server --port 7000 stop"),
    ("several runs and no --run", "sessions --url redis://{standalone}"),
    ("a run that does not exist", "gate status --url redis://{standalone} --run nosuch"),
    ("a run id that cannot exist", "replay stats --url redis://{standalone} --run a/b"),
    ("a key prefix that cannot exist", "info --url redis://{standalone} --prefix a/b"),
    ("an owner tag that cannot exist", "sessions --url redis://{standalone} --run alpha --owner a{{b}}"),
    ("a session id that cannot exist", "trace a}}b --url redis://{standalone} --run alpha"),
    ("a negative duration", "gc --url redis://{standalone} --run alpha --tombstone-retention -5"),
    ("a negative drain timeout", "gate drain --url redis://{standalone} --run alpha --timeout -1"),
    ("clear-poison of nothing", "gate clear-poison --resolution aborted --url redis://{standalone} --run alpha"),
    ("a run whose record is gone", "sessions --url redis://{standalone} --run orphaned"),
    ("delete a run whose record is gone", "run delete orphaned --url redis://{standalone}"),
    ("gc of a run whose record is gone", "gc --url redis://{standalone} --run orphaned"),
    ("save over an existing checkpoint", "checkpoint save {tmp}/beta.ckpt --url redis://{standalone} --run beta"),
    ("install while the gate is open", "gate install 1 --url redis://{standalone} --run alpha"),
    ("install an old version", "gate install 0 --url redis://{standalone} --run beta"),
    ("delete a run in use", "run delete alpha --url redis://{standalone}"),
    ("load a checkpoint into a run in use", "checkpoint load {tmp}/beta.ckpt --url redis://{standalone} --run alpha"),
    ("a demo section that does not exist", "demo --only nosuch --url redis://{standalone}"),
    ("redis-cli over TLS", "redis-cli --url rediss://{standalone} PING"),
    ("cluster status with no cluster", "cluster status --state-file {tmp}/none.json"),
    ("an unknown command", "sesions"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    srv = EmbeddedServer().start()
    cl = LocalCluster(primaries=3).start()
    try:
        with TraceStore.connect(srv.url, run="alpha") as a, TraceStore.connect(srv.url, run="beta") as b:
            a.open_session("s-1", "rollout:0")
            a.heartbeat("rollout:0", 600)
            with b.gate.weight_update(version=1, drain_timeout_s=5):
                pass
            b.checkpoint(tmp / "beta.ckpt")
        with TraceStore.connect(srv.url, run="orphaned") as o:  # keys left without the run's record
            o.open_session("s-1", "gateway")
            o.redis.delete(o.keys.meta)
        cl.servers[1].kill()
        yield {
            "standalone": f"127.0.0.1:{srv.port}",
            "cluster": f"127.0.0.1:{cl.servers[0].port}",
            "down": f"127.0.0.1:{cl.servers[1].port}",
            "tmp": str(tmp),
            "home": os.environ["TRACESTORE_HOME"],
            # the demo's sections change as features add theirs
            "sections": ", ".join(section_name(m) for m in sections()),
        }
    finally:
        cl.stop()
        srv.stop()


def _render(places: dict[str, str]) -> str:
    blocks = []
    for what, argv in CASES:
        r = CliRunner().invoke(main, argv.format(**places).split(), prog_name="tracestore")
        assert isinstance(r.exception, SystemExit), (argv, r.exception)  # never a traceback
        out = r.output
        for name, value in sorted(places.items(), key=lambda kv: -len(kv[1])):
            out = out.replace(value, "{" + name + "}")
        shown = argv.replace("{{", "{").replace("}}", "}")  # as typed: braces not doubled
        blocks.append(f"# {what}\n$ tracestore {shown}\nexit {r.exit_code}\n{out.rstrip()}\n")
    return "\n".join(blocks)




def test_cli_errors_match_the_snapshot(places: dict[str, str]) -> None:
    got = _render(places)
    if os.environ.get("TRACESTORE_UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(got)
    assert got == SNAPSHOT.read_text()
    for block in got.split("\n\n"):
        lines = block.splitlines()
        assert lines[2] != "exit 0", block
        assert len(lines) == 4 and lines[3].startswith("error: "), block  # one line each


#: A bad value of each option (and argument) of every command that takes one, beyond the
#: snapshot's: each is a usage error, exit 2, before anything changes (URLs and ids the library
#: refuses, durations it refuses, values out of range).
USAGE_ERRORS: list[str] = [
    "ping --url redis://127.0.0.1:0x",
    "ping --url redis://h:1/?socket_timeout=5",
    "info --url http://{standalone}",
    "runs --url unix://",
    "run delete a/b --url redis://{standalone}",
    "run delete alpha --url ftp://{standalone}",
    "gate status --url redis://{standalone} --run a/b",
    "gate seal --url redis://{standalone} --run alpha --retry-after-ms 0",
    "gate drain --url redis://{standalone} --run alpha --timeout nan",
    "gate install x --url redis://{standalone} --run alpha",
    "gate clear-poison a}}b --resolution aborted --url redis://{standalone} --run alpha",
    "gate clear-poison --all --resolution a{{b --url redis://{standalone} --run alpha",
    "routes a{{b --url redis://{standalone} --run alpha",
    "gc --url redis://{standalone} --run alpha --group-idle-limit -1",
    "gc --url redis://{standalone} --run alpha --event-retention inf",
    "gc --url redis://{standalone} --run alpha --tombstone-retention x",
    "sessions --url redis://{standalone} --run a/b",
    "trace s-1 --url redis://{standalone} --run alpha --node 0",
    "replay stats --url redis://{standalone} --run alpha --task a{{b",
    "checkpoint save {tmp}/x.ckpt --url redis://{standalone} --run a/b",
    "checkpoint load {tmp}/beta.ckpt --url redis://{standalone} --run a/b",
    "acl a/b",
    "acl alpha --prefix a/b",
    "acl alpha --role admin",
    "acl alpha --user a{{b",
    "gate install 99999999999999999999 --url redis://{standalone} --run alpha",
    "demo --url http://{standalone}",
    "redis-cli --url http://{standalone} PING",
    "cluster up --primaries 0 --state-file {tmp}/c.json",
    "cluster up --replicas -1 --state-file {tmp}/c.json",
    "server --port 0x",
    "train --steps 0 --url redis://{standalone}",
    "train --run a/b --url redis://{standalone}",
    "train --url http://{standalone}",
    "train --mode fast --url redis://{standalone}",
    "train --agents sdk --url redis://{standalone}",
    "train --workers 0 --url redis://{standalone}",
    "train --prompts-per-step 0 --url redis://{standalone}",
    "train --group-size 1 --url redis://{standalone}",
    "train --durability-timeout 0 --url redis://{standalone}",
    "train --worker-resources GPU --url redis://{standalone}",
    "gateway --engine http://127.0.0.1:1 --url redis://{standalone} --run a/b",
    "gateway --engine http://127.0.0.1:1 --url http://{standalone}",
    "gateway --engine http://127.0.0.1:1 --url redis://{standalone} --owner a{{b",
    "gateway --engine 127.0.0.1:1 --url redis://{standalone}",
    "gateway --engine http://127.0.0.1:1 --url redis://{standalone} --lease-ttl -1",
    "gateway --engine http://127.0.0.1:1 --url redis://{standalone} --port 70000",
    "engine --port 70000",
    "engine --weights {tmp}/none.pt",
]


#: Bad values with spaces or empty (argv lists, not split on whitespace).
USAGE_ERRORS_QUOTED: list[list[str]] = [
    ["gate", "status", "--url", "redis://{standalone}", "--run", "a b"],
    ["sessions", "--url", "redis://{standalone}", "--run", "alpha", "--owner", ""],
    ["trace", "a b", "--url", "redis://{standalone}", "--run", "alpha"],
    ["acl", "alpha", "--user", "a b"],  # it printed `ACL SETUSER a b ...`, a broken command
    ["acl", "alpha", "--password", ""],
    ["acl", "a b"],
]


def test_bad_option_values_are_usage_errors(places: dict[str, str]) -> None:
    """Every command's bad option values exit 2 with one line (not 1, as URLs, run ids and
    durations the library refused did)."""
    bad = []
    argvs = [a.format(**places).split() for a in USAGE_ERRORS]
    argvs += [[a.format(**places) for a in argv] for argv in USAGE_ERRORS_QUOTED]
    for argv in argvs:
        r = CliRunner().invoke(main, argv, prog_name="tracestore")
        assert isinstance(r.exception, SystemExit), (argv, r.exception)  # never a traceback
        lines = r.output.strip().splitlines()
        if r.exit_code != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
            bad.append(f"{argv}: exit {r.exit_code}: {r.output.strip()}")
    assert not bad, "\n".join(bad)


def test_errors_are_one_line_from_a_real_process(places: dict[str, str]) -> None:
    """The installed entry point, not just CliRunner: stderr is one line, stdout empty."""
    for argv, code in (
        (f"ping --url redis+cluster://{places['standalone']}", 2),
        ("server --port 80000", 2),
        (f"ping --url http://{places['standalone']}", 2),
        (f"gate status --url redis://{places['standalone']} --run a/b", 2),
        (f"gc --url redis://{places['standalone']} --run alpha --tombstone-retention -5", 2),
        (f"gc --url redis://{places['standalone']} --run orphaned", 1),
        ("ping --url redis://127.0.0.1:1", 1),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "tracestore.cli", *argv.split()],
            capture_output=True, text=True, timeout=60,
        )
        assert res.returncode == code, res.stderr
        assert res.stdout == "" and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("error: ")
