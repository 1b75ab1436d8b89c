"""Helpers of the gateway tests: real ``tracestore engine`` / ``tracestore gateway`` processes.

:class:`CliServer` runs one CLI command in a subprocess, waits for its
``listening on http://H:P`` line and stops it (SIGTERM, then SIGKILL);
:func:`dump_run` reads every key of a run with its value, so a test can check
that a refused request wrote nothing; :func:`lease_outcomes` reads the lease
records of one session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import orjson

from tests.test_checkpoint import _scan
from tracestore import TraceStore

BIN = [sys.executable, "-m", "tracestore.cli"]


@dataclass
class Reply:
    """A raw HTTP reply."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
    """One raw HTTP request (stdlib): for bodies no SDK would send."""
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


class CliServer:
    """``tracestore <args>`` as a subprocess serving HTTP on a free port."""

    def __init__(self, *args: str) -> None:
        self.args = list(args)
        self.url = ""
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def start(self, timeout_s: float = 180.0) -> CliServer:
        """Start and wait for the ``listening on`` line; raises RuntimeError with the output otherwise."""
        self.proc = subprocess.Popen(
            [*BIN, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or not self.url:
            self.stop()
            raise RuntimeError(f"{self.args[0]} did not start: {''.join(self.lines)[-3000:]}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("listening on "):
                self.url = line.split()[-1]
                self._ready.set()
        self._ready.set()

    def get(self, path: str, headers: dict[str, str] | None = None) -> Reply:
        """GET ``path`` of this server."""
        return http("GET", self.url + path, headers=headers)

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Reply:
        """POST ``body`` (bytes as they are, else JSON) to ``path`` of this server."""
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        return http("POST", self.url + path, raw, headers)

    def kill(self) -> None:
        """SIGKILL (an engine dying mid-request)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one Prometheus sample of this gateway (0.0 when absent)."""
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_metric(self, name: str, value: float, timeout_s: float = 30.0, **labels: str) -> float:
        """Wait until the metric is at least ``value``; returns it (fails the test on timeout)."""
        end = time.monotonic() + timeout_s
        while True:
            v = self.metric(name, **labels)
            if v >= value:
                return v
            if time.monotonic() > end:
                raise AssertionError(f"{name}{labels or ''} stayed at {v} for {timeout_s} s (waited for {value})")
            time.sleep(0.02)


class RunDump(dict[bytes, tuple[Any, bool]]):
    """A run's keys -> (DUMP value, has a TTL), taken at one moment (``seq`` orders dumps).

    Two dumps are equal when no key was written in between: every key of
    the later dump is in the earlier one with the same value, and a key of
    the earlier one may be missing from the later one only if it had a TTL
    (a lease receipt or op record of an earlier test that expired: the
    gateway fixture's run lives for the whole module, longer than op_ttl_s).
    """

    _next = 0

    def __init__(self, items: dict[bytes, tuple[Any, bool]]) -> None:
        super().__init__(items)
        RunDump._next += 1
        self.seq = RunDump._next

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunDump):
            return NotImplemented
        early, late = (self, other) if self.seq <= other.seq else (other, self)
        return all(early.get(k) == v for k, v in late.items()) and all(
            vol for k, (_, vol) in early.items() if k not in late
        )

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]


def dump_run(st: TraceStore) -> RunDump:
    """Every key of the run (control and data plane) with its DUMP value and whether it has a TTL
    (the heart-beat zsets by their members: a heart-beat between two dumps writes nothing new)."""
    r: Any = st.redis
    names = sorted(set(_scan(st, st.keys.control_pattern) + _scan(st, st.keys.data_pattern)))
    out: dict[bytes, tuple[Any, bool]] = {}
    for n in names:
        if n.endswith((b":owners", b":gate:holders")):  # heart-beats: their members, not their scores
            value = tuple(sorted(r.zrange(n, 0, -1)))
            if value:
                out[n] = (value, False)
            continue
        value = r.dump(n)
        if value is None:  # listed, then expired before its DUMP: as if not listed
            continue
        out[n] = (value, r.pttl(n) != -1)  # -2: expired since its DUMP, so it had a TTL
    return RunDump(out)


def lease_outcomes(st: TraceStore, sid: str) -> list[str | None]:
    """Outcomes of the leases admitted for ``sid`` (None: not settled), in settlement order
    (a settled lease keeps only its receipt: ``sid``, ``version``, ``outcome``, ``settled_ms``;
    the unsettled ones, by admission time, after them)."""
    r: Any = st.redis
    recs = []
    for name in _scan(st, st.keys.control_pattern):
        if b":gate:l:" not in name:
            continue
        h = {k.decode(): v.decode() for k, v in r.hgetall(name).items()}
        if h.get("sid") == sid:
            recs.append((0 if "settled_ms" in h else 1, int(h.get("settled_ms") or h.get("admitted_ms", 0)), h.get("outcome")))
    return [o for _, _, o in sorted(recs, key=lambda x: (x[0], x[1]))]


def settled_outcomes(st: TraceStore, sid: str, timeout_s: float = 30.0) -> list[str | None]:
    """:func:`lease_outcomes` once none is unsettled (or after ``timeout_s``): a gateway settles
    a completed turn's lease in the background after it answers, so right after the answer the
    last lease may not be settled yet (seen under the load of a parallel suite)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = lease_outcomes(st, sid)
        if None not in got or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


__all__ = ["CliServer", "Reply", "RunDump", "dump_run", "http", "lease_outcomes", "settled_outcomes"]
