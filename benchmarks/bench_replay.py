"""Replay buffer: put/take throughput, take and expire cost at 10k vs 100k groups, vs one Ray actor.

Figures, measured side by side in one process against one server (and one
Ray actor with the same semantics, ``benchmarks/baselines/actor_replay.py``):

* ``put_per_s`` / ``take_groups_per_s``: groups of 2 sessions, one client,
  sequential calls (``put``: one round trip; ``take`` of 8 groups: two);
  ``put_per_s_4threads``: four producer threads.
* ``scale``: the buffer filled to 10k and to 100k groups (1k and 10k with
  ``--quick``), then, median of repetitions:
  - ``take512_ms``: one ``take`` of 512 groups (with a staleness bound, so
    the expiry range query runs too);
  - ``expire1pct_ms``: ``expire`` of 1% of the buffer (stale groups added
    first, untimed; non-retryable, so sessions are released and purged);
    ``expire1pct_us_per_group`` divides by the groups expired;
  - ``expire100_ms``: ``expire`` of a fixed 100 groups.
  Goal: time at the large size within 1.5x of the small size, for take and
  for expire per expired group (expiry is O(log n + k), so expiring 1% of a
  10x larger buffer does 10x the work; ``expire100_ms`` shows the fixed-k cost).

Server: ``$TRACESTORE_URL`` if set, else an embedded valkey-server.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from tracestore import TraceStore
from tracestore.replay import Group, put
from tracestore.scripts import Batch
from tracestore.servers import EmbeddedServer

from .baselines.actor_replay import remote_class

PRODUCER = "rollout:bench"
FILL_BATCH = 1000


def _ms(x: float) -> float:
    return round(1000 * x, 3)


def _groups(prefix: str, n: int, version: int) -> list[Group]:
    return [
        Group(f"{prefix}{i}", "math", (f"{prefix}{i}.a", f"{prefix}{i}.b"), min_version=version,
              payload={"rewards": [1.0, 0.0], "finish": ["stop", "stop"]})
        for i in range(n)
    ]


# -- tracestore ------------------------------------------------------------------------------


def fill(store: TraceStore, groups: list[Group]) -> None:
    """Open the groups' sessions and put the groups, pipelined (untimed setup)."""
    for i in range(0, len(groups), FILL_BATCH):
        part = groups[i : i + FILL_BATCH]
        store.open_sessions([s for g in part for s in g.sids], PRODUCER)
        evals = [next(put(store.context, g, PRODUCER)) for g in part]
        store.execute(Batch(tuple(evals)))


