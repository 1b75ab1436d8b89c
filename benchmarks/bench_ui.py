"""The viewer (``tracestore ui``): page latency on a big run, and no SCAN per request (issue 27).

Builds, with pipelined writes through the public operations, a run of
``SESSIONS`` sessions (one recorded turn each, spread over 50 rollout
owners; groups of 8 put in the replay buffer; a share released, so the
release stream and the tombstones are long; ``CYCLES`` weight-update
cycles in the gate's log) and one session of ``BIG_NODES`` nodes (a chain
of turns, with a fork every tenth turn). Then starts ``tracestore ui`` as a
subprocess against it and loads every kind of page over real HTTP
(aiohttp's client), one request at a time: the first (cold) load of the
big session separately, then ``REPEAT`` loads of each page. Figures per
page: p50 / p95 / max (ms) and bytes; and the server's ``INFO
commandstats`` SCAN calls before and after the measured requests (the
viewer's background discovery is told not to run again meanwhile,
``--rescan 3600``, and its pass count is read from ``/health``).

Goal: p95 <= 200 ms on every page, and 0 SCAN calls from requests.
Server: ``$TRACESTORE_URL`` if set, else an embedded valkey-server.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any
from urllib.parse import quote

import aiohttp

from tracestore import TraceStore
from tracestore.gate import install, reopen, seal
from tracestore.ownership import open_sessions, release
from tracestore.replay import Group, put
from tracestore.scripts import gather
from tracestore.servers import EmbeddedServer
from tracestore.traces import record_turn
from tracestore.traces.index import node_id
from tracestore.traces.reads import read_path
from tracestore.traces.types import PrefixMatch

OWNERS = 50
GROUP = 8


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _scans(store: TraceStore) -> int:
    """SCAN calls the server counted (``INFO commandstats``; summed over primaries)."""
    r: Any = store.redis
    infos = [r.info("commandstats")] if not store.cluster else list(r.info("commandstats", target_nodes=r.PRIMARIES).values())
    return sum(int(i.get("cmdstat_scan", {}).get("calls", 0)) for i in infos)


def build(store: TraceStore, sessions: int, big_nodes: int, cycles: int) -> dict[str, Any]:
    """The big run: sessions with one turn each, replay groups, releases, gate cycles, one big session."""
    ctx = store.context
    t0 = time.perf_counter()
    sids = [f"s-{i:07d}" for i in range(sessions)]
    per = -(-sessions // (OWNERS * GROUP)) * GROUP  # a group never spans two owners
    owner_of = {}
    for o in range(OWNERS):
        part = sids[o * per : (o + 1) * per]
        for s in part:
            owner_of[s] = f"rollout:{o}"
        for i in range(0, len(part), 4000):
            store.run(open_sessions(ctx, part[i : i + 4000], f"rollout:{o}"))
    prompt, answer = "<user>question</user>", "<assistant>answer</assistant>"
    empty = PrefixMatch(0, [], None)
    for i in range(0, sessions, 1000):
        store.run(gather([
            record_turn(ctx, s, prompt, answer, prefix=empty, delta_token_ids=list(range(1, 33)),
                        response_token_ids=list(range(33, 65)), response_logprobs=[-0.5] * 32, version=0)
            for s in sids[i : i + 1000]
        ]))
    # replay groups of 8 (the first 40%), releases (the next 10%), the rest stays with its owner
    grouped = sids[: int(sessions * 0.4) // GROUP * GROUP]
    puts = [put(ctx, Group(f"g-{j:06d}", "calc", tuple(grouped[j * GROUP : (j + 1) * GROUP]), "completed",
                           payload={"reward": j % 2}), owner_of[grouped[j * GROUP]])
            for j in range(len(grouped) // GROUP)]
    for i in range(0, len(puts), 500):
        store.run(gather(puts[i : i + 500]))
    gone = sids[len(grouped) : len(grouped) + sessions // 10]
    by_owner: dict[str, list[str]] = {}
    for s in gone:
        by_owner.setdefault(owner_of[s], []).append(s)
    store.run(gather([release(ctx, ss, o, "done") for o, ss in by_owner.items()]))
    ops = []
    for v in range(1, cycles + 1):
        ops += [seal(ctx), install(ctx, v), reopen(ctx)]
    store.run(gather(ops))
    version = cycles
    # one big session: a chain of turns, a fork (an edited user message) every tenth turn
    big = "big-session"
    store.open_session(big, "rollout:0")
    text, n_nodes, turn = "", 0, 0
    while n_nodes < big_nodes:
        user = f"<user>step {turn}</user>"
        if turn % 10 == 9:  # a fork beside the main line: its own delta and answer
            alt = text + f"<user>edited {turn}</user>"
            m = store.lookup(big, alt)
            store.record_turn(big, alt, "<assistant>alt</assistant>", prefix=m, delta_token_ids=[7, 8, 9],
                              response_token_ids=[10, 11], response_logprobs=[-0.2, -0.3], version=version)
            n_nodes += 2
        p = text + user
        m = store.lookup(big, p)
        store.record_turn(big, p, f"<assistant>ok {turn}</assistant>", prefix=m, delta_token_ids=[1, 2, 3, 4],
                          response_token_ids=[5, 6, 7, 8, 9, 10], response_logprobs=[-0.1] * 6,
                          version=max(0, version - turn % 5))
        text = p + f"<assistant>ok {turn}</assistant>"
        n_nodes += 2
        turn += 1
    return {"build_s": round(time.perf_counter() - t0, 1), "sessions": sessions, "big_nodes": n_nodes,
            "big_turns": turn, "groups": len(puts), "released": len(gone), "cycles": cycles,
            "last_leaf_key": text, "owner": owner_of[sids[-1]]}


async def _measure(base: str, pages: dict[str, str], repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as c:
        for name, path in pages.items():
            times, size = [], 0
            for i in range(repeat + 1):
                t = time.perf_counter()
                async with c.get(base + path) as resp:
                    body = await resp.read()
                    assert resp.status == 200, (path, resp.status, body[:300])
                dt = time.perf_counter() - t
                size = len(body)
                if i == 0:
                    out.setdefault("_first", {})[name] = round(1000 * dt, 1)
                else:
                    times.append(dt)
            out[name] = {"p50_ms": round(1000 * statistics.median(times), 1), "p95_ms": round(1000 * _pct(times, 0.95), 1),
                         "max_ms": round(1000 * max(times), 1), "bytes": size}
    return out


def bench_server(url: str, quick: bool) -> dict[str, Any]:
    run = f"bench-ui-{os.getpid()}"
    sessions, big_nodes, cycles, repeat = (5_000, 1_000, 50, 10) if quick else (100_000, 10_000, 300, 40)
    store = TraceStore.connect(url, run=run)
    try:
        built = build(store, sessions, big_nodes, cycles)
        leaf_key, owner = built.pop("last_leaf_key"), built.pop("owner")
        print(f"   built: {built}", flush=True)
        ix, _, _ = store.run(read_path(store.context, "big-session", lambda _ix: None))
        leaf = ix.nums[node_id(leaf_key)]
        total_tokens = sum(n.ntok for n in ix.path(ix.nodes[node_id(leaf_key)]))
        proc = subprocess.Popen([sys.executable, "-m", "tracestore.cli", "ui", "--url", url, "--port", "0",
                                 "--rescan", "3600", "--tokenizer", "builtin"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("listening on "), line + proc.stdout.read()[-2000:]
            base = line.split()[-1]
            r = f"/runs/{run}"
            big = f"{r}/sessions/big-session"
            pages = {
                "runs": "/",
                "run": r,
                "run_json": f"/api{r}",
                "owner": f"{r}/owners/{quote(owner, safe='')}",
                "replay_cell_middle": f"{r}/replay/calc/completed?offset={built['groups'] // 2}",
                "session_small": f"{r}/sessions/s-{sessions - 1:07d}",
                "session_big": big,
                "session_big_page_last": f"{big}?page={-(-built['big_nodes'] // 200)}",
                "path_big_first_tokens": f"{big}/path/{leaf}",
                "path_big_last_tokens": f"{big}/path/{leaf}?offset={max(0, total_tokens - 1000)}",
                "path_big_json": f"/api{big}/path/{leaf}?offset={total_tokens // 2}",
            }

            async def health() -> Any:
                async with aiohttp.ClientSession() as c, c.get(base + "/health") as resp:
                    return await resp.json()

            before_scans, before = _scans(store), asyncio.run(health())
            figures = asyncio.run(_measure(base, pages, repeat))
            after_scans, after = _scans(store), asyncio.run(health())
        finally:
            proc.terminate()
            proc.wait(15)
        first = figures.pop("_first")
        worst = max(f["p95_ms"] for f in figures.values())
        return {
            "built": built, "path_tokens": total_tokens, "repeat": repeat, "pages": figures, "first_load_ms": first,
            "worst_p95_ms": worst, "goal_p95_ms": 200, "met": worst <= 200,
            "requests": after["requests"] - before["requests"] - 1,
            "scan_calls_during_requests": after_scans - before_scans,
            "discovery_passes_during_requests": after["rescans"] - before["rescans"],
        }
    finally:
        store.delete_run(force=True)
        store.close()


def run(quick: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    url = os.environ.get("TRACESTORE_URL")
    if url:
        figures["external"] = bench_server(url, quick)
    else:
        srv = EmbeddedServer().start()
        try:
            figures["valkey"] = bench_server(srv.url, quick)
        finally:
            srv.stop()
    for name, f in figures.items():
        print(f"   {name}: worst p95 {f['worst_p95_ms']} ms (goal 200), SCAN calls during {f['requests']} requests: "
              f"{f['scan_calls_during_requests']}", flush=True)
        for page, p in f["pages"].items():
            print(f"     {page:24s} p50 {p['p50_ms']:7.1f}  p95 {p['p95_ms']:7.1f}  max {p['max_ms']:7.1f} ms  "
                  f"{p['bytes']:>8d} B  (first {f['first_load_ms'][page]} ms)", flush=True)
    return figures
