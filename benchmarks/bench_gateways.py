"""Stateless gateways side by side (issue 16): aggregate throughput of one vs two gateway processes.

``python -m benchmarks gateways [--quick]``. Processes (one machine, one
run): an embedded valkey-server, the instant engine
(``benchmarks/instant_engine.py``: SGLang's ``/generate`` answered at once,
so only what sits in front of it is measured), two ``tracestore gateway``
processes on different ports serving the same run in front of that engine,
and this driver (one aiohttp client, as in ``bench_gateway``).

With 64 and 256 concurrent agent sessions (6 turns each, ~1k tokens of
context, turns back to back for a fixed time), the aggregate completed turns
per second when every turn goes to gateway A ("one") and when the turns of
each session alternate between A and B ("two", what a round-robin load
balancer does; a session's turns then land on both). The two set-ups
alternate in mirrored slices (one, two, two, one, three times over) in the
same run, so a change of the machine's load falls on both alike; the figure
is the ratio two / one.

Besides turns/s: CPU seconds per turn of each process (the gateways
together, the engine, the server, this driver), from ``/proc``, which shows
what bounds the aggregate on this machine, and that a second gateway adds no
per-turn cost (it shares nothing with the first but the store).

On a shared 2-core machine the driver, the gateways, the engine and the
server compete for the two cores: the ratio measures what a second gateway
process buys here, not on a machine with a core per process.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import sys
import uuid
from pathlib import Path
from typing import Any

from benchmarks.bench_gateway import CONCURRENCY, _document, _gateway, _Proc, _throughput
from tracestore.servers import EmbeddedServer

SECONDS_FULL = 30.0  # per set-up and concurrency, over all its slices
SECONDS_QUICK = 4.0
ROUNDS = 3  # of (one, two, two, one)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(quick: bool) -> dict[str, Any]:
    """Start the processes, measure one vs two gateways at each concurrency, stop everything."""
    seconds = SECONDS_QUICK if quick else SECONDS_FULL
    server = EmbeddedServer().start()
    procs: list[_Proc] = []
    try:
        engine = _Proc(sys.executable, "-m", "benchmarks.instant_engine", "--port", "0")
        procs.append(engine)
        run_id = f"bench-gw2-{uuid.uuid4().hex[:6]}"
        gws = [_gateway(engine.url, server.url, run_id) for _ in range(2)]
        procs += gws
        assert server.proc is not None
        pids = {"gateways": [g.proc.pid for g in gws], "engine": [engine.proc.pid], "server": [server.proc.pid]}
        setups = {"one": [gws[0].url], "two": [g.url for g in gws]}
        docs = [_document(900, random.Random(i)) for i in range(32)]  # made before the clock runs
        figures: dict[str, Any] = {
            "seconds_per_setup": seconds,
            "load_average_at_start": os.getloadavg(),
            "cpus": os.cpu_count(),
            "throughput": {},
        }
        for n in CONCURRENCY:
            row: dict[str, dict[str, Any]] = {}
            for name in ("one", "two", "two", "one") * ROUNDS:  # mirrored slices
                cpu0 = {k: sum(_cpu_s(p) for p in v) for k, v in pids.items()}
                me0 = _self_cpu_s()
                res = asyncio.run(_throughput(setups[name], n, seconds / (2 * ROUNDS), docs))
                acc = row.setdefault(name, {"turns": 0, "seconds": 0.0, "cpu_s": dict.fromkeys([*pids, "driver"], 0.0)})
                acc["turns"] += res["turns"]
                acc["seconds"] += res["seconds"]
                for k, v in pids.items():
                    acc["cpu_s"][k] += sum(_cpu_s(p) for p in v) - cpu0[k]
                acc["cpu_s"]["driver"] += _self_cpu_s() - me0
            for acc in row.values():
                turns = max(1, acc["turns"])
                acc["turns_per_s"] = round(acc["turns"] / acc["seconds"], 1)
                acc["cpu_ms_per_turn"] = {k: round(v * 1000 / turns, 3) for k, v in acc.pop("cpu_s").items()}
                acc["seconds"] = round(acc["seconds"], 2)
            row["ratio_two_over_one"] = {"turns_per_s": round(row["two"]["turns_per_s"] / row["one"]["turns_per_s"], 3)}
            figures["throughput"][str(n)] = row
            one, two = row["one"], row["two"]
            print(
                f"   {n} sessions: one gateway {one['turns_per_s']} turns/s, two {two['turns_per_s']} turns/s "
                f"(x{row['ratio_two_over_one']['turns_per_s']}); gateway CPU ms/turn {one['cpu_ms_per_turn']['gateways']}"
                f" vs {two['cpu_ms_per_turn']['gateways']}, driver {one['cpu_ms_per_turn']['driver']} vs "
                f"{two['cpu_ms_per_turn']['driver']}",
                flush=True,
            )
        return figures
    finally:
        for p in reversed(procs):
            p.stop()
        server.stop()
