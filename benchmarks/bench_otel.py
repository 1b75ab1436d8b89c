"""What ``tracestore gateway --otel`` costs: added latency per turn and CPU per turn, with spans vs without.

Processes: an embedded valkey-server, the instant engine
(``benchmarks/instant_engine.py``), two ``tracestore gateway`` processes on
runs of their own, one with ``--otel`` exporting to an OTLP/HTTP collector on
loopback (an aiohttp app in this process that accepts ``/v1/traces`` and
counts the bytes), one without. The sessions of ``benchmarks gateway``
(6 turns, paired with a direct engine call for the added latency) alternate
between the two, at ~1k and ~8k tokens of context; then each gateway serves
64 concurrent sessions for a few seconds (A B B A) for its CPU per turn.

Goal (issue 27): the p50 added latency with ``--otel`` within 10% of without.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from benchmarks.bench_gateway import _document, _gateway, _pcts, _Proc, _session, _throughput
from tracestore.gateway.serve import BackgroundServer
from tracestore.servers import EmbeddedServer


async def _latency(gws: dict[str, str], engine: str, contexts: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for context, n in contexts.items():
            added: dict[str, list[float]] = {name: [] for name in gws}
            for i in range(n):
                for name, url in gws.items():
                    added[name] += await _session(http, url, engine, context, seed=context * 1000 + i)
            out[str(context)] = {name: _pcts(xs) for name, xs in added.items()}
            row = out[str(context)]
            print(f"   context ~{context}: added p50 without {row['plain']['p50_ms']} ms, with --otel {row['otel']['p50_ms']} ms", flush=True)
    return out


def run(quick: bool) -> dict[str, Any]:
    contexts = {1024: 4, 8192: 4} if quick else {1024: 30, 8192: 30}
    seconds = 2.0 if quick else 8.0
    received = {"requests": 0, "bytes": 0}

    async def collector() -> web.Application:
        async def traces(request: web.Request) -> web.Response:
            received["requests"] += 1
            received["bytes"] += len(await request.read())
            return web.Response(status=200, content_type="application/x-protobuf", body=b"")

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", traces)
        return app

    server = EmbeddedServer().start()
    col = BackgroundServer(collector)
    col.start()
    procs: list[_Proc] = []
    try:
        engine = _Proc(sys.executable, "-m", "benchmarks.instant_engine", "--port", "0")
        procs.append(engine)
        plain = _gateway(engine.url, server.url, f"bench-otel-{uuid.uuid4().hex[:6]}")
        procs.append(plain)
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = col.url
        try:
            otel = _Proc(
                sys.executable, "-m", "tracestore.cli", "gateway", "--engine", engine.url, "--url", server.url,
                "--run", f"bench-otel-{uuid.uuid4().hex[:6]}", "--port", "0", "--otel",
            )
        finally:
            del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        procs.append(otel)
        gws = {"plain": plain.url, "otel": otel.url}
        print("   added latency per turn (gateway - direct engine call, same ids)", flush=True)
        lat = asyncio.run(_latency(gws, engine.url, contexts))
        docs = [_document(900, random.Random(i)) for i in range(32)]
        row: dict[str, Any] = {}
        for name, proc in (("plain", plain), ("otel", otel), ("otel", otel), ("plain", plain)):
            cpu0 = proc.cpu_s()
            res = asyncio.run(_throughput(proc.url, 64, seconds / 2, docs))
            acc = row.setdefault(name, {"turns": 0, "cpu_s": 0.0})
            acc["turns"] += res["turns"]
            acc["cpu_s"] += proc.cpu_s() - cpu0
        for acc in row.values():
            acc["gateway_cpu_ms_per_turn"] = round(acc.pop("cpu_s") * 1000 / max(1, acc["turns"]), 3)
        ratios = {c: round(v["otel"]["p50_ms"] / v["plain"]["p50_ms"], 3) for c, v in lat.items()}
        cpu_ratio = round(row["otel"]["gateway_cpu_ms_per_turn"] / row["plain"]["gateway_cpu_ms_per_turn"], 3)
        print(f"   p50 with/without --otel: {ratios}; CPU per turn {cpu_ratio}x (goal p50 <= 1.1x)", flush=True)
        print(f"   the collector received {received['requests']} exports, {received['bytes']} bytes", flush=True)
        return {
            "added_latency": lat,
            "throughput_64": row,
            "p50_ratio": ratios,
            "cpu_ratio": cpu_ratio,
            "exports": dict(received),
            "goal": {"p50_ratio_max": 1.1, "met": all(r <= 1.1 for r in ratios.values())},
        }
    finally:
        for p in reversed(procs):
            p.stop()
        col.stop()
        server.stop()
