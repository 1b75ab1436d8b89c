"""Side by side with a peer (issue 28, item 2): ``tracestore gateway`` and rLLM's model gateway
(``rllm-model-gateway`` 0.1.0, ``benchmarks/baselines/rllm_gateway.py``) on the same workload.

``python -m benchmarks gateway_peer [--quick] [--out DIR]``. The client, the sessions and the
passes are ``bench_gateway_scale``'s (one aiohttp client, at most 512 requests in flight, N
sessions open at once and interleaved, a ~900-token document then ~64-token user messages; a
closed pass, then a paced one), and so is the instant engine, one process for every set-up:

* **tracestore**: one ``tracestore gateway --engine-api vllm`` (default options: the builtin
  tokenizer, tito prompts) on an embedded ``valkey-server``; it renders, tokenises only what
  follows the stored prefix, sends token ids to ``/v1/completions``, records the turn in the
  store (single phase, before it answers) and gates it (a lease per turn). Twice: the server
  without persistence (``embedded``, as ``gateway_scale``) and with ``appendonly yes``,
  ``appendfsync always`` (``embedded+aof``: every acknowledged turn is on disk, fsynced before
  the gateway answers).
* **rllm**: one ``rllm-model-gateway`` with its ``memory`` store, then its ``sqlite`` store; it
  forwards the chat request (plus ``logprobs`` and ``return_token_ids``) to
  ``/v1/chat/completions``, where the engine renders the messages with the same template and
  tokenises the whole prompt (as vLLM does), and writes the trace after it answers. Its session
  is in the path, ``/sessions/{sid}/v1/chat/completions``; the body is the same.

Per size, the four gateways are started (fresh) and warmed up (512 sessions x 2 turns, or N x 2
when N is smaller), then each
runs its closed pass in turn; the paced pass (1,000 of the sessions, one more turn each) then runs
through each at **one common rate**, half the lowest closed turns/s of the four, so the latencies
are read at the same offered load. Figures per set-up: turns/s (closed), CPU ms per turn of the
gateway, the engine, the store's server (tracestore; rLLM's store is inside its process) and this
driver, **turns per CPU-second** of gateway + engine (the issue's measure) and of gateway +
engine + store server, p50/p99 closed and paced, errors, the gateway's RSS per idle session, the
store's bytes per session (``used_memory``; SQLite: the file). rLLM writes its traces after
answering, so its CPU is read once its process is quiet again (``drain_s`` after the pass), and
the traces it holds for the pass's sessions are counted (``GET /sessions``) against the turns it
answered. ``ratio``: tracestore's turns per CPU-second over rLLM's, per pair, with both p99s.

Sizes: 1,000 x 3 and 1,000 x 20 (10,000 x 3 is left out: the peer runs ~30 turns/s here, so
its 30k turns per store would take ~20 min each); ``--quick``: 200 x 3. On this shared 2-core machine
the absolute figures move with the load; the ratios are measured side by side in one run.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from typing import Any

import orjson

from benchmarks.baselines.rllm_gateway import RllmGateway, versions
from benchmarks.bench_gateway import MODEL, SYSTEM, _document, _pcts, _Proc, _user
from benchmarks.bench_gateway_scale import (
    DOC_TOKENS,
    IDLE_S,
    INFLIGHT,
    JSON,
    PACE,
    PACED_SESSIONS,
    _client,
    _closed,
    _cpu_s,
    _direct,
    _Gateway,
    _paced,
    _raise_nofile,
    _rss_b,
    _self_cpu_s,
    _Session,
    _sessions,
    _Store,
    _Tally,
)
from tracestore.servers import EmbeddedServer

SIZES_FULL = ((1000, 3), (1000, 20))
SIZES_QUICK = ((200, 3),)
SETUPS = (("tracestore", "embedded"), ("tracestore", "embedded+aof"), ("rllm", "memory"), ("rllm", "sqlite"))
QUIET_CPU_S = 0.02  # a process is quiet when it used less than this in 0.5 s
DRAIN_MAX_S = 600.0


class _AofStore(_Store):
    """The embedded server with the append-only file, ``appendfsync always``."""

    def __init__(self) -> None:
        self.kind = "embedded+aof"
        self.server = EmbeddedServer(aof=True).start()
        self.nodes = [self.server]
        self.url = self.server.url
        self.pids = [n.proc.pid for n in self.nodes if n.proc is not None]


class _Side:
    """One set-up of a size: its gateway process, and (tracestore) its store."""

    def __init__(self, kind: str, store: str, engine: _Proc, stores: dict[str, _Store], tag: str) -> None:
        self.kind, self.store_kind, self.tag = kind, store, tag
        self.name = f"{kind}-{store}"
        self.store: _Store | None = None
        self.rllm: RllmGateway | None = None
        self.ts: _Gateway | None = None
        if kind == "tracestore":
            self.store = stores[store]
            self.ts = _Gateway(engine.url, self.store.url, tag, "vllm")
            self.url, self.pid = self.ts.url, self.ts.pid
        else:
            self.rllm = RllmGateway(engine.url, store)
            self.url, self.pid = self.rllm.session_url(), self.rllm.pid
        self.sessions: list[_Session] = []
        self.row: dict[str, Any] = {}

    def drain(self) -> float:
        """Seconds until the gateway's process is quiet (rLLM writes its traces after answering)."""
        t0 = time.perf_counter()
        last = _cpu_s(self.pid)
        while time.perf_counter() - t0 < DRAIN_MAX_S:
            time.sleep(0.5)
            now = _cpu_s(self.pid)
            if now - last < QUIET_CPU_S:
                break
            last = now
        return round(time.perf_counter() - t0, 2)

    def stop(self) -> None:
        if self.ts is not None:
            self.ts.stop()
        if self.rllm is not None:
            self.rllm.stop()


