"""The session gateway's own cost (issue 10), side by side with an XTuner-style baseline.

Processes (one machine, one run): an embedded valkey-server; the instant
engine (``benchmarks/instant_engine.py``: SGLang ``/generate`` answered at
once with a fixed 33-token answer, so only what sits in front of it is
measured); ``tracestore gateway`` (the product, a subprocess, as deployed);
the XTuner-style baseline (``benchmarks/baselines/xtuner_gateway.py``:
aiohttp + the one-Ray-actor text trie called as XTuner's SessionServer calls
its store, in its own process with its actor); the floor
(``benchmarks/baselines/floor_gateway.py``: only the work no gateway that stores token-exact
turns in Redis and gates them can skip, two store round trips and the engine call: the lower
bound of the added latency on this machine, latency only); and this driver (one aiohttp
client).

* **Added latency per turn** at ~1k, 8k and 32k tokens of context: a session
  of 6 turns (the first carries a document that makes the context; each later
  turn adds a ~64-token user message and gets the 33-token answer). For every
  turn the driver calls the gateway (OpenAI chat completions with a session
  id), then sends the very ``input_ids`` the gateway sent to the engine
  straight to the engine; the added latency is the difference, paired per
  turn, over turns 2..6 (turn 1 tokenises the whole document on both
  systems). Sessions alternate between the two gateways.
* **Throughput** with 64 and 256 concurrent sessions (~1k context, turns back
  to back for a fixed time): completed turns per second through each gateway,
  and the gateway process's CPU seconds per turn.

Goals: added p50 <= 1.5 ms at 8k; <= 1/5 of the baseline's added latency at
8k; added latency at 32k <= 2x that at 1k. On this shared 2-core machine the
client, the gateway, the engine and Redis share the cores: only ratios
measured in one run are meaningful.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tracestore.servers import EmbeddedServer

CONTEXTS = (1024, 8192, 32768)
TURNS = 6
USER_TOKENS = 64
SESSIONS_FULL = {1024: 40, 8192: 30, 32768: 20}
SESSIONS_QUICK = {1024: 4, 8192: 4, 32768: 3}
CONCURRENCY = (64, 256)
THROUGHPUT_S_FULL = 10.0
THROUGHPUT_S_QUICK = 2.0
MODEL = "tracestore-reference"
SYSTEM = "use add sub mul with one digit then done"
# Words of the builtin vocabulary: concatenated they tokenise to ~4.4 characters a
# token, about what a real BPE tokenizer gives on English.
WORDS = ("system", "user", "assistant", "tool", "add", "sub", "mul", "done", "reach", "from", "with", "then", "error", "use")


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Terminate ``proc`` if it still runs; kill it after 30 s, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Proc:
    """A benchmark process that prints ``listening on URL``."""

    def __init__(self, *args: str, root: str | None = None) -> None:
        """``root``: the tree whose code the process runs (first on its path, and its working
        directory; default this one's, and the caller's directory)."""
        cwd = root
        root = root or str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
        )
        self.url = ""
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("listening on "):
                    self.url = line.split()[-1]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(180)
        if not self.url:
            self.stop()
            raise RuntimeError(f"{args} did not start: {''.join(self.lines)[-2000:]}")

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        stop_process(self.proc)


def _document(tokens: int, rng: random.Random) -> str:
    from tracestore.trainer.tokenizer import TOKENIZER

    text = "".join(rng.choice(WORDS) for _ in range(tokens))
    ids = TOKENIZER.encode(text)
    return TOKENIZER.decode(ids[:tokens])


def _user(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(USER_TOKENS // 2, USER_TOKENS * 3 // 2)))


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[float, Any]:
    t0 = time.perf_counter()
    async with http.post(url, data=body, headers={"Content-Type": "application/json", **(headers or {})}) as resp:
        raw = await resp.read()
        took = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {raw[:300]!r}")
    return took, orjson.loads(raw)


async def _session(http: aiohttp.ClientSession, gw: str, engine: str, context: int, seed: int) -> list[float]:
    """One session of TURNS turns through ``gw``; the paired added latency of turns 2..TURNS."""
    rng = random.Random(seed)
    sid = f"b-{uuid.uuid4().hex[:10]}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM + " " + _document(max(16, context - TURNS * (USER_TOKENS + 33)), rng)},
        {"role": "user", "content": _user(rng)},
    ]
    added = []
    for turn in range(TURNS):
        body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 64, "session_id": sid})
        t_gw, reply = await _post(http, gw + "/v1/chat/completions", body)
        async with http.get(engine + "/last") as r:
            ids = orjson.loads(await r.read())
        assert len(ids) == reply["usage"]["prompt_tokens"], (len(ids), reply["usage"])
        direct = orjson.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 64}, "return_logprob": True})
        t_direct, _ = await _post(http, engine + "/generate", direct)
        if turn:
            added.append(t_gw - t_direct)
        messages += [reply["choices"][0]["message"], {"role": "user", "content": _user(rng)}]
    return added


def _pcts(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "p50_ms": round(statistics.median(s) * 1000, 3),
        "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1000, 3),
        "mean_ms": round(statistics.fmean(s) * 1000, 3),
        "samples": len(s),
    }


async def _latency(gws: dict[str, str], engine: str, counts: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for context in CONTEXTS:
            added: dict[str, list[float]] = {name: [] for name in gws}
            for i in range(counts[context]):
                for name, url in gws.items():  # alternate: load from elsewhere falls on both
                    added[name] += await _session(http, url, engine, context, seed=context * 1000 + i)
            out[str(context)] = {name: _pcts(xs) for name, xs in added.items()}
            row = out[str(context)]
            print(
                f"   context ~{context}: added p50/p99 " + ", ".join(f"{n} {row[n]['p50_ms']}/{row[n]['p99_ms']} ms" for n in gws),
                flush=True,
            )
    return out


async def _throughput(gw: str | list[str], concurrency: int, seconds: float, docs: list[str]) -> dict[str, Any]:
    """Turns/s of ``concurrency`` agents for ``seconds``; with several gateways, turn ``i`` of a
    session goes to gateway ``i % n`` (a round-robin load balancer)."""
    urls = [gw] if isinstance(gw, str) else gw
    done = 0
    stop = time.perf_counter() + seconds

    async def agent(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal done
        rng = random.Random(i)
        while time.perf_counter() < stop:
            sid = f"t-{uuid.uuid4().hex[:10]}"
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM + " " + docs[rng.randrange(len(docs))]},
                {"role": "user", "content": _user(rng)},
            ]
            for turn in range(TURNS):
                if time.perf_counter() >= stop:
                    return
                body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 64, "session_id": sid})
                _, reply = await _post(http, urls[turn % len(urls)] + "/v1/chat/completions", body)
                done += 1
                messages += [reply["choices"][0]["message"], {"role": "user", "content": _user(rng)}]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(agent(http, i) for i in range(concurrency)))
        took = time.perf_counter() - t0
    return {"turns": done, "seconds": round(took, 2), "turns_per_s": round(done / took, 1)}


def _parts(url: str) -> dict[str, float]:
    """Mean ms per request of each part of the gateway's latency histogram (all turns so far)."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for kind, into in (("_sum{", sums), ("_count{", counts)):
            if line.startswith("tracestore_gateway_latency_seconds" + kind):
                part = line.split('part="')[1].split('"')[0]
                into[part] = float(line.split()[-1])
    return {p: round(sums[p] / counts[p] * 1000, 3) for p in sums if counts.get(p)}


