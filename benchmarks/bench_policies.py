"""Take policies: the cost of a take of 512 groups by ``fifo``, ``staleness`` and ``priority``.

One buffer per size (10k and 100k groups; 1k and 10k with ``--quick``), two
sessions per group, filled untimed; half the groups carry a
``payload["priority"]`` (the others have none, as a buffer mixing both would),
a second buffer of the same size has no priority at all (what a user of
``fifo`` or ``staleness`` pays for the priority index: one ``EXISTS`` per
cell). Then, median of 15 repetitions (3 with ``--quick``), each visiting
every buffer and policy in turn so that load drift on a shared machine hits
them alike: one ``take`` of 512 groups with a staleness bound (the expiry
range query runs too), refilled untimed after each take.

Figures: ``take512_ms[buffer][policy][size]`` (wall time of the call) and,
on the benchmark's own server, ``take512_server_us`` (the server's time in
the call's scripts, ``INFO commandstats``: what the policy and its index cost
the server; ``take512_server_us_min``: the fastest repetition, the least
disturbed by other processes) and ``take512_commands`` (the Redis commands the take's scripts
called, from the same stats: exact, whatever the load; on a loaded 2-core
machine the times swing 2x between runs, so compare those within one run
only). Run on a tracestore without
the ``priority`` policy (an older checkout on ``PYTHONPATH``), it measures
the other two only, for a side-by-side with the same file.
Server: ``$TRACESTORE_URL`` if set, else an embedded valkey-server.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
import uuid
from typing import Any

from tracestore import TraceStore
from tracestore.replay import Group, put_request
from tracestore.scripts import Batch
from tracestore.servers import EmbeddedServer

PRODUCER = "rollout:bench"
FILL_BATCH = 1000
TAKE = 512


def _policies() -> list[str]:
    from tracestore import replay

    return list(getattr(replay, "POLICIES", ("fifo", "staleness")))


def _groups(prefix: str, n: int, with_priority: bool) -> list[Group]:
    out = []
    for i in range(n):
        payload: dict[str, Any] = {"rewards": [1.0, 0.0], "finish": ["stop", "stop"]}
        if with_priority and i % 2 == 0:
            payload["priority"] = (i * 7919) % 1000 / 10
        out.append(Group(f"{prefix}{i}", "math", (f"{prefix}{i}.a", f"{prefix}{i}.b"), min_version=5 + i % 6,
                         retryable=False, payload=payload))
    return out


def _fill(store: TraceStore, groups: list[Group]) -> None:
    for i in range(0, len(groups), FILL_BATCH):
        part = groups[i : i + FILL_BATCH]
        store.open_sessions([s for g in part for s in g.sids], PRODUCER)
        store.execute(Batch(tuple(put_request(store.context, g, PRODUCER) for g in part)))


def run(quick: bool) -> dict[str, Any]:
    sizes = (1_000, 10_000) if quick else (10_000, 100_000)
    reps = 3 if quick else 15
    policies = _policies()
    env_url = os.environ.get("TRACESTORE_URL")
    server = None if env_url else EmbeddedServer().start()
    url = env_url or (server.url if server else "")
    buffers = {"half_with_priority": True, "no_priority": False}
    stores: dict[tuple[str, int], TraceStore] = {}
    refills = itertools.count()
    try:
        for (name, prio), size in itertools.product(buffers.items(), sizes):
            st = TraceStore.connect(url, run=f"bench-pol-{uuid.uuid4().hex[:8]}")
            stores[name, size] = st
            print(f"   fill {name} {size} ...", flush=True)
            _fill(st, _groups("g", size, prio))
        times: dict[tuple[str, str, int], list[float]] = {}
        server_us: dict[tuple[str, str, int], list[float]] = {}
        commands: dict[tuple[str, str, int], list[float]] = {}
        for _ in range(reps):
            for (name, size), st in stores.items():
                for policy in policies:
                    if server is not None:
                        st.redis.config_resetstat()
                    t0 = time.perf_counter()
                    got = st.replay.take("math", TAKE, owner="train:bench", current_version=10,
                                         max_staleness=5, policy=policy)
                    times.setdefault((name, policy, size), []).append(time.perf_counter() - t0)
                    if server is not None:
                        stats = st.redis.info("commandstats")
                        us = sum(v["usec"] for k, v in stats.items() if k.startswith("cmdstat_eval"))
                        server_us.setdefault((name, policy, size), []).append(us)
                        calls = sum(v["calls"] for k, v in stats.items()
                                    if not k.startswith(("cmdstat_eval", "cmdstat_config", "cmdstat_info")))
                        commands.setdefault((name, policy, size), []).append(calls)
                    assert len(got) == TAKE
                    st.release_owner("train:bench", "bench")
                    _fill(st, _groups(f"r{next(refills)}-", TAKE, buffers[name]))
        def table(got: dict[tuple[str, str, int], list[float]], scale: float, pick: Any = statistics.median
                  ) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for (name, policy, size), xs in sorted(got.items()):
                out.setdefault(name, {}).setdefault(policy, {})[str(size)] = round(scale * pick(xs), 3)
            return out

        return {"sizes": list(sizes), "quick": quick, "reps": reps, "policies": policies,
                "server": url.split("@")[-1], "take512_ms": table(times, 1000),
                "take512_server_us": table(server_us, 1), "take512_server_us_min": table(server_us, 1, min),
                "take512_commands": table(commands, 1)}
    finally:
        for st in stores.values():
            st.close()
        if server is not None:
            server.stop()
