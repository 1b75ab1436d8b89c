"""Durability levels: what each costs per call, as a ratio to ``durability="none"`` (issue 11 item 10).

One local cluster of 3 primaries with 1 replica each, AOF on every node
(``appendfsync everysec``, as compose.yaml documents), so every level can be
given. One store per level, all connected at once; the levels are measured
in turns, round after round (level A, B, C, D, then again), so that the
load of this shared machine falls on all of them alike. ``us_per_item``
is the median over the rounds of the mean time per item in a round;
``x_none`` the median over the rounds of that round's ratio to ``none``.

Calls (the four the issue names), on fresh sessions of the run:

* ``release``: ``release([sid], owner)`` (release script, then the purge);
* ``put``: ``replay.put`` of a group of 2 sessions;
* ``record_turn``: one turn (8 prompt + 16 response tokens) on a new session,
  after its ``lookup`` (not timed: a read, no wait);
* ``admit``: ``gate.admit`` (the settle is not timed).

Batch size 1: one call at a time. Batched: 64 items per round trip, the way
a framework batches them: ``release`` of 64 sessions, ``admit_many`` of 64,
and 64 ``put``/``record_turn`` operations whose requests are sent in one
pipeline (``store.execute(Batch(...))``, as ``benchmarks/bench_gate.py``
does); time per item.

Goal: ``replicas`` <= 1.6x ``none`` at batch size 1, <= 1.1x batched.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from tracestore import TraceStore
from tracestore.durability import LEVELS
from tracestore.replay import Group
from tracestore.servers import LocalCluster

OWNER = "producer"
BATCH = 64
PROMPT = "p" * 40
RESPONSE = " r" * 16


class Calls:
    """The timed calls of one store; ``prepare(n)`` makes the sessions they need (not timed)."""

    def __init__(self, store: TraceStore, tag: str) -> None:
        self.st = store
        self.tag = tag
        self.i = 0

    def _sids(self, n: int) -> list[str]:
        self.i += 1
        sids = [f"{self.tag}-{self.i}-{j}" for j in range(n)]
        self.st.open_sessions(sids, OWNER)
        return sids

    # each makes what its call needs (untimed) and returns (the timed call, items per call)
    def release(self, batch: int) -> tuple[Callable[[], Any], int]:
        sids = self._sids(batch)
        return (lambda: self.st.release(sids, OWNER)), batch

    def put(self, batch: int) -> tuple[Callable[[], Any], int]:
        sids = self._sids(2 * batch)
        groups = [Group(f"g{s}", "t", (s, sids[2 * k + 1])) for k, s in enumerate(sids[::2])]
        if batch == 1:
            return (lambda: self.st.replay.put(groups[0], OWNER)), 1
        build = self.st.ops
        return (lambda: self.st.gather(*[build.replay.put(g, OWNER) for g in groups])), batch

    def record_turn(self, batch: int) -> tuple[Callable[[], Any], int]:
        sids = self._sids(batch)
        prefixes = [self.st.lookup(s, PROMPT) for s in sids]
        kw: dict[str, Any] = {
            "delta_token_ids": list(range(8)), "response_token_ids": list(range(16)),
            "response_logprobs": [-0.5] * 16, "version": 0,
        }
        if batch == 1:
            return (lambda: self.st.record_turn(sids[0], PROMPT, RESPONSE, prefix=prefixes[0], **kw)), 1
        build = self.st.ops
        return (
            lambda: self.st.gather(
                *[build.record_turn(s, PROMPT, RESPONSE, prefix=m, **kw) for s, m in zip(sids, prefixes, strict=True)],
            )
        ), batch


def _timed(call: Callable[[], Any]) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def _admit_only(calls: Calls, batch: int) -> float:
    """Seconds per item of ``admit`` (or ``admit_many``) alone; the leases are settled untimed."""
    sids = calls._sids(batch)
    g = calls.st.gate
    t = time.perf_counter()
    leases = [g.admit(sids[0], "w", 60)] if batch == 1 else g.admit_many([(s, "w") for s in sids], 60)
    dt = time.perf_counter() - t
    g.settle_many(leases, "completed")
    return dt / batch


def measure(calls: dict[str, Calls], rounds: int, per_round: dict[int, int]) -> dict[str, Any]:
    """Per level, op and batch size: microseconds per item and the ratio to ``none`` (medians over rounds).

    The levels take turns within a round, starting with another one each round.
    """
    samples: dict[tuple[str, str, int], list[float]] = {}
    levels = list(calls)
    for r in range(rounds):
        order = levels[r % len(levels) :] + levels[: r % len(levels)]
        for op in ("release", "put", "record_turn", "admit"):
            for batch, n in per_round.items():
                for lvl in order:
                    c = calls[lvl]
                    per_item: list[float] = []
                    for _ in range(n):
                        if op == "admit":
                            per_item.append(_admit_only(c, batch))
                            continue
                        call, items = getattr(c, op)(batch)
                        per_item.append(_timed(call) / items)
                    samples.setdefault((lvl, op, batch), []).append(statistics.fmean(per_item))
    out: dict[str, Any] = {}
    for (lvl, op, batch), xs in samples.items():
        base = samples[("none", op, batch)]
        out.setdefault(lvl, {}).setdefault(op, {})[f"batch_{batch}"] = {
            "us_per_item": round(1e6 * statistics.median(xs), 1),
            # the ratio of each round (the levels measured one after the other), then the median
            "x_none": round(statistics.median(x / b for x, b in zip(xs, base, strict=True)), 3),
        }
    return out


def run(quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 30
    per_round = {1: 10 if quick else 40, BATCH: 2 if quick else 6}
    cluster = LocalCluster(
        primaries=3, replicas=1, extra_args=["--appendonly", "yes", "--appendfsync", "everysec"]
    ).start()
    stores: dict[str, TraceStore] = {}
    try:
        run_id = f"bench-durability-{os.getpid()}"
        for lvl in LEVELS:
            stores[lvl] = TraceStore.connect(cluster.url, run=run_id, durability=lvl)
        calls = {lvl: Calls(st, lvl.replace("+", "_")) for lvl, st in stores.items()}
        measure(calls, 1, {1: 5, BATCH: 1})  # warm up: scripts loaded on every node, pools filled
        figures = measure(calls, rounds, per_round)
    finally:
        for st in stores.values():
            st.close()
        cluster.stop()
    summary = {
        lvl: {f"{op} b{b.split('_')[1]}": figures[lvl][op][b]["x_none"] for op in figures[lvl] for b in figures[lvl][op]}
        for lvl in figures
    }
    worst_1 = max(figures["replicas"][op]["batch_1"]["x_none"] for op in figures["replicas"])
    worst_b = max(figures["replicas"][op][f"batch_{BATCH}"]["x_none"] for op in figures["replicas"])
    return {
        "server": "local cluster, 3 primaries + 3 replicas, valkey (embedded), appendonly yes, appendfsync everysec",
        "rounds": rounds,
        "calls_per_round": {f"batch_{b}": n for b, n in per_round.items()},
        "batch": BATCH,
        "levels": figures,
        "x_none": summary,
        "goal": {"replicas_batch_1": 1.6, "replicas_batched": 1.1},
        "replicas_worst_batch_1": worst_1,
        "replicas_worst_batched": worst_b,
    }