def _store_bytes(side: _Side) -> int:
    if side.store is not None:
        return side.store.snapshot()[0]
    assert side.rllm is not None
    return side.rllm.db_bytes()


def _closed_pass(side: _Side, engine: _Proc, docs: list[str], n: int, turns: int) -> dict[str, Any]:
    """The closed pass of ``n`` x ``turns`` through ``side``, and its figures."""
    side.sessions = _sessions(n, docs, side.tag + "-p")
    store_pids = side.store.pids if side.store is not None else []
    rss0, mem0 = _rss_b(side.pid), _store_bytes(side)
    cpu0 = {"gateway": _cpu_s(side.pid), "engine": _cpu_s(engine.proc.pid), "store": sum(map(_cpu_s, store_pids))}
    me0 = _self_cpu_s()
    tally, took = asyncio.run(_closed([side.url], side.sessions, turns))
    me = _self_cpu_s() - me0
    engine_cpu = _cpu_s(engine.proc.pid) - cpu0["engine"]
    drain_s = side.drain() if side.rllm is not None else 0.0
    cpu = {
        "gateway": _cpu_s(side.pid) - cpu0["gateway"],
        "engine": engine_cpu,
        "store": sum(map(_cpu_s, store_pids)) - cpu0["store"],
        "driver": me,
    }
    done = len(tally.latency)
    row: dict[str, Any] = {
        "gateway": side.kind,
        "store": side.store_kind,
        "sessions": n,
        "turns_per_session": turns,
        "turns": done,
        "seconds": round(took, 2),
        "turns_per_s": round(done / took, 1) if took else 0.0,
        "cpu_ms_per_turn": {k: round(v * 1000 / max(1, done), 3) for k, v in cpu.items()},
        "turns_per_cpu_s_gateway_engine": round(done / max(1e-9, cpu["gateway"] + cpu["engine"]), 1),
        "turns_per_cpu_s_gateway_engine_store": round(done / max(1e-9, cpu["gateway"] + cpu["engine"] + cpu["store"]), 1),
        "driver_core_share": round(me / took, 3) if took else 0.0,
        "latency_closed": _pcts(tally.latency) if tally.latency else {},
        "errors_closed": dict(tally.errors),
        "error_samples_closed": tally.samples,
        "skipped_turns": tally.skipped,
        "drain_s": drain_s,
    }
    if side.rllm is not None:
        row["traces_recorded"] = side.rllm.trace_counts(side.tag + "-p")
        row["traces_expected"] = done
    time.sleep(IDLE_S)
    row["gateway_rss_before_mb"] = round(rss0 / 2**20, 1)
    row["gateway_rss_per_idle_session_bytes"] = round((_rss_b(side.pid) - rss0) / n, 1)
    row["store_bytes_per_session"] = round((_store_bytes(side) - mem0) / n, 1)
    return row


