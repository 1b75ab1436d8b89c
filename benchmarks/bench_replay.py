"""Replay buffer: put/take throughput, take and expire cost at 10k, 100k and 1M groups, vs one Ray actor.

Figures, measured side by side in one process against one server (and one
Ray actor with the same semantics, ``benchmarks/baselines/actor_replay.py``):

* ``put_per_s`` / ``take_groups_per_s``: groups of 2 sessions, one client,
  sequential calls (``put``: two round trips, the traces' versions then the
  script; ``take`` of 8 groups: one); ``put_per_s_4threads``: four producer
  threads.
* ``scale``: the buffer filled to 10k, 100k and 1M groups (1k and 10k with
  ``--quick``), then, median of repetitions:
  - ``take512_ms``: one ``take`` of 512 groups (with a staleness bound, so
    the expiry range query runs too); ``take512_declared_ms``: the same with
    ``replay_declared_keys=True`` (plan, then commit: two round trips);
    ``take_many512_ms``: ``take_many`` of 256 groups of each of two tasks;
  - ``expire1pct_ms``: ``expire`` of 1% of the buffer (stale groups added
    first, untimed; non-retryable, so sessions are released and purged);
    ``expire1pct_us_per_group`` divides by the groups expired;
  - ``expire100_ms``: ``expire`` of a fixed 100 groups.
  Goals: a take of 512 at 10k no slower than the actor's; take and the
  fixed-size expiry at 1M within 1.5x of 10k (flat); expiry per expired
  group flat too (it is O(log n + k): expiring 1% of a 100x larger buffer
  does 100x the work).

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
from tracestore.replay import Group, put_request
from tracestore.scripts import Batch
from tracestore.servers import EmbeddedServer

from .baselines.actor_replay import remote_class

PRODUCER = "rollout:bench"
FILL_BATCH = 1000


def _ms(x: float) -> float:
    return round(1000 * x, 3)


def _groups(prefix: str, n: int, version: int, task: str = "math") -> list[Group]:
    return [
        Group(f"{prefix}{i}", task, (f"{prefix}{i}.a", f"{prefix}{i}.b"), min_version=version,
              retryable=False, payload={"rewards": [1.0, 0.0], "finish": ["stop", "stop"]})
        for i in range(n)
    ]


# -- tracestore ------------------------------------------------------------------------------


def fill(store: TraceStore, groups: list[Group]) -> None:
    """Open the groups' sessions and put the groups, pipelined (untimed setup; no traces to read)."""
    for i in range(0, len(groups), FILL_BATCH):
        part = groups[i : i + FILL_BATCH]
        store.open_sessions([s for g in part for s in g.sids], PRODUCER)
        store.execute(Batch(tuple(put_request(store.context, g, PRODUCER) for g in part)))


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
    return _take_rate(n_groups, batch, lambda b: list(store.replay.take("math", b, owner="train:bench")))


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _timed(reps: int, setup: Callable[[int], Any], body: Callable[[], int], want: int) -> float:
    """Median seconds of ``body()`` over ``reps`` runs, ``setup(r)`` (untimed) before each;
    ``body`` returns how many groups it handled, which must be ``want``."""
    times = []
    for r in range(reps):
        setup(r)
        t0 = time.perf_counter()
        n = body()
        times.append(time.perf_counter() - t0)
        assert n == want, (n, want)
    return _median(times)


