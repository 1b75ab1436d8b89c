"""Two builds side by side: the code this benchmark runs from ("head") against a clean checkout of
``BENCH_BASE`` ("base", a git revision; default ``HEAD``: with a clean tree that is an A/A run,
which measures the noise), in alternating passes on one machine in one sitting.

``BENCH_BASE=REV python -m benchmarks ab [--quick]``. On these shared 2-core machines an absolute
CPU figure moves with the load by 30% or more from one minute to the next; a ratio of two
builds measured turn about is what a change can be judged by. Pairs run A B, then B A, and so
on (the order alternates, so a drift in the machine's load falls on both sides).

Two kinds of pass, each on the embedded server and on a local 3-primary cluster:

* **gateway**: one ``tracestore gateway`` process of the build (SGLang shape, default
  options) in front of the instant engine (``benchmarks/instant_engine.py``, one process for
  all passes, from head), a fresh store per pass; ``gateway_scale``'s light client (one
  aiohttp session, at most 512 requests in flight) warms it up (512 sessions x 2 turns), then
  a closed pass of N sessions x T turns (1,000 x 4; quick: 200 x 3). Figures: the gateway's and
  the store servers' CPU per turn (``/proc``), turns/s, errors.
* **library**: the synchronous client's turn path of the build (``lookup`` then
  ``record_turn``; the driver below runs in a process of its own on the build's code),
  sessions of 8 turns at ~8k tokens of context (48 sessions; quick: 16), the client thread's
  CPU per steady turn (``time.thread_time``, turns 2..8, after 16 sessions of warm-up), and
  the Python function calls per steady turn (``sys.setprofile``, on a second set of sessions:
  deterministic, so the one figure the load does not move).

The client, the engine and the drivers are head's for both builds: only the build's
``tracestore`` differs. Per figure the table gives base and head per pair, head / base per
pair, and the median ratio.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import orjson

from benchmarks.bench_gateway import _Proc
from benchmarks.bench_gateway_scale import (
    DOC_TOKENS,
    _closed,
    _cpu_s,
    _document,
    _Gateway,
    _raise_nofile,
    _sessions,
    _Store,
    _warm,
)

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("embedded", "cluster")

#: The library pass's driver, run with ``PYTHONPATH`` (and the working directory) set to one
#: build: it imports only that build's ``tracestore`` and the standard library. Prints one
#: JSON line: CPU microseconds per steady turn (lookup, record) and function calls per turn.
LIBRARY_DRIVER = r"""
import os, random, sys, time, json
from tracestore import TraceStore
url, sessions = sys.argv[1], int(sys.argv[2])
CONTEXT, TURNS, USER, OUT = 8192, 8, 64, 64

def piece(t):
    return " " + chr(97 + t % 26) + chr(97 + (t // 26) % 26) + chr(97 + (t // 676) % 26)

def session(seed):
    rng, sizes = random.Random(seed), random.Random(1000 + seed % 8)
    first = CONTEXT - TURNS * (USER + OUT) + USER
    text, turns = "", []
    for i in range(TURNS):
        n_user = first if i == 0 else sizes.randint(USER // 2, USER * 3 // 2)
        n_out = sizes.randint(OUT // 2, OUT * 3 // 2)
        delta = [rng.randrange(17_000) for _ in range(n_user)]
        out = [rng.randrange(17_000) for _ in range(n_out)]
        prompt = text + "".join(map(piece, delta)) + "<|assistant|>"
        response = "".join(map(piece, out)) + "<|end|>"
        turns.append((prompt, response, delta, out, [-rng.random() * 4 for _ in out]))
        text = prompt + response + "<|user|>"
    return turns

store = TraceStore.connect(url, run="ab-" + os.urandom(4).hex())
calls = [0]

def count(frame, event, arg):
    if event == "call" or event == "c_call":
        calls[0] += 1

def turn(sid, i, t, clock, profile=False):
    prompt, response, delta, out, lps = t
    c0 = time.thread_time()
    if profile:
        sys.setprofile(count)
    m = store.lookup(sid, prompt)
    c1 = time.thread_time()
    store.record_turn(sid, prompt, response, prefix=m, delta_token_ids=delta, response_token_ids=out,
                      response_logprobs=lps, version=i)
    if profile:
        sys.setprofile(None)
    c2 = time.thread_time()
    if i and clock is not None:
        clock[0] += c1 - c0
        clock[1] += c2 - c1
        clock[2] += 1

warm, timed = 16, sessions
clock = [0.0, 0.0, 0]
for s in range(warm + timed):
    for i, t in enumerate(session(s)):
        turn(f"s{s}", i, t, clock if s >= warm else None)
before = calls[0]
steady = 0
for s in range(warm + timed, warm + timed + 8):
    for i, t in enumerate(session(s)):
        turn(f"s{s}", i, t, None, profile=i > 0)
        steady += i > 0
store.close()
print(json.dumps({"lookup_us": 1e6 * clock[0] / clock[2], "record_us": 1e6 * clock[1] / clock[2],
                  "calls_per_turn": calls[0] / steady}))
"""


class _Build:
    """One build's ``tracestore``: head (this tree) or a clean worktree of ``rev``."""

    def __init__(self, name: str, rev: str | None, tmp: Path) -> None:
        self.name = name
        self.root = ROOT
        self.sha = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", rev or "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        self.label = f"{name} ({self.sha}{'' if rev else ' + working tree'})"
        if rev is not None:
            self.root = tmp / name
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(self.root), rev], check=True)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(self.root)}

    def remove(self) -> None:
        if self.root != ROOT:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(self.root)], check=False)