def _paced_pass(side: _Side, turns: int, paced: int, rate: float) -> None:
    live = [s for s in side.sessions if s.ok]
    step = max(1, len(live) // paced) if live else 1
    sample = live[::step][:paced]
    tally = asyncio.run(_paced([side.url], sample, turns, rate)) if sample else _Tally()
    row = side.row
    row["latency_paced"] = {"rate_per_s": round(rate, 1), **(_pcts(tally.latency) if tally.latency else {})}
    errors = dict(row["errors_closed"])
    for k, v in tally.errors.items():
        errors[k] = errors.get(k, 0) + v
    row["errors"] = errors
    row["error_samples_paced"] = tally.samples
    row["errors_total"] = sum(errors.values())
    if side.rllm is not None:
        side.drain()
        row["traces_recorded_after_paced"] = side.rllm.trace_counts(side.tag + "-p")
        row["traces_expected_after_paced"] = row["traces_expected"] + len(tally.latency)
    if row["errors_total"]:
        lines = side.ts.proc.lines if side.ts is not None else side.rllm.lines if side.rllm else []
        row["gateway_log_tail"] = lines[-5:]


def _print(row: dict[str, Any]) -> None:
    c, lc, lp = row["cpu_ms_per_turn"], row["latency_closed"], row["latency_paced"]
    extra = f", traces {row['traces_recorded_after_paced']}/{row['traces_expected_after_paced']}, drain {row['drain_s']} s" if "traces_recorded" in row else ""
    print(
        f"   {row['gateway']:10} {row['store']:12} {row['sessions']:>5} x {row['turns_per_session']:<2}: {row['turns_per_s']:7.1f} turns/s, "
        f"CPU ms/turn gw {c['gateway']:.3f} engine {c['engine']:.3f} store {c['store']:.3f} driver {c['driver']:.3f}, "
        f"{row['turns_per_cpu_s_gateway_engine']:.0f} turns/CPU-s (gw+engine), closed p50/p99 {lc.get('p50_ms')}/{lc.get('p99_ms')} ms, "
        f"paced p50/p99 {lp.get('p50_ms')}/{lp.get('p99_ms')} ms at {lp['rate_per_s']}/s, errors {row['errors_total']}, "
        f"RSS/idle session {row['gateway_rss_per_idle_session_bytes']:.0f} B, store {row['store_bytes_per_session']:.0f} B/session{extra}",
        flush=True,
    )


def _size(engine: _Proc, stores: dict[str, _Store], docs: list[str], n: int, turns: int, paced: int) -> list[dict[str, Any]]:
    run = f"peer-{n}x{turns}-{os.urandom(3).hex()}"
    sides: list[_Side] = []
    try:
        for kind, store in SETUPS:
            sides.append(_Side(kind, store, engine, stores, f"{run}-{kind[:2]}-{store[:6]}"))
        for side in sides:
            asyncio.run(_closed([side.url], _sessions(min(INFLIGHT, n), docs, side.tag + "-warm"), 2))
            side.drain()
        for side in sides:
            side.row = _closed_pass(side, engine, docs, n, turns)
        rate = max(1.0, PACE * min(s.row["turns_per_s"] for s in sides))
        for side in sides:
            _paced_pass(side, turns, paced, rate)
            _print(side.row)
    finally:
        for side in sides:
            side.stop()
    return [s.row for s in sides]


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for size in dict.fromkeys((r["sessions"], r["turns_per_session"]) for r in rows):
        here = [r for r in rows if (r["sessions"], r["turns_per_session"]) == size]
        for ts in (r for r in here if r["gateway"] == "tracestore"):
            for peer in (r for r in here if r["gateway"] == "rllm"):
                ratio = ts["turns_per_cpu_s_gateway_engine"] / max(1e-9, peer["turns_per_cpu_s_gateway_engine"])
                ratio_all = ts["turns_per_cpu_s_gateway_engine_store"] / max(1e-9, peer["turns_per_cpu_s_gateway_engine_store"])
                p99 = {k: (ts[k].get("p99_ms"), peer[k].get("p99_ms")) for k in ("latency_closed", "latency_paced")}
                lower = all(a is not None and b is not None and a <= b for a, b in p99.values())
                r = {
                    "size": f"{size[0]} x {size[1]}",
                    "tracestore": ts["store"],
                    "rllm": peer["store"],
                    "turns_per_cpu_s_ratio": round(ratio, 2),
                    "turns_per_cpu_s_ratio_with_store_server": round(ratio_all, 2),
                    "turns_per_s_ratio": round(ts["turns_per_s"] / max(1e-9, peer["turns_per_s"]), 2),
                    "p99_closed_ms": list(p99["latency_closed"]),
                    "p99_paced_ms": list(p99["latency_paced"]),
                    "goal": ">= 2x turns per CPU-second (gateway + engine) at equal or lower p99 (closed and paced)",
                    "met": ratio >= 2.0 and lower,
                }
                out.append(r)
                print(
                    f"   {r['size']:>9}: tracestore {ts['store']:12} / rllm {peer['store']:6}: {r['turns_per_cpu_s_ratio']}x turns per CPU-s "
                    f"({r['turns_per_cpu_s_ratio_with_store_server']}x with the store server), p99 closed {r['p99_closed_ms']} ms, "
                    f"paced {r['p99_paced_ms']} ms: goal {'met' if r['met'] else 'NOT met'}",
                    flush=True,
                )
    return out


async def _direct_chat(engine: str, docs: list[str], n: int = 200) -> dict[str, float]:
    """Latency of ``n`` sequential chat calls straight to the instant engine (a turn-1 conversation)."""
    msgs = [{"role": "system", "content": SYSTEM + " " + docs[0]}, {"role": "user", "content": _user(random.Random(0))}]
    raw = orjson.dumps({"model": MODEL, "messages": msgs, "max_tokens": 64, "logprobs": True, "return_token_ids": True})
    took = []
    async with _client() as http:
        for _ in range(n):
            t0 = time.perf_counter()
            async with http.post(engine + "/v1/chat/completions", data=raw, headers=JSON) as resp:
                await resp.read()
            took.append(time.perf_counter() - t0)
    return _pcts(took)


def run(quick: bool) -> dict[str, Any]:
    """One engine and two stores for the run; per size, the four gateways side by side."""
    nofile = _raise_nofile()
    sizes = SIZES_QUICK if quick else SIZES_FULL
    paced = min(PACED_SESSIONS, min(n for n, _ in sizes))
    docs = [_document(DOC_TOKENS, random.Random(i)) for i in range(32)]
    figures: dict[str, Any] = {
        "inflight": INFLIGHT,
        "sizes": [list(s) for s in sizes],
        "setups": [f"{k}-{s}" for k, s in SETUPS],
        "paced_sessions": paced,
        "paced_rate_share_of_lowest": PACE,
        "doc_tokens": DOC_TOKENS,
        "rlimit_nofile": nofile,
        "peer_versions": versions(),
        "python": sys.version.split()[0],
        "load_average_at_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "runs": [],
    }
    engine = _Proc(sys.executable, "-m", "benchmarks.instant_engine", "--port", "0")
    stores: dict[str, _Store] = {}
    try:
        figures["engine_direct"] = {"vllm_completions_ids": asyncio.run(_direct(engine.url, "vllm"))}
        figures["engine_direct"]["vllm_chat_messages"] = asyncio.run(_direct_chat(engine.url, docs))
        stores["embedded"] = _Store("embedded")
        stores["embedded+aof"] = _AofStore()
        for n, turns in sizes:
            figures["runs"] += _size(engine, stores, docs, n, turns, paced)
        figures["ratios"] = _ratios(figures["runs"])
        figures["load_average_at_end"] = os.getloadavg()
        return figures
    finally:
        for st in stores.values():
            st.stop()
        engine.stop()