def _gateway(engine: str, url: str, run: str) -> _Proc:
    """A ``tracestore gateway`` process of run ``run`` on ``url``, in front of ``engine``."""
    return _Proc(
        sys.executable, "-m", "tracestore.cli", "gateway", "--engine", engine, "--url", url, "--run", run, "--port", "0"
    )


def run(quick: bool) -> dict[str, Any]:
    """Start the processes, measure latency then throughput, stop everything."""
    counts = SESSIONS_QUICK if quick else SESSIONS_FULL
    seconds = THROUGHPUT_S_QUICK if quick else THROUGHPUT_S_FULL
    py = sys.executable
    server = EmbeddedServer().start()
    procs: list[_Proc] = []
    try:
        engine = _Proc(py, "-m", "benchmarks.instant_engine", "--port", "0")
        procs.append(engine)
        ours = _gateway(engine.url, server.url, f"bench-gw-{uuid.uuid4().hex[:6]}")
        procs.append(ours)
        base = _Proc(py, "-m", "benchmarks.baselines.xtuner_gateway", "--engine", engine.url, "--port", "0")
        procs.append(base)
        floor = _Proc(py, "-m", "benchmarks.baselines.floor_gateway", "--engine", engine.url, "--url", server.url, "--port", "0")
        procs.append(floor)
        raw = _Proc(py, "-m", "benchmarks.baselines.raw_floor_gateway", "--engine", engine.url, "--url", server.url, "--port", "0")
        procs.append(raw)
        gws = {"tracestore": ours.url, "baseline": base.url, "floor": floor.url, "raw_floor": raw.url}
        figures: dict[str, Any] = {
            "turns_per_session": TURNS,
            "user_tokens_per_turn": USER_TOKENS,
            "answer_tokens": 33,
            "sessions": {str(k): v for k, v in counts.items()},
        }
        print("   added latency per turn (gateway - direct engine call, same ids)", flush=True)
        lat = asyncio.run(_latency(gws, engine.url, counts))
        figures["added_latency"] = lat
        figures["tracestore_parts_mean_ms"] = _parts(ours.url)
        figures["throughput"] = {}
        docs = [_document(900, random.Random(i)) for i in range(32)]  # made before the clock runs
        for n in CONCURRENCY:
            row: dict[str, Any] = {}
            # two halves in mirrored order (A B C C B A), so a change of load falls on all alike
            order = (("tracestore", ours), ("baseline", base), ("floor", floor), ("raw_floor", raw))
            for name, proc in (*order, *reversed(order)):
                cpu0 = proc.cpu_s()
                res = asyncio.run(_throughput(proc.url, n, seconds / 2, docs))
                cpu = proc.cpu_s() - cpu0
                acc = row.setdefault(name, {"turns": 0, "seconds": 0.0, "cpu_s": 0.0})
                acc["turns"] += res["turns"]
                acc["seconds"] += res["seconds"]
                acc["cpu_s"] += cpu
            for acc in row.values():
                acc["turns_per_s"] = round(acc["turns"] / acc["seconds"], 1)
                acc["gateway_cpu_ms_per_turn"] = round(acc.pop("cpu_s") * 1000 / max(1, acc["turns"]), 3)
                acc["seconds"] = round(acc["seconds"], 2)
            figures["throughput"][str(n)] = row
            print(
                f"   {n} concurrent sessions: tracestore {row['tracestore']['turns_per_s']} turns/s "
                f"({row['tracestore']['gateway_cpu_ms_per_turn']} ms CPU/turn), baseline "
                f"{row['baseline']['turns_per_s']} turns/s ({row['baseline']['gateway_cpu_ms_per_turn']} ms CPU/turn), floor "
                f"{row['floor']['turns_per_s']} turns/s ({row['floor']['gateway_cpu_ms_per_turn']} ms CPU/turn), raw floor "
                f"{row['raw_floor']['turns_per_s']} turns/s ({row['raw_floor']['gateway_cpu_ms_per_turn']} ms CPU/turn)",
                flush=True,
            )
        k1, k8, k32 = (lat[str(c)]["tracestore"]["p50_ms"] for c in CONTEXTS)
        b8 = lat["8192"]["baseline"]["p50_ms"]
        f8 = lat["8192"]["floor"]["p50_ms"]
        figures["goals"] = {
            "added_p50_8k_ms": {"value": k8, "goal": "<= 1.5", "met": k8 <= 1.5, "floor_p50_8k_ms": f8},
            "ratio_to_baseline_8k": {"value": round(k8 / b8, 3), "goal": "<= 0.2", "met": k8 <= b8 / 5},
            "ratio_32k_to_1k": {"value": round(k32 / k1, 2), "goal": "<= 2", "met": k32 <= 2 * k1},
        }
        for name, g in figures["goals"].items():
            print(f"   goal {name}: {g['value']} (goal {g['goal']}): {'met' if g['met'] else 'NOT met'}", flush=True)
        return figures
    finally:
        for p in reversed(procs):
            p.stop()
        server.stop()