def _gateway_pass(build: _Build, kind: str, engine: _Proc, size: tuple[int, int], docs: list[str]) -> dict[str, Any]:
    store = _Store(kind)
    try:
        gw = _Gateway(engine.url, store.url, f"ab-{build.name}-{uuid.uuid4().hex[:6]}", "sglang", root=str(build.root))
        try:
            _warm([gw], docs)
            g0, s0 = _cpu_s(gw.pid), sum(map(_cpu_s, store.pids))
            tally, took = asyncio.run(_closed([gw.url], _sessions(size[0], docs, f"ab-{build.name}"), size[1]))
            g1, s1 = _cpu_s(gw.pid), sum(map(_cpu_s, store.pids))
        finally:
            gw.stop()
    finally:
        store.stop()
    done = max(1, len(tally.latency))
    return {
        "gateway_cpu_ms": round(1000 * (g1 - g0) / done, 3),
        "store_cpu_ms": round(1000 * (s1 - s0) / done, 3),
        "turns_per_s": round(len(tally.latency) / took, 1) if took else 0.0,
        "errors": sum(tally.errors.values()),
    }


def _library_pass(build: _Build, kind: str, sessions: int) -> dict[str, Any]:
    store = _Store(kind)
    try:
        out = subprocess.run(
            [sys.executable, "-c", LIBRARY_DRIVER, store.url, str(sessions)],
            capture_output=True, text=True, env=build.env(), cwd=str(build.root), timeout=900,
        )  # fmt: skip
    finally:
        store.stop()
    if out.returncode != 0:
        raise RuntimeError(f"the library driver of {build.label} failed: {out.stderr[-2000:]}")
    got: dict[str, float] = orjson.loads(out.stdout.strip().splitlines()[-1])
    return {
        "cpu_us": round(got["lookup_us"] + got["record_us"], 1),
        "lookup_us": round(got["lookup_us"], 1),
        "record_us": round(got["record_us"], 1),
        "calls_per_turn": round(got["calls_per_turn"], 1),
    }


def _ratios(rows: list[dict[str, Any]], figures: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in figures:
        pairs = [(r["base"][f], r["head"][f]) for r in rows]
        ratios = [round(h / b, 3) for b, h in pairs if b]
        out[f] = {"base": [b for b, _ in pairs], "head": [h for _, h in pairs], "head_over_base": ratios,
                  "median_ratio": round(statistics.median(ratios), 3) if ratios else None}  # fmt: skip
    return out


def run(quick: bool) -> dict[str, Any]:
    """Both builds, the gateway and library passes on both stores, pairs in alternating order."""
    _raise_nofile()
    pairs = int(os.environ.get("BENCH_PAIRS", "1" if quick else "3"))
    size = (200, 3) if quick else (1000, 4)
    lib_sessions = 16 if quick else 48
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    base = _Build("base", os.environ.get("BENCH_BASE", "HEAD"), tmp)
    head = _Build("head", None, tmp)
    print(f"   base: {base.label}; head: {head.label}; {pairs} pair(s)", flush=True)
    docs = [_document(DOC_TOKENS, random.Random(i)) for i in range(32)]
    engine = _Proc(sys.executable, "-m", "benchmarks.instant_engine", "--port", "0")
    result: dict[str, Any] = {"base": base.label, "head": head.label, "pairs": pairs, "gateway_size": list(size),
                              "library_sessions": lib_sessions}  # fmt: skip
    try:
        for kind in KINDS:
            for what in ("gateway", "library"):
                rows = []
                for p in range(pairs):
                    order = (base, head) if p % 2 == 0 else (head, base)
                    row: dict[str, Any] = {}
                    for b in order:
                        got = _gateway_pass(b, kind, engine, size, docs) if what == "gateway" else _library_pass(b, kind, lib_sessions)
                        row[b.name] = got
                        print(f"   {kind:8} {what:7} pair {p + 1} {b.name}: {got}", flush=True)
                    rows.append(row)
                figs = ("gateway_cpu_ms", "store_cpu_ms", "turns_per_s") if what == "gateway" else ("cpu_us", "calls_per_turn")
                ratios = _ratios(rows, figs)
                result[f"{kind}_{what}"] = {"pairs": rows, "ratios": ratios}
                print(f"   {kind:8} {what:7} head/base median: " + ", ".join(
                    f"{f} {v['median_ratio']}" for f, v in ratios.items()), flush=True)  # fmt: skip
    finally:
        engine.stop()
        base.remove()
        head.remove()
        shutil.rmtree(tmp, ignore_errors=True)
    return result
