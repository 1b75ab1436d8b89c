"""The docs stand on their own, and their sample outputs are what the commands print.

* Every doc cites the design as ``docs/design.md`` section N (a file of the
  repository), every section cited exists there, and every relative link of
  the docs names a file that exists.
* Each sample session of ``tracestore`` commands in the docs (a ``console``
  or ``sh`` block of ``$ tracestore ...`` lines and their output) is run
  again: a scenario builds the state the doc describes on a server of its
  own, each command runs as a real process, and its output is compared with
  the block once both are normalised (addresses, times, ages, random ids,
  byte sizes, table padding). ``TRACESTORE_UPDATE_DOCS=1 pytest
  tests/test_docs.py`` rewrites the blocks with the real output (the
  server's address shown as the doc's), to be read and committed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tracestore import TraceStore
from tracestore.run import server_ms
from tracestore.servers import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
DESIGN = ROOT / "docs" / "design.md"


# -- the docs stand on their own ------------------------------------------------------------


def test_docs_cite_the_design_in_the_repository() -> None:
    """34 lines cited "DESIGN §...", a file the repository did not have."""
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", DESIGN.read_text(), re.M)}
    assert sections == set(range(1, 18)), sections
    cited: list[tuple[str, int]] = []
    for doc in DOCS:
        text = doc.read_text()
        assert "DESIGN" not in text and "§" not in text, f"{doc.relative_to(ROOT)} cites a design it does not have"
        for m in re.finditer(r"design\.md\)? sections? (\d+)(?:(?:-| and )(\d+))?", text):
            cited += [(doc.name, int(n)) for n in m.groups() if n]
    assert cited, "no doc cites docs/design.md"
    missing = [(d, n) for d, n in cited if n not in sections]
    assert not missing, missing


def test_relative_links_of_the_docs_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


# -- sample outputs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """A doc's blocks that start with the lines ``firsts``, and the scenario that builds their state.

    ``setup(url)`` returns the run the commands default to (``$TRACESTORE_RUN``),
    or None when they name it or the server holds one run. The blocks run in
    the order given, on the same state (``redis-cli`` lines run the bundled
    ``tracestore redis-cli``). ``shown_url`` is the address the doc shows for
    the server (the update writes it there).
    """

    doc: str
    firsts: tuple[str, ...]
    setup: Callable[[str], str | None]
    shown_url: str = "redis://127.0.0.1:6379"


def _wait_past(store: TraceStore, deadline_ms: int) -> None:
    """Until the server clock is past ``deadline_ms`` (the state the sample needs)."""
    end = time.monotonic() + 30
    while store.run(server_ms(store.context)) <= deadline_ms:
        assert time.monotonic() < end
        time.sleep(0.01)


def _gate_walk(url: str) -> str:
    """docs/gate.md: a worker died with a request in flight while the weights were at version 1."""
    with TraceStore.connect(url, run="gatedemo") as st:
        with st.gate.weight_update(version=1, drain_timeout_s=5):
            pass
        lease = st.gate.admit("s-9", "worker-2", 0.05)
        _wait_past(st, lease.deadline_ms)
    return "gatedemo"


def _routes(url: str) -> str:
    """docs/gate.md: three sessions routed over three entrypoints, the first retired."""
    with TraceStore.connect(url, run="routedemo") as st:
        router = st.router(["ep-a", "ep-b", "ep-c"])
        for sid in ("c-1", "c-2", "c-3"):
            router.acquire(sid)
        router.retire(["c-1"])
    return "routedemo"


def _sessions_and_gc(url: str) -> str:
    """docs/ownership.md: rollout:0 holds s-3 (no heartbeat); rollout:1 was declared lost."""
    with TraceStore.connect(url, run="owndemo") as st:
        st.open_session("s-3", "rollout:0")
        beat = st.heartbeat("rollout:1", 0.05)
        st.open_session("s-4", "rollout:1")
        _wait_past(st, beat.deadline_ms)
        assert st.gc().owners_lost == ("rollout:1",)
    return "owndemo"


def _runs(url: str) -> None:
    """docs/operating.md: one run, `shared`, whose owner rollout:0 is alive."""
    with TraceStore.connect(url, run="shared") as st:
        st.open_session("s-1", "rollout:0")
        st.heartbeat("rollout:0", 600)
    return None


def _trace(url: str) -> None:
    """docs/traces.md: the worked example's three record_turn calls, as the doc gives them."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "traces.md").read_text(), re.S)
    code = next(b for b in blocks if 'run="docdemo"' in b)
    code = code.replace('"redis://127.0.0.1:6379"', repr(url))
    env: dict[str, object] = {}
    exec(compile(code, "docs/traces.md", "exec"), env)  # noqa: S102 - our own doc
    store = env["store"]
    assert isinstance(store, TraceStore)
    store.close()
    return None


