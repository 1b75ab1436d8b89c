"""Replay buffer: put/take throughput, take and expire cost at 10k, 100k and 1M groups, vs one Ray actor.

Figures, measured side by side in one process against one server (and one
Ray actor with the same semantics, ``benchmarks/baselines/actor_replay.py``):

* ``put_per_s`` / ``take_groups_per_s``: groups of 2 sessions, one client,
  sequential calls (``put``: two round trips, the traces' versions then the
  script; ``take`` of 8 groups: one); ``put_per_s_4threads``: four producer
  threads.
* ``scale``: one buffer filled to each of 10k, 100k and 1M groups (1k and
  10k with ``--quick``), all at once; then, median of 7 repetitions, each
  repetition visiting every size in turn (so load drift on a shared machine
  hits every size alike):
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
from dataclasses import dataclass
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


@dataclass
class Buffers:
    """One system under test, a buffer per size: how to fill one, the timed takes, the expiry."""

    fill: Callable[[int, list[Group]], Any]  # (size, groups)
    takes: dict[str, Callable[[int], int]]  # figure -> take 512 groups from the buffer of a size
    expire: Callable[[int], int]  # expire the stale non-retryable groups of a size; how many


Results = dict[str, dict[int, dict[str, float]]]  # system -> size -> figure -> seconds


def _rounds(
    systems: dict[str, Buffers], sizes: tuple[int, ...], reps: int,
    setup: Callable[[Buffers, int, int], Any], body: Callable[[Buffers, int], int], want: Callable[[int], int],
) -> dict[tuple[str, int], float]:
    """Median seconds of ``body(system, size)`` for every system and size: ``reps`` rounds, each
    visiting every (size, system) in turn, so load drift on a shared machine hits all alike.
    ``setup(system, size, round)`` (untimed) runs before each call; ``body`` returns how many
    groups it handled, which must be ``want(size)``."""
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(reps):
        for size in sizes:
            for name, sys_ in systems.items():
                setup(sys_, size, r)
                t0 = time.perf_counter()
                n = body(sys_, size)
                times.setdefault((name, size), []).append(time.perf_counter() - t0)
                assert n == want(size), (name, size, n, want(size))
    return {cell: _median(ts) for cell, ts in times.items()}


def scale(systems: dict[str, Buffers], sizes: tuple[int, ...], reps: int) -> Results:
    """The ``scale`` figures of every system at every size, in seconds (see the module docstring)."""
    out: Results = {name: {size: {} for size in sizes} for name in systems}

    def record(figure: str, medians: dict[tuple[str, int], float]) -> None:
        for (name, size), t in medians.items():
            out[name][size][figure] = t

    for size in sizes:
        for name, sys_ in systems.items():
            print(f"   fill {name} {size} ...", flush=True)
            sys_.fill(size, _groups("g", size, 10))
            sys_.fill(size, _groups("c", size // 10, 10, "code"))
    for figure in sorted({f for sys_ in systems.values() for f in sys_.takes}):
        users = {n: s for n, s in systems.items() if figure in s.takes}
        for size in sizes:
            for sys_ in users.values():
                sys_.takes[figure](size)  # warm up: scripts loaded, connection open
                sys_.fill(size, _groups(f"{figure}-warm-", 512, 10))
                sys_.fill(size, _groups(f"{figure}-warmc-", 512, 10, "code"))

        def refill(sys_: Buffers, size: int, r: int, figure: str = figure) -> None:
            sys_.fill(size, _groups(f"{figure}-{r}-", 512, 10))
            sys_.fill(size, _groups(f"{figure}-c{r}-", 256, 10, "code"))

        def take(sys_: Buffers, size: int, figure: str = figure) -> int:
            return sys_.takes[figure](size)

        record(figure, _rounds(users, sizes, reps, refill, take, lambda _: 512))
    record("expire1pct", _rounds(
        systems, sizes, reps, lambda s, size, r: s.fill(size, _groups(f"stale{r}-", size // 100, 0)),
        lambda s, size: s.expire(size), lambda size: size // 100,
    ))
    record("expire100", _rounds(
        systems, sizes, reps, lambda s, size, r: s.fill(size, _groups(f"s100-{r}-", 100, 0)),
        lambda s, size: s.expire(size), lambda _: 100,
    ))
    return out


def scale_table(got: Results, sizes: tuple[int, ...]) -> dict[str, Any]:
    """The figures of :func:`scale` in ms, per size and system, and their growth smallest -> largest."""
    table: dict[str, Any] = {}
    for size in sizes:
        row: dict[str, dict[str, float]] = {}
        for who, by_size in got.items():
            f = by_size[size]
            fig = {k: _ms(v) for k, v in f.items() if k.endswith("_ms")}
            fig["expire1pct_ms"] = _ms(f["expire1pct"])
            fig["expire1pct_us_per_group"] = round(1e6 * f["expire1pct"] / (size // 100), 2)
            fig["expire100_ms"] = _ms(f["expire100"])
            row[who] = fig
        row["tracestore"]["take512_vs_actor"] = round(row["tracestore"]["take512_ms"] / row["actor"]["take512_ms"], 2)
        table[str(size)] = row
        print(f"   {size}: tracestore {row['tracestore']}\n   {size}: actor {row['actor']}", flush=True)
    small, large = table[str(sizes[0])], table[str(sizes[-1])]
    table["growth"] = {
        who: {fig: round(large[who][fig] / small[who][fig], 2) for fig in large[who] if fig.endswith(("_ms", "_per_group"))}
        for who in got
    }
    return table


def ts_buffers(url: str, sizes: tuple[int, ...]) -> tuple[Buffers, Callable[[], None]]:
    """tracestore: one run per size on the same server (and a client of it with declared keys)."""
    runs = {size: f"bench-rb-{uuid.uuid4().hex[:8]}" for size in sizes}
    stores = {size: TraceStore.connect(url, run=run) for size, run in runs.items()}
    declared = {size: TraceStore.connect(url, run=run, replay_declared_keys=True) for size, run in runs.items()}

    def take(by_size: dict[int, TraceStore]) -> Callable[[int], int]:
        return lambda size: len(
            by_size[size].replay.take("math", 512, owner="train:bench", current_version=10, max_staleness=5)
        )

    def take_many(size: int) -> int:
        got = stores[size].replay.take_many(
            {"math": 256, "code": 256}, owner="train:bench", current_version=10, max_staleness=5
        )
        return len(got)

    def close() -> None:
        for st in (*stores.values(), *declared.values()):
            st.close()

    return Buffers(
        lambda size, groups: fill(stores[size], groups),
        {"take512_ms": take(stores), "take512_declared_ms": take(declared), "take_many512_ms": take_many},
        lambda size: stores[size].replay.expire(10, 5, retryable=False).expired,
    ), close


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


def actor_buffers(cls: Any, sizes: tuple[int, ...]) -> tuple[Buffers, Callable[[], None]]:
    """The actor baseline: one actor per size."""
    import ray

    actors = {size: cls.remote() for size in sizes}

    def take(size: int) -> int:
        return len(ray.get(actors[size].take.remote("math", 512, "train:bench", 10, "fifo", 5)))

    def close() -> None:
        for a in actors.values():
            ray.kill(a)

    return Buffers(
        lambda size, groups: actor_fill(actors[size], groups),
        {"take512_ms": take},
        lambda size: int(ray.get(actors[size].expire.remote(10, 5, False))),
    ), close


def _side_by_side(name: str, ours: Callable[[], Any], theirs: Callable[[], Any]) -> tuple[Any, Any]:
    print(f"   {name} ...", flush=True)
    return ours(), theirs()


def run(quick: bool) -> dict[str, Any]:
    import ray

    sizes = (1_000, 10_000) if quick else (10_000, 100_000, 1_000_000)
    n_rate = 500 if quick else 4_000
    reps = 3 if quick else 7
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
        ts, ts_close = ts_buffers(url, sizes)
        actor_sys, actor_close = actor_buffers(cls, sizes)
        try:
            got = scale({"tracestore": ts, "actor": actor_sys}, sizes, reps)
        finally:
            ts_close()
            actor_close()
        table = scale_table(got, sizes)
        out["scale"] = table
        g = table["growth"]["tracestore"]
        out["goal_take_no_slower_than_actor_at_smallest"] = table[str(sizes[0])]["tracestore"]["take512_vs_actor"] <= 1.0
        out["goal_take_flat_within_1.5x"] = g["take512_ms"] <= 1.5
        out["goal_expire100_flat_within_1.5x"] = g["expire100_ms"] <= 1.5
        out["goal_expire_per_group_flat_within_1.5x"] = g["expire1pct_us_per_group"] <= 1.5
        return out
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
