"""CPU per turn against the number of requests in flight: one ``tracestore gateway`` process
(SGLang shape, default options) in front of the instant engine, on the embedded server.

``python -m benchmarks gateway_concurrency [--quick]``. The same processes, client and sessions
as ``gateway_scale`` (its helpers: ~1k tokens of context at turn 1, 3 turns a session), one
closed pass per level of concurrency (``INFLIGHT`` requests in flight at most: 1, 4, 16, 64,
512; quick: 1, 16, 512), after one warm-up. Figures per level: turns/s, the CPU per turn of the
gateway, the store server and the engine (``/proc``), the client-observed p50.

Why it matters: every process's CPU per turn falls as the concurrency rises, the store
server's too (C code, with no batching of its own). At 1 request in flight each turn wakes
every process several times (the request, the store's replies, the engine's reply), and on a
virtual machine a wake-up costs far more than the work it wakes for; at 512 in flight the
processes never sleep, the gateway's store calls of one loop iteration share one write and
its admissions share one round trip. So a gateway's capacity is a curve, not one figure:
``docs/capacity.md`` takes its cost per turn at the concurrency a run will have, and a rate
that is half of the saturated throughput is not half of the CPU.
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from typing import Any

from benchmarks import bench_gateway_scale as scale
from benchmarks.bench_gateway import _pcts, _Proc

LEVELS_FULL = (1, 4, 16, 64, 512)
LEVELS_QUICK = (1, 16, 512)


def _level(gw: scale._Gateway, engine: _Proc, store: scale._Store, docs: list[str], inflight: int) -> dict[str, Any]:
    n = max(100, min(1000, 40 * inflight))  # sessions: 3 turns each; at least 300 turns a level
    cpu0 = (scale._cpu_s(gw.pid), sum(map(scale._cpu_s, store.pids)), scale._cpu_s(engine.proc.pid))
    tally, took = asyncio.run(scale._closed([gw.url], scale._sessions(n, docs, f"conc{inflight}"), 3, inflight))
    cpu1 = (scale._cpu_s(gw.pid), sum(map(scale._cpu_s, store.pids)), scale._cpu_s(engine.proc.pid))
    done = max(1, len(tally.latency))
    gw_ms, store_ms, engine_ms = (round(1000 * (b - a) / done, 3) for a, b in zip(cpu0, cpu1, strict=True))
    return {
        "in_flight": inflight,
        "turns": len(tally.latency),
        "turns_per_s": round(len(tally.latency) / took, 1) if took else 0.0,
        "cpu_ms_per_turn": {"gateway": gw_ms, "store": store_ms, "engine": engine_ms},
        "latency": _pcts(tally.latency) if tally.latency else {},
        "errors": sum(tally.errors.values()),
    }


def run(quick: bool) -> dict[str, Any]:
    """One gateway, one warm-up, then a closed pass per level of concurrency."""
    scale._raise_nofile()
    levels = LEVELS_QUICK if quick else LEVELS_FULL
    docs = [scale._document(scale.DOC_TOKENS, random.Random(i)) for i in range(32)]
    engine = _Proc(sys.executable, "-m", "benchmarks.instant_engine", "--port", "0")
    store = scale._Store("embedded")
    rows = []
    try:
        gw = scale._Gateway(engine.url, store.url, f"conc-{uuid.uuid4().hex[:6]}", "sglang")
        try:
            scale._warm([gw], docs)
            for c in levels:
                row = _level(gw, engine, store, docs, c)
                rows.append(row)
                cpu = row["cpu_ms_per_turn"]
                print(
                    f"   {c:4} in flight: {row['turns_per_s']:7.1f} turns/s, CPU ms/turn gateway {cpu['gateway']:.2f} / "
                    f"store {cpu['store']:.2f} / engine {cpu['engine']:.2f}, p50 {row['latency'].get('p50_ms')} ms, "
                    f"errors {row['errors']}",
                    flush=True,
                )
        finally:
            gw.stop()
    finally:
        store.stop()
        engine.stop()
    first, last = rows[0]["cpu_ms_per_turn"], rows[-1]["cpu_ms_per_turn"]
    ratio = {k: round(first[k] / last[k], 2) if last[k] else None for k in first}
    print(f"   CPU per turn at {levels[0]} / at {levels[-1]} in flight: {ratio}", flush=True)
    return {"levels": rows, "cpu_first_over_last": ratio}