DEFAULT_SERVER = "unix:///tmp/ops-walk/home/server/server.sock"  # as docs/operating.md shows it
SAMPLES = [
    Sample("docs/gate.md", ("$ tracestore gate seal",), _gate_walk),
    Sample("docs/gate.md", ("$ tracestore routes c-1 c-2 c-3 c-9",), _routes),
    Sample("docs/ownership.md", ("$ tracestore sessions",), _sessions_and_gc),
    Sample("docs/operating.md", ("$ tracestore runs",), _runs, DEFAULT_SERVER),
    Sample("docs/operating.md", ("$ tracestore run delete shared",), _runs, DEFAULT_SERVER),
    Sample(
        "docs/traces.md",
        ("$ tracestore trace chat-1 --run docdemo", "$ redis-cli --scan --pattern 'ts:{docdemo/*'"),
        _trace,
    ),
]


def _block(text: str, first: str) -> tuple[int, int]:
    """(start, end) offsets of the body of the fenced block whose first line is ``first``."""
    for m in re.finditer(r"^```(?:console|sh)\n(.*?)^```$", text, re.S | re.M):
        if m.group(1).startswith(first + "\n"):
            return m.start(1), m.end(1)
    raise AssertionError(f"no block starting with {first!r}")


def _steps(body: str) -> list[tuple[str, str]]:
    """The ``(command line, output)`` pairs of a block."""
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line, []))
        else:
            steps[-1][1].append(line)
    return [(cmd, "\n".join(out)) for cmd, out in steps]


_RULES = [
    (re.compile(r"(?:redis|rediss|unix)(?:\+cluster)?://[^\s,;)']+"), "<url>"),
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"), "<time>"),
    (re.compile(r"\b\d{10}\.\d{1,6}\b"), "<epoch>"),
    (re.compile(r"\b1\d{12}\b"), "<ms>"),
    (re.compile(r"\b[0-9a-f]{32}\b"), "<id>"),
    (re.compile(r"\b[0-9a-f]{16}\b"), "<id16>"),
    (re.compile(r"\b[0-9a-f]{8}\b"), "<wid>"),
    (re.compile(r"[+-]?\d+(?:\.\d+)? ?(?:ms|s|min|h|d)\b"), "<dur>"),
    (re.compile(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)\b"), "<bytes>"),
    (re.compile(r"-{3,}"), "---"),
    (re.compile(r"[ \t]+"), " "),
]


def _normal(text: str) -> str:
    for rule, to in _RULES:
        text = rule.sub(to, text)
    return "\n".join(line.strip() for line in text.strip().splitlines())


def _run(cmd: str, url: str, run: str | None) -> str:
    """A block's command line, as a shell runs it (pipes and comments too), on ``url``."""
    line = cmd[2:]
    tool = f"{shlex.quote(sys.executable)} -m tracestore.cli"
    if line.startswith("tracestore "):
        line = f"{tool} {line[len('tracestore '):]}"
    elif line.startswith("redis-cli "):
        rest = line[len("redis-cli "):]
        tty = "" if rest.startswith(("--raw", "--scan")) else "--no-raw "  # replies as a terminal shows them
        line = f"{tool} redis-cli {tty}{rest}"
    else:
        raise AssertionError(f"a sample runs tracestore or redis-cli, not {cmd!r}")
    env = {k: v for k, v in os.environ.items() if k not in ("TRACESTORE_URL", "TRACESTORE_RUN")}
    env["TRACESTORE_URL"] = url
    if run is not None:
        env["TRACESTORE_RUN"] = run
    res = subprocess.run(
        ["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
        env=env,
    )
    return res.stdout.rstrip("\n")


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer().start()  # one per sample: `tracestore runs` shows only its runs
    yield srv
    srv.stop()


@pytest.mark.parametrize("sample", SAMPLES, ids=[f"{s.doc}:{s.firsts[0][2:]}" for s in SAMPLES])
def test_doc_samples_are_what_the_commands_print(sample: Sample, server: EmbeddedServer) -> None:
    """docs/gate.md's `gate status` sample was stale (raw milliseconds, Python-API advice in
    the error, the wrong default run); each sample is now the commands' real output."""
    path = ROOT / sample.doc
    run = sample.setup(server.url)
    for first in sample.firsts:
        text = path.read_text()
        start, end = _block(text, first)
        got = [(cmd, _run(cmd, server.url, run)) for cmd, _ in _steps(text[start:end])]
        if os.environ.get("TRACESTORE_UPDATE_DOCS"):
            body = "".join(f"{cmd}\n" + (f"{out}\n" if out else "") for cmd, out in got)
            path.write_text(text[:start] + body.replace(server.url, sample.shown_url) + text[end:])
            continue
        want = [(cmd, _normal(out)) for cmd, out in _steps(text[start:end])]
        assert [(cmd, _normal(out)) for cmd, out in got] == want, first