def _put_rate(groups: list[Group], threads: int, put_one: Callable[[Group], Any]) -> float:
    """Groups put per second, ``groups`` split evenly over ``threads`` threads."""
    per = len(groups) // threads

    def work(j: int) -> None:
        for g in groups[j * per : (j + 1) * per]:
            put_one(g)

    start = time.perf_counter()
    ts = [threading.Thread(target=work, args=(j,)) for j in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return per * threads / (time.perf_counter() - start)


def _take_rate(n_groups: int, batch: int, take_batch: Callable[[int], list[Any]]) -> float:
    """Groups taken per second, ``batch`` at a time, until ``n_groups`` or the buffer is empty."""
    taken = 0
    start = time.perf_counter()
    while taken + batch <= n_groups:
        got = take_batch(batch)
        if not got:
            break
        taken += len(got)
    return taken / (time.perf_counter() - start)


def ts_put_rate(store: TraceStore, n: int, threads: int = 1) -> float:
    groups = _groups(f"p{threads}-", n, 10)
    store.open_sessions([s for g in groups for s in g.sids], PRODUCER)
    return _put_rate(groups, threads, lambda g: store.replay.put(g, PRODUCER))


def ts_take_rate(store: TraceStore, n_groups: int, batch: int = 8) -> float:
    return _take_rate(n_groups, batch, lambda b: store.replay.take("math", b, owner="train:bench"))


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _scale(
    fill_groups: Callable[[list[Group]], Any],
    take: Callable[[int], Any],
    expire: Callable[[], int],
    size: int,
    reps: int,
) -> dict[str, float]:
    """The ``scale`` figures of one buffer: ``take(n)`` takes n groups (512 with a staleness
    bound, 1 without: the untimed warm-up), ``expire()`` expires non-retryable and counts."""
    fill_groups(_groups("g", size, 10))
    fill_groups(_groups("warm", 1, 10))
    take(1)  # warm up: scripts loaded, connection open
    take_t = []
    for r in range(reps):
        t0 = time.perf_counter()
        got = take(512)
        take_t.append(time.perf_counter() - t0)
        assert len(got) == 512
        fill_groups(_groups(f"refill{r}-", 512, 10))
    exp_t, exp100_t = [], []
    k = size // 100
    for r in range(reps):
        fill_groups(_groups(f"stale{r}-", k, 0))
        t0 = time.perf_counter()
        n = expire()
        exp_t.append(time.perf_counter() - t0)
        assert n == k
        fill_groups(_groups(f"s100-{r}-", 100, 0))
        t0 = time.perf_counter()
        n = expire()
        exp100_t.append(time.perf_counter() - t0)
        assert n == 100
    return {
        "take512_ms": _ms(_median(take_t)),
        "expire1pct_ms": _ms(_median(exp_t)),
        "expire1pct_us_per_group": round(1e6 * _median(exp_t) / k, 2),
        "expire100_ms": _ms(_median(exp100_t)),
    }


def ts_scale(url: str, size: int, reps: int) -> dict[str, float]:
    store = TraceStore.connect(url, run=f"bench-rb-{uuid.uuid4().hex[:8]}")

    def take(n: int) -> Any:
        if n == 1:
            return store.replay.take("math", 1, owner="train:bench")
        return store.replay.take("math", n, owner="train:bench", current_version=10, max_staleness=5)

    try:
        out = _scale(
            lambda groups: fill(store, groups),
            take,
            lambda: store.replay.expire(10, 5, retryable=False).expired,
            size,
            reps,
        )
        assert store.replay.count() == size
        return out
    finally:
        store.close()


# -- the actor baseline ----------------------------------------------------------------------


def actor_fill(actor: Any, groups: list[Group]) -> None:
    import ray

    for i in range(0, len(groups), FILL_BATCH):
        part = groups[i : i + FILL_BATCH]
        ray.get(actor.open_sessions.remote([s for g in part for s in g.sids], PRODUCER))
        ray.get([
            actor.put.remote(g.gid, g.task, g.sids, g.status, g.min_version, g.retryable, g.payload, PRODUCER)
            for g in part
        ])


def actor_put_rate(actor: Any, n: int, threads: int = 1) -> float:
    import ray

    groups = _groups(f"p{threads}-", n, 10)
    ray.get(actor.open_sessions.remote([s for g in groups for s in g.sids], PRODUCER))
    return _put_rate(groups, threads, lambda g: ray.get(
        actor.put.remote(g.gid, g.task, g.sids, g.status, g.min_version, g.retryable, g.payload, PRODUCER)
    ))


def actor_take_rate(actor: Any, n_groups: int, batch: int = 8) -> float:
    import ray

    return _take_rate(n_groups, batch, lambda b: ray.get(actor.take.remote("math", b, "train:bench")))


def actor_scale(cls: Any, size: int, reps: int) -> dict[str, float]:
    import ray

    actor = cls.remote()

    def take(n: int) -> Any:
        if n == 1:
            return ray.get(actor.take.remote("math", 1, "train:bench"))
        return ray.get(actor.take.remote("math", n, "train:bench", 10, "fifo", 5))

    try:
        return _scale(
            lambda groups: actor_fill(actor, groups),
            take,
            lambda: ray.get(actor.expire.remote(10, 5, False)),
            size,
            reps,
        )
    finally:
        ray.kill(actor)


def _side_by_side(name: str, ours: Callable[[], Any], theirs: Callable[[], Any]) -> tuple[Any, Any]:
    print(f"   {name} ...", flush=True)
    return ours(), theirs()


def run(quick: bool) -> dict[str, Any]:
    import ray

    sizes = (1_000, 10_000) if quick else (10_000, 100_000)
    n_rate = 500 if quick else 4_000
    reps = 3 if quick else 5
    env_url = os.environ.get("TRACESTORE_URL")
    server = None if env_url else EmbeddedServer().start()
    url = env_url or (server.url if server else "")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        from ray import cloudpickle

        from .baselines import actor_replay

        # Ray workers may not have the repository on sys.path: ship the class by value.
        cloudpickle.register_pickle_by_value(actor_replay)
        cls = remote_class()
        out: dict[str, Any] = {"sizes": list(sizes), "quick": quick, "server": url.split("@")[-1]}
        store = TraceStore.connect(url, run=f"bench-rb-{uuid.uuid4().hex[:8]}")
        actor = cls.remote()
        try:
            a, b = _side_by_side("put (1 thread)", lambda: ts_put_rate(store, n_rate),
                                 lambda: actor_put_rate(actor, n_rate))
            out["put_per_s"] = {"tracestore": round(a), "actor": round(b), "ratio": round(a / b, 2)}
            a, b = _side_by_side("take 8 (1 thread)", lambda: ts_take_rate(store, n_rate),
                                 lambda: actor_take_rate(actor, n_rate))
            out["take_groups_per_s"] = {"tracestore": round(a), "actor": round(b), "ratio": round(a / b, 2)}
            a, b = _side_by_side("put (4 threads)", lambda: ts_put_rate(store, n_rate, 4),
                                 lambda: actor_put_rate(actor, n_rate, 4))
            out["put_per_s_4threads"] = {"tracestore": round(a), "actor": round(b), "ratio": round(a / b, 2)}
        finally:
            store.close()
            ray.kill(actor)
        scale: dict[str, Any] = {}
        for size in sizes:
            a, b = _side_by_side(f"scale {size}", lambda size=size: ts_scale(url, size, reps),
                                 lambda size=size: actor_scale(cls, size, reps))
            scale[str(size)] = {"tracestore": a, "actor": b}
        small, large = (scale[str(s)] for s in sizes)
        for who in ("tracestore", "actor"):
            for fig in ("take512_ms", "expire1pct_us_per_group", "expire100_ms", "expire1pct_ms"):
                scale.setdefault("growth", {}).setdefault(who, {})[fig] = round(
                    large[who][fig] / small[who][fig], 2
                )
        out["scale"] = scale
        g = scale["growth"]["tracestore"]
        out["goal_take_within_1.5x"] = g["take512_ms"] <= 1.5
        out["goal_expire_per_group_within_1.5x"] = g["expire1pct_us_per_group"] <= 1.5
        return out
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
