"""Weight updates with many generations in flight: how long the drain takes, continue vs abort.

Processes: an embedded valkey-server, the reference engine (``tracestore
engine``, continuous batching), and one ``tracestore gateway`` per mode
(``--on-weight-update continue`` and ``abort``) on runs of their own. For each
mode and repetition the driver starts ``requests`` long generations (plain
HTTP, ``ignore_eos``), waits until the engine is generating for all of them,
then times ``gate.weight_update``: seal -> drain (every lease settled) ->
install -> reopen. In ``continue`` mode the gateway keeps each stopped
generation's tokens in the store before it settles the lease; in ``abort``
mode it answers 503 at once. Also reported: how many generated tokens each
mode threw away (the gateway's ``tokens_total{kind="discarded"}``).

Goal (issue 24): drain time with 100 held requests <= 1.5x the abort drain,
measured side by side in one run.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import aiohttp

from tracestore import TraceStore
from tracestore.servers import EmbeddedServer

MODEL = "tracestore-reference"


class _Proc:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tracestore.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("listening on "):
                self.url = line.split()[-1]
                return
        raise RuntimeError(f"{args[0]} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


async def _generated(session: aiohttp.ClientSession, engine: str) -> int:
    async with session.get(engine + "/get_model_info") as r:
        return int((await r.json())["generated_tokens"])


async def _cycle(gw: str, engine: str, store: TraceStore, n: int, tokens: int, version: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        discarded0 = await _metric(session, gw, 'tracestore_gateway_tokens_total{kind="discarded"}')

        async def one() -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": tokens, "ignore_eos": True}
            async with session.post(gw + "/v1/chat/completions", json=body, headers={"X-Session-Id": f"h-{uuid.uuid4().hex[:10]}"}) as r:
                await r.read()
                return r.status

        tasks = [asyncio.ensure_future(one()) for _ in range(n)]
        before = await _generated(session, engine)
        while store.gate.status().live < n:  # every request admitted
            await asyncio.sleep(0.01)
        while await _generated(session, engine) < before + 2 * n:  # and generating
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        with store.gate.weight_update(version, drain_timeout_s=120) as drained:
            assert drained.drained, drained
            drain_s = time.perf_counter() - t0
        statuses = await asyncio.gather(*tasks)
        discarded = await _metric(session, gw, 'tracestore_gateway_tokens_total{kind="discarded"}') - discarded0
    return {"drain_s": drain_s, "statuses": sorted(set(statuses)), "discarded_tokens": discarded}


def run(quick: bool = False) -> dict[str, Any]:
    n = 20 if quick else 100
    reps = 1 if quick else 3
    tokens = 400 if quick else 1500
    server = EmbeddedServer().start()
    engine = _Proc("engine", "--port", "0", "--max-len", "4096", "--max-batch", str(max(64, n)))
    out: dict[str, Any] = {"requests": n, "tokens_per_request": tokens, "modes": {}}
    try:
        for mode in ("abort", "continue"):
            run_id = f"hold-{mode}-{uuid.uuid4().hex[:6]}"
            gw = _Proc("gateway", "--engine", engine.url, "--url", server.url, "--run", run_id, "--port", "0",
                       "--on-weight-update", mode)
            store = TraceStore.connect(server.url, run=run_id)
            try:
                cycles = [asyncio.run(_cycle(gw.url, engine.url, store, n, tokens, v + 1)) for v in range(reps)]
            finally:
                gw.stop()
                store.close()
            drains = [c["drain_s"] for c in cycles]
            out["modes"][mode] = {
                "drain_s_median": statistics.median(drains),
                "drain_s": drains,
                "discarded_tokens": sum(c["discarded_tokens"] for c in cycles),
                "statuses": sorted({s for c in cycles for s in c["statuses"]}),
            }
            print(f"   {mode:8} drain {statistics.median(drains) * 1000:7.1f} ms median of {reps}, "
                  f"discarded {out['modes'][mode]['discarded_tokens']:.0f} tokens", flush=True)
        ratio = out["modes"]["continue"]["drain_s_median"] / out["modes"]["abort"]["drain_s_median"]
        out["continue_over_abort"] = ratio
        print(f"   continue / abort drain: {ratio:.2f}x (goal <= 1.5x)", flush=True)
    finally:
        engine.stop()
        server.stop()
    return out