def _scale(
    fill_groups: Callable[[list[Group]], Any],
    takes: dict[str, Callable[[], int]],
    expire: Callable[[], int],
    size: int,
    reps: int,
) -> dict[str, float]:
    """The ``scale`` figures of one buffer. ``takes``: figure name -> a call taking 512 groups
    (of task ``math``, or 256 of ``math`` and of ``code`` for ``take_many512_ms``); ``expire()``
    expires non-retryable groups and returns how many."""
    fill_groups(_groups("g", size, 10))
    fill_groups(_groups("c", size // 10, 10, "code"))
    out: dict[str, float] = {}
    for name, take in takes.items():
        take()  # warm up: scripts loaded, connection open
        fill_groups(_groups(f"{name}-warm-", 512, 10))
        fill_groups(_groups(f"{name}-warmc-", 512, 10, "code"))

        def refill(r: int, name: str = name) -> None:
            if r:
                fill_groups(_groups(f"{name}-{r}-", 512, 10))
                fill_groups(_groups(f"{name}-c{r}-", 256, 10, "code"))

        out[name] = _ms(_timed(reps, refill, take, 512))
    k = size // 100
    per = _timed(reps, lambda r: fill_groups(_groups(f"stale{r}-", k, 0)), expire, k)
    out["expire1pct_ms"] = _ms(per)
    out["expire1pct_us_per_group"] = round(1e6 * per / k, 2)
    out["expire100_ms"] = _ms(_timed(reps, lambda r: fill_groups(_groups(f"s100-{r}-", 100, 0)), expire, 100))
    return out


def ts_scale(url: str, size: int, reps: int) -> dict[str, float]:
    run = f"bench-rb-{uuid.uuid4().hex[:8]}"
    store = TraceStore.connect(url, run=run)
    declared = TraceStore.connect(url, run=run, replay_declared_keys=True)

    def take(st: TraceStore) -> Callable[[], int]:
        return lambda: len(st.replay.take("math", 512, owner="train:bench", current_version=10, max_staleness=5))

    def take_many() -> int:
        got = store.replay.take_many({"math": 256, "code": 256}, owner="train:bench", current_version=10,
                                     max_staleness=5)
        return len(got)

    try:
        return _scale(
            lambda groups: fill(store, groups),
            {"take512_ms": take(store), "take512_declared_ms": take(declared), "take_many512_ms": take_many},
            lambda: store.replay.expire(10, 5, retryable=False).expired,
            size,
            reps,
        )
    finally:
        store.close()
        declared.close()


# -- the actor baseline ----------------------------------------------------------------------


def _actor_args(g: Group) -> tuple[Any, ...]:
    return (g.gid, g.task, g.sids, g.status, g.min_version, g.retryable, g.payload)


def actor_fill(actor: Any, groups: list[Group]) -> None:
    import ray

    for i in range(0, len(groups), 10 * FILL_BATCH):
        part = groups[i : i + 10 * FILL_BATCH]
        ray.get(actor.open_sessions.remote([s for g in part for s in g.sids], PRODUCER))
        ray.get(actor.put_many.remote([_actor_args(g) for g in part], PRODUCER))


def actor_put_rate(actor: Any, n: int, threads: int = 1) -> float:
    import ray

    groups = _groups(f"p{threads}-", n, 10)
    ray.get(actor.open_sessions.remote([s for g in groups for s in g.sids], PRODUCER))
    return _put_rate(groups, threads, lambda g: ray.get(actor.put.remote(*_actor_args(g), PRODUCER)))


def actor_take_rate(actor: Any, n_groups: int, batch: int = 8) -> float:
    import ray

    return _take_rate(n_groups, batch, lambda b: ray.get(actor.take.remote("math", b, "train:bench")))


def actor_scale(cls: Any, size: int, reps: int) -> dict[str, float]:
    import ray

    actor = cls.remote()

    def take() -> int:
        return len(ray.get(actor.take.remote("math", 512, "train:bench", 10, "fifo", 5)))

    try:
        return _scale(
            lambda groups: actor_fill(actor, groups),
            {"take512_ms": take},
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

    sizes = (1_000, 10_000) if quick else (10_000, 100_000, 1_000_000)
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
            a["take512_vs_actor"] = round(a["take512_ms"] / b["take512_ms"], 2)
            scale[str(size)] = {"tracestore": a, "actor": b}
            print(f"   {size}: tracestore {a}\n   {size}: actor {b}", flush=True)
        small, large = scale[str(sizes[0])], scale[str(sizes[-1])]
        for who in ("tracestore", "actor"):
            for fig in large[who]:
                if fig.endswith("_ms") or fig.endswith("_per_group"):
                    scale.setdefault("growth", {}).setdefault(who, {})[fig] = round(
                        large[who][fig] / small[who][fig], 2
                    )
        out["scale"] = scale
        g = scale["growth"]["tracestore"]
        out["goal_take_no_slower_than_actor_at_smallest"] = small["tracestore"]["take512_vs_actor"] <= 1.0
        out["goal_take_flat_within_1.5x"] = g["take512_ms"] <= 1.5
        out["goal_expire100_flat_within_1.5x"] = g["expire100_ms"] <= 1.5
        out["goal_expire_per_group_flat_within_1.5x"] = g["expire1pct_us_per_group"] <= 1.5
        return out
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
