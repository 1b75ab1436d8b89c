"""The ceiling of one run's control-plane slot (issue 17 item 4, docs/capacity.md).

Every control-plane script of a run touches keys of one hash slot (``{R}``),
so one primary executes them all, one at a time. This benchmark measures,
on one dedicated standalone server (embedded valkey), what each operation
costs that primary with the actual scripts, and what that allows:

* every operation is driven through its public operation (the generators
  behind ``store.gate.admit``, ``store.open_session``, ...), many at once in
  one pipeline per step, so the client's round trips do not limit the rate;
* **server CPU per operation** = the change of the server process's
  ``used_cpu_user + used_cpu_sys`` divided by the operations (it includes
  reading the requests and writing the replies); **script time** = ``usec``
  of ``EVALSHA`` in ``INFO commandstats`` per operation (inside the scripts
  only; wall clock, so it rises when the machine is busy);
* the **ceiling** of an operation = 1 s / its server CPU: what one primary
  core could sustain with nothing else to do;
* **turns per second** of one slot for the agent loop the reference trainer
  and the gateway run: per turn a lease (admit + settle) and, with session
  affinity, a sticky route lookup; per session an open, a release (control
  plane only, the purge runs on the sessions' own slots) and, with
  affinity, its first route and its retire; per group of 8 sessions a put
  and its share of a take of 16 groups. ``turns_per_s = 1e6 / (per_turn + per_session / T + per_group /
  (8 T))`` for T turns per session.

The data plane (``record_turn``, ``lookup``, the purge) runs on the
sessions' own slots, spread over the cluster's primaries, and is not part of
this ceiling (see the traces benchmark).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Generator
from typing import Any

from tracestore import Group, TraceStore
from tracestore.scripts import Batch, Cmd, Eval, registry
from tracestore.servers import EmbeddedServer

#: Operations sent together in one pipeline step.
PIPELINE = 200
GROUP = 8


def drive(store: TraceStore, ops: list[Generator[Any, Any, Any]]) -> list[Any]:
    """Run many operations at once: every step sends the next request of each in one pipeline.

    A request that is itself a Batch is sent inline (its replies handed back
    together); others run alone. Returns the results in order.
    """
    results: list[Any] = [None] * len(ops)
    pending: dict[int, Any] = {}
    for i, op in enumerate(ops):
        pending[i] = next(op)
    while pending:
        flat: list[Eval | Cmd] = []
        spans: list[tuple[int, int, int, bool]] = []
        for i, req in pending.items():
            if isinstance(req, Batch):
                spans.append((i, len(flat), len(req.requests), True))
                flat.extend(req.requests)
            elif isinstance(req, (Eval, Cmd)):
                spans.append((i, len(flat), 1, False))
                flat.append(req)
            else:
                spans.append((i, -1, 0, False))
        replies = store.execute(Batch(tuple(flat))) if flat else []
        nxt: dict[int, Any] = {}
        for i, start, n, is_batch in spans:
            if start < 0:
                reply = store.execute(pending[i])
            else:
                reply = list(replies[start : start + n]) if is_batch else replies[start]
            try:
                nxt[i] = ops[i].send(reply)
            except StopIteration as stop:
                results[i] = stop.value
        pending = nxt
    return results


def _cpu(store: TraceStore) -> float:
    info = store.redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _evalsha(store: TraceStore) -> tuple[int, float]:
    st = store.redis.info("commandstats")
    calls = usec = 0.0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        if name in st:
            calls += float(st[name]["calls"])
            usec += float(st[name]["usec"])
    return int(calls), usec


def measure(
    store: TraceStore, n: int, make: Callable[[int], Generator[Any, Any, Any]], pipeline: int = PIPELINE
) -> dict[str, float]:
    """Server CPU and script time per operation for ``n`` operations ``make(i)``, ``pipeline`` at a time."""
    store.redis.config_resetstat()
    cpu0 = _cpu(store)
    t0 = time.perf_counter()
    for b in range(0, n, pipeline):
        drive(store, [make(i) for i in range(b, min(n, b + pipeline))])
    wall = time.perf_counter() - t0
    cpu = _cpu(store) - cpu0
    calls, usec = _evalsha(store)
    return {
        "ops": n,
        "server_cpu_us_per_op": round(1e6 * cpu / n, 2),
        "script_us_per_op": round(usec / n, 2),
        "scripts_per_op": round(calls / n, 2),
        "ceiling_ops_per_s": round(n / cpu) if cpu > 0 else 0,
        "client_ops_per_s": round(n / wall),
    }


def _fresh(url: str) -> TraceStore:
    st = TraceStore.connect(url, run=f"slot-{uuid.uuid4().hex[:8]}")
    for sc in registry().values():  # loaded up front: no NOSCRIPT round inside a measurement
        st.redis.script_load(sc.source)
    return st


def _round(url: str, n: int, out: dict[str, Any]) -> dict[str, dict[str, float]]:
    """One measurement of every operation on fresh runs of the server at ``url``."""
    ops: dict[str, dict[str, float]] = {}
    with _fresh(url) as st:
        info = st.redis.info("server")
        out["server"] = f"valkey {info.get('valkey_version') or info.get('redis_version')} standalone"
        build = st.ops  # operations built, run by measure()
        print("   admit + settle ...", flush=True)
        leases: list[Any] = []
        ops["admit"] = measure(st, n, lambda i: _collect(leases, build.gate.admit(f"s{i}", "w", 60)))
        ops["settle"] = measure(st, n, lambda i: build.gate.settle(leases[i], "completed"))
        burst = 100
        many: list[Any] = []
        am = measure(
            st, max(1, n // burst),
            lambda i: _collect(many, build.gate.admit_many([(f"m{i}.{j}", "w") for j in range(burst)], 60)),
        )
        ops["admit_many_per_lease"] = _per(am, burst)
        for b in range(0, len(many), 10):
            st.gate.settle_many([x for part in many[b : b + 10] for x in part], "completed")
        print("   open, release ...", flush=True)
        ops["open_session"] = measure(st, n, lambda i: build.open_session(f"o{i}", "rollout:0"))
        ops["release"] = measure(
            st, n, lambda i: build.release([f"o{i}"], "rollout:0", "done", purge=False)
        )
        batch = 100
        nb = max(1, n // batch)
        ob = measure(
            st, nb,
            lambda i: build.open_sessions([f"b{i}.{j}" for j in range(batch)], "rollout:0"),
        )
        ops["open_sessions_per_session"] = _per(ob, batch)
        rb_ = measure(
            st, nb,
            lambda i: build.release([f"b{i}.{j}" for j in range(batch)], "rollout:0", purge=False),
        )
        ops["release_batched_per_session"] = _per(rb_, batch)
    with _fresh(url) as st:
        build = st.ops  # operations built, run by measure()
        print("   put, take ...", flush=True)
        ng = max(1, n // GROUP)
        sids = [f"g{i}.{j}" for i in range(ng) for j in range(GROUP)]
        for b in range(0, len(sids), 4000):
            st.open_sessions(sids[b : b + 4000], "rollout:0")
        ops["put"] = measure(
            st, ng,
            lambda i: build.replay.put(
                Group(f"g{i}", "calc", tuple(sids[i * GROUP : (i + 1) * GROUP])), "rollout:0"
            ),
        )
        # a learner takes a batch of groups per step, one take at a time (concurrent takers
        # of one task contend for the head of the queue: see the replay benchmark)
        per_take = 16
        tk = measure(
            st, ng // per_take,
            lambda i: build.replay.take("calc", per_take, owner=f"train:{i}", current_version=0),
            pipeline=1,
        )
        ops["take_per_group"] = _per(tk, per_take)
    with _fresh(url) as st:
        print("   routes ...", flush=True)
        router = st.ops.router(["ep-a", "ep-b", "ep-c", "ep-d"])
        ops["route_new"] = measure(st, n, lambda i: router.acquire_route(f"r{i}"))
        ops["route_sticky"] = measure(st, n, lambda i: router.acquire_route(f"r{i}"))
        ops["route_retire"] = measure(st, n, lambda i: router.retire([f"r{i}"]))
    return ops


def run(quick: bool) -> dict[str, Any]:
    n = 2_000 if quick else 20_000
    rounds = 1 if quick else 3
    server = EmbeddedServer().start()
    out: dict[str, Any] = {"quick": quick, "pipeline": PIPELINE, "rounds": rounds}
    try:
        # the machine is shared: each operation's figure is the round with the least CPU per op
        every = [_round(server.url, n, out) for _ in range(rounds)]
        ops = {name: min((r[name] for r in every), key=lambda x: x["server_cpu_us_per_op"]) for name in every[0]}
        out["ops"] = ops

        def us(name: str) -> float:
            return ops[name]["server_cpu_us_per_op"]

        per_turn = us("admit") + us("settle")
        per_session = us("open_session") + us("release")
        per_session_batched = us("open_sessions_per_session") + us("release_batched_per_session")
        per_group = us("put") + us("take_per_group")
        turns: dict[str, Any] = {}
        for affinity in (False, True):
            pt = per_turn + (us("route_sticky") if affinity else 0.0)
            for label, ps in (("single", per_session), ("batched", per_session_batched)):
                ps_ = ps + ((us("route_new") - us("route_sticky") + us("route_retire")) if affinity else 0.0)
                for t in (1, 4, 16):
                    cost = pt + ps_ / t + per_group / (GROUP * t)
                    turns[f"{'affinity' if affinity else 'no affinity'}, {label} open/release, {t} turns/session"] = {
                        "server_cpu_us_per_turn": round(cost, 2),
                        "turns_per_s": round(1e6 / cost),
                    }
        out["turns"] = turns
        out["note"] = (
            "ceilings are server CPU of one primary core (valkey, single-threaded command execution); "
            "a production primary typically runs at most ~70% of that to keep latency low"
        )
        for name, row in ops.items():
            print(f"   {name:30s} {row['server_cpu_us_per_op']:8.1f} us/op  ceiling {row['ceiling_ops_per_s']:>8} /s")
        for name, row in turns.items():
            print(f"   {name:60s} {row['turns_per_s']:>8} turns/s")
        return out
    finally:
        server.stop()


def _collect(into: list[Any], op: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
    value = yield from op
    into.append(value)
    return value


def _per(row: dict[str, float], k: int) -> dict[str, float]:
    return {
        "ops": row["ops"] * k,
        "server_cpu_us_per_op": round(row["server_cpu_us_per_op"] / k, 2),
        "script_us_per_op": round(row["script_us_per_op"] / k, 2),
        "scripts_per_op": round(row["scripts_per_op"] / k, 4),
        "ceiling_ops_per_s": row["ceiling_ops_per_s"] * k,
        "client_ops_per_s": row["client_ops_per_s"] * k,
    }
