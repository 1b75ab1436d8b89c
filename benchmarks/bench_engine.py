"""The reference engine: continuous batching against one request at a time (issue 24 item 6).

Two measurements, each side by side with the serial engine (``max_batch=1``:
one request at a time, what ``tracestore engine`` did before):

* **in process** (``trainer.batching.Batcher``): C concurrent requests of
  N tokens each (own seeds, no stop), for C in 1, 4, 16: generated tokens
  per second over the wall time of the whole set, and the time to first
  token (median over the requests);
* **over HTTP**: a ``tracestore engine --api sglang|vllm`` process driven
  through its gateway adapter (``tracestore/gateway/engines``), C = 8
  concurrent streams: the same figures, end to end.

On a shared 2-core machine only the ratios of one run mean something.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any

import aiohttp

from tests._gateway import CliServer
from tracestore.gateway.engines import EngineRequest, Sampling, engine_class
from tracestore.trainer.batching import Batcher, Job, Sampled
from tracestore.trainer.policy import new_policy, set_determinism
from tracestore.trainer.tokenizer import TOKENIZER

PROMPT = TOKENIZER.encode("use add sub mul with one digit then done; reach 3 from 1")


def _in_process(max_batch: int, concurrency: int, tokens: int) -> dict[str, float]:
    set_determinism(0)
    policy = new_policy(TOKENIZER.vocab_size, seed=0, max_len=2048)
    policy.eval()
    b = Batcher(policy, seed=0, max_batch=max_batch)
    try:
        first: dict[int, float] = {}
        lock = threading.Lock()
        jobs = []
        for i in range(concurrency):
            job = Job(rid=str(i), input_ids=PROMPT, max_new_tokens=tokens, seed=i)

            def emit(s: Sampled, i: int = i) -> None:
                with lock:
                    first.setdefault(i, time.perf_counter())

            job.emit = emit
            jobs.append(job)
        t0 = time.perf_counter()
        futs = [b.submit(j) for j in jobs]
        n = sum(len(f.result(600).output_ids) for f in futs)
        wall = time.perf_counter() - t0
        return {
            "tokens_per_s": round(n / wall, 1),
            "wall_s": round(wall, 3),
            "ttft_p50_ms": round(statistics.median(first[i] - t0 for i in range(concurrency)) * 1000, 1),
            "widest_batch": b.widest,
        }
    finally:
        b.close()


async def _over_http(api: str, url: str, concurrency: int, tokens: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        eng = engine_class(api)(url, session, aiohttp.ClientTimeout(total=600))
        await eng.generate(EngineRequest("warm", PROMPT, Sampling(max_tokens=4, ignore_eos=True)))
        first: list[float] = []
        t0 = time.perf_counter()

        async def one(i: int) -> int:
            n, seen = 0, False
            async for c in eng.stream(EngineRequest(f"b-{i}", PROMPT, Sampling(max_tokens=tokens, seed=i, ignore_eos=True))):
                if c.ids and not seen:
                    first.append(time.perf_counter() - t0)
                    seen = True
                n += len(c.ids)
            return n

        n = sum(await asyncio.gather(*(one(i) for i in range(concurrency))))
        wall = time.perf_counter() - t0
        return {
            "tokens_per_s": round(n / wall, 1),
            "wall_s": round(wall, 3),
            "ttft_p50_ms": round(statistics.median(first) * 1000, 1),
        }


def run(quick: bool = False) -> dict[str, Any]:
    """Figures of both measurements (``quick``: fewer tokens)."""
    tokens = 50 if quick else 300
    out: dict[str, Any] = {"tokens_per_request": tokens, "in_process": {}, "http": {}}
    for c in (1, 4, 16):
        row = {mode: _in_process(mb, c, tokens) for mode, mb in (("serial", 1), ("batched", 64))}
        row["speedup"] = round(row["batched"]["tokens_per_s"] / row["serial"]["tokens_per_s"], 2)
        out["in_process"][f"concurrency_{c}"] = row
        print(f"   in process, {c} concurrent: {row}", flush=True)
    for api in ("sglang", "vllm"):
        row = {}
        for mode, mb in (("serial", 1), ("batched", 64)):
            server = CliServer("engine", "--api", api, "--port", "0", "--max-len", "2048", "--max-batch", str(mb)).start()
            try:
                row[mode] = asyncio.run(_over_http(api, server.url, 8, tokens))
            finally:
                server.stop()
        row["speedup"] = round(row["batched"]["tokens_per_s"] / row["serial"]["tokens_per_s"], 2)
        out["http"][f"{api}_concurrency_8"] = row
        print(f"   over HTTP ({api}), 8 concurrent: {row}", flush=True)
    return out
