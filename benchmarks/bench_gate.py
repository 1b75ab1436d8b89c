"""Request gate: admit+settle throughput and drain wake-up latency (DESIGN section 6).

Figures, measured side by side in one process against one server:

* ``pairs_per_s``: admit + settle of one lease, from one process,
  - ``sequential``: one thread, two round trips per pair;
  - ``async``: one event loop, ``concurrency`` tasks each admitting and settling;
  - ``pipelined``: the same operations (``store.ops.gate.admit``/``settle``)
    driven in batches of ``batch`` requests, one round trip per batch;
  - baseline ``ping_per_s``: sequential PINGs (the round-trip ceiling).
* ``drain``: with 1,000 leases live and the gate sealed, a thread blocks in
  ``drain``; 999 leases are settled, then the last one; the latency is the
  time from just before the last settle is sent until ``drain`` returns
  (so it includes the settle's own round trip). Side by side: a polling
  drain (``status()`` every 5 ms), the thing the blocking read replaces.

Server: ``$TRACESTORE_URL`` if set, else an embedded valkey-server (and a
local 3-primary cluster, unless ``--quick``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from typing import Any

from tracestore import AsyncTraceStore, TraceStore
from tracestore.gate import Lease
from tracestore.scripts import Batch
from tracestore.servers import EmbeddedServer, LocalCluster


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _ms(x: float) -> float:
    return round(1000 * x, 3)


def sequential_pairs(store: TraceStore, n: int) -> float:
    g = store.gate
    start = time.perf_counter()
    for i in range(n):
        g.settle(g.admit(f"s{i}", "bench", 60), "completed")
    return n / (time.perf_counter() - start)


def ping_rate(store: TraceStore, n: int) -> float:
    r = store.redis
    start = time.perf_counter()
    for _ in range(n):
        r.ping()
    return n / (time.perf_counter() - start)


def batched_pairs(store: TraceStore, n: int, batch: int) -> float:
    g = store.gate
    start = time.perf_counter()
    for b in range(0, n, batch):
        leases = g.admit_many([(f"p{b + i}", "bench") for i in range(min(batch, n - b))], 60)
        g.settle_many(leases, "completed")
    return n / (time.perf_counter() - start)


def _one_pipeline(store: TraceStore, ops: list[Any]) -> list[Any]:
    """Send the first request of every op in one pipeline; the results of the ops it completes."""
    replies = store.execute(Batch(tuple(next(op) for op in ops)))
    out = []
    for op, rep in zip(ops, replies, strict=True):
        try:
            op.send(rep)
        except StopIteration as stop:
            out.append(stop.value)
    return out


def pipelined_pairs(store: TraceStore, n: int, batch: int) -> float:
    gate = store.ops.gate
    start = time.perf_counter()
    for b in range(0, n, batch):
        k = min(batch, n - b)
        leases: list[Lease] = _one_pipeline(store, [gate.admit(f"p{b + i}", "bench", 60) for i in range(k)])
        for settled in _one_pipeline(store, [gate.settle(lease, "completed") for lease in leases]):
            assert not settled.poisoned
    return n / (time.perf_counter() - start)


async def _async_pairs(url: str, run: str, n: int, concurrency: int) -> float:
    st = await AsyncTraceStore.connect(url, run=run)
    try:
        g = st.gate
        per = n // concurrency

        async def task(t: int) -> None:
            for i in range(per):
                await g.settle(await g.admit(f"a{t}-{i}", "bench", 60), "completed")

        start = time.perf_counter()
        await asyncio.gather(*(task(t) for t in range(concurrency)))
        return per * concurrency / (time.perf_counter() - start)
    finally:
        await st.close()


def _settle_all(store: TraceStore, leases: list[Lease]) -> None:
    for b in range(0, len(leases), 500):
        store.gate.settle_many(leases[b : b + 500], "completed")


def _admit_many(store: TraceStore, n: int, ttl_s: float) -> list[Lease]:
    out: list[Lease] = []
    for b in range(0, n, 1000):
        out += store.gate.admit_many([(f"d{b + i}", "bench") for i in range(min(1000, n - b))], ttl_s)
    return out


def _drainer(waiter: TraceStore, poll_s: float | None, blocked: threading.Event, done: dict[str, Any]) -> None:
    """Wait for the gate to drain: one blocking ``drain`` call, or ``status()`` every ``poll_s``."""
    blocked.set()
    if poll_s is None:
        res = waiter.gate.drain(30)
        done.update(t=time.perf_counter(), ok=res.drained, calls=0)
        return
    n = 0
    while True:
        n += 1
        if waiter.gate.status().live == 0:
            break
        time.sleep(poll_s)
    done.update(t=time.perf_counter(), ok=True, calls=n)


def drain_latency(store: TraceStore, waiter: TraceStore, leases_n: int, rounds: int, *, poll_s: float | None) -> dict[str, Any]:
    """Latency from the last settle to the drainer returning (blocking drain, or a polling loop)."""
    g = store.gate
    lat: list[float] = []
    calls: list[int] = []
    for r in range(rounds):
        g.reopen()
        leases = _admit_many(store, leases_n, 60)
        g.seal()
        done: dict[str, Any] = {}
        blocked = threading.Event()

        t = threading.Thread(target=_drainer, args=(waiter, poll_s, blocked, done))
        t.start()
        blocked.wait()
        time.sleep(0.05)  # the drainer is blocked (or polling) by now
        _settle_all(store, leases[:-1])
        time.sleep(0.02)
        t0 = time.perf_counter()
        g.settle(leases[-1], "completed")
        t.join(30)
        assert done.get("ok"), f"round {r}: drain did not finish"
        lat.append(done["t"] - t0)
        calls.append(done["calls"])
    out = {
        "rounds": rounds,
        "leases": leases_n,
        "median_ms": _ms(statistics.median(lat)),
        "p90_ms": _ms(_pct(lat, 0.9)),
        "max_ms": _ms(max(lat)),
    }
    if poll_s is not None:
        out["poll_interval_ms"] = _ms(poll_s)
        out["status_calls_per_drain_median"] = statistics.median(calls)
    return out


def bench_server(url: str, quick: bool, label: str) -> dict[str, Any]:
    run = f"bench-gate-{label}-{os.getpid()}"
    n = 2000 if quick else 20000
    rounds = 5 if quick else 30
    out: dict[str, Any] = {}
    with TraceStore.connect(url, run=run) as store, TraceStore.connect(url, run=run) as waiter:
        sequential_pairs(store, 200)  # warm up (script load, connections)
        out["ping_per_s"] = round(ping_rate(store, n))
        out["sequential_pairs_per_s"] = round(sequential_pairs(store, n))
        out["pipelined_pairs_per_s"] = round(pipelined_pairs(store, n * 2, 200))
        out["pipelined_batch"] = 200
        out["batched_pairs_per_s"] = round(batched_pairs(store, n * 2, 200))
        out["async_pairs_per_s"] = round(asyncio.run(_async_pairs(url, run, n * 2, 64)))
        out["async_concurrency"] = 64
        out["sequential_vs_ping"] = round(out["sequential_pairs_per_s"] / out["ping_per_s"], 3)
        out["drain_blocking"] = drain_latency(store, waiter, 1000, rounds, poll_s=None)
        out["drain_polling_5ms"] = drain_latency(store, waiter, 1000, rounds, poll_s=0.005)
        st = store.gate.status()
        assert st.live == 0 and st.poisoned == 0, st
    return out


def run(quick: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {"goals": {"pairs_per_s": 5000, "drain_latency_ms": 10}}
    url = os.environ.get("TRACESTORE_URL")
    if url:
        figures["external"] = bench_server(url, quick, "ext")
        return figures
    srv = EmbeddedServer().start()
    try:
        figures["valkey"] = bench_server(srv.url, quick, "valkey")
    finally:
        srv.stop()
    if not quick:
        cl = LocalCluster(primaries=3).start()
        try:
            figures["cluster"] = bench_server(cl.url, quick, "cluster")
        finally:
            cl.stop()
    for name in ("valkey", "cluster", "external"):
        if name in figures:
            f = figures[name]
            best = max(f["sequential_pairs_per_s"], f["pipelined_pairs_per_s"], f["batched_pairs_per_s"],
                       f["async_pairs_per_s"])
            print(
                f"   {name}: pairs/s seq {f['sequential_pairs_per_s']}, pipelined {f['pipelined_pairs_per_s']}, "
                f"admit_many+settle_many {f['batched_pairs_per_s']}, async {f['async_pairs_per_s']} (ping {f['ping_per_s']}); drain after last settle: "
                f"median {f['drain_blocking']['median_ms']} ms, p90 {f['drain_blocking']['p90_ms']} ms "
                f"(polling 5 ms: median {f['drain_polling_5ms']['median_ms']} ms); best pairs/s {best}",
                flush=True,
            )
    return figures
