"""The trainer on a multi-node Ray cluster, longer than its tests (issue 16).

``python -m benchmarks multinode [--quick]``. Ray's multi-node test cluster
on this machine (``tests/_raycluster.py``: a head, two rollout nodes, one of
them on 127.0.0.2, and a learner node, each with its own raylet and object
store) and a local 3-primary Redis Cluster from the embedded binary. Three
disaggregated runs, one after the other:

1. ``spread``: workers on the two rollout nodes, the learner on the third;
   each node's object store bytes (the largest seen at a step boundary, and
   at the end), sessions opened / released / release events, refs held;
2. ``rollout_node_lost``: the same, with w0's node frozen while w0 holds a
   lease on a session of its own tag, then removed, after step 3; what
   reclaiming w0 did, the groups dropped, the counts at the end;
3. ``learner_node_lost``: the learner's node removed after step 5 (the
   last checkpoint is step 4's; the run ends as ``RoleLost``), a new learner
   node added, and ``--resume``: the counts of the one run across both
   processes.

Figures go to ``benchmarks/results/multinode.json``. Not a speed benchmark:
the figures are counts and bytes, which do not depend on the machine's load.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import threading
import time
import uuid
from collections import Counter
from typing import Any

STEPS = {"spread": 12, "rollout_node_lost": 10, "learner_node_lost": 8}
QUICK = {"spread": 4, "rollout_node_lost": 5, "learner_node_lost": 6}
SMALL: dict[str, Any] = {
    "prompts_per_step": 2,
    "group_size": 4,
    "warmup_steps": 30,
    "eval_every": 4,
    "eval_prompts": 4,
    "max_buffer": 2,
    "lease_ttl_s": 3.0,
    "owner_ttl_s": 3.0,
}
KEYS = (
    "steps",
    "sessions_opened",
    "sessions_released",
    "sessions_leaked",
    "release_events",
    "refs_held_at_end",
    "object_store_bytes_at_end",
    "object_store_bytes_max_seen",
    "object_store_bytes_per_node_at_end",
    "placement",
    "workers_lost",
    "groups",
    "routing_replay_fallbacks",
    "poisoned_leases",
    "gate_cycles",
    "resumed_from_step",
    "reclaimed_after_crash",
    "wall_s",
)


def _figures(report: Any, url: str, seen: dict[str, int]) -> dict[str, Any]:
    from tracestore import TraceStore

    out = {k: getattr(report, k) for k in KEYS}
    out["violations"] = report.violations()
    out["object_store_bytes_per_node_max_seen"] = dict(seen)
    with TraceStore.connect(url, run=report.run, create_run=False) as store:
        entries = store.redis.xrange(store.keys.events)
        out["run_counters"] = dataclasses.asdict(store.stats())  # what the report's counts come from
    per_sid = Counter(f[b"sid"] for _, f in entries)
    out["release_stream"] = {
        "entries": len(entries),
        "distinct_sessions": len(per_sid),
        "most_events_for_one_session": max(per_sid.values(), default=0),
        "by_reason": dict(Counter(f[b"reason"].decode() for _, f in entries)),
    }
    return out


def run(quick: bool) -> dict[str, Any]:
    import ray

    from tests._raycluster import Nodes, freeze_in_flight
    from tracestore.servers import LocalCluster
    from tracestore.trainer.actors import object_store_used_per_node
    from tracestore.trainer.config import TrainConfig
    from tracestore.trainer.loop import RoleLost
    from tracestore.trainer.loop import run as train

    steps = QUICK if quick else STEPS
    redis = LocalCluster(primaries=3).start()
    nodes = Nodes()
    ray.init(address=nodes.address, logging_level=logging.ERROR, log_to_driver=False)
    out: dict[str, Any] = {"nodes": 4, "redis_primaries": 3}
    try:
        with tempfile.TemporaryDirectory() as tmp:

            def cfg(name: str, **kw: Any) -> TrainConfig:
                return TrainConfig(
                    mode="disaggregated", url=redis.url, run=f"bench-{name}-{uuid.uuid4().hex[:6]}",
                    out=f"{tmp}/{name}", ray_address=nodes.address, worker_resources="rollout=1",
                    learner_resources="learner=1", workers=2, steps=steps[name], **{**SMALL, **kw},
                )

            def watcher(seen: dict[str, int], at_step: int | None = None, act: Any = None) -> Any:
                def progress(rec: Any) -> None:
                    for node, used in object_store_used_per_node().items():
                        seen[node] = max(seen.get(node, 0), used)
                    if rec.step == at_step:
                        act()
                return progress

            # 1. workers on two nodes, the learner on a third
            seen: dict[str, int] = {}
            c = cfg("spread", checkpoint_every=steps["spread"])
            print(f"   spread: {c.steps} steps", flush=True)
            out["spread"] = _figures(train(c, watcher(seen)), redis.url, seen)

            # 2. w0's node frozen inside a request, then removed, while step 4 trains
            seen = {}
            c = cfg("rollout_node_lost", checkpoint_every=steps["rollout_node_lost"])
            frozen: dict[str, Any] = {}

            def kill_rollout() -> None:
                t0 = time.monotonic()
                frozen["lease"], frozen["sid"] = freeze_in_flight(nodes.rollout_b, redis.url, c.run, "w0")
                nodes.cluster.remove_node(nodes.rollout_b, allow_graceful=False)
                frozen["node"] = "rollout_b (127.0.0.2, w0)"
                frozen["found_lease_after_s"] = round(time.monotonic() - t0, 2)

            killer = threading.Thread(target=kill_rollout)
            print(f"   rollout node lost after step 3 of {c.steps}", flush=True)
            try:
                report = train(c, watcher(seen, 3, killer.start))
            finally:
                killer.join()
            out["rollout_node_lost"] = {**_figures(report, redis.url, seen), "frozen": frozen}
            nodes.add_rollout_b()

            # 3. the learner's node removed after step 5 (checkpoint of step 4), then --resume
            seen = {}
            c = cfg("learner_node_lost", checkpoint_every=2)
            print(f"   learner node lost after step 5 of {c.steps}, then resumed", flush=True)
            lost: dict[str, Any] = {}
            try:
                train(c, watcher(seen, 5, lambda: nodes.cluster.remove_node(nodes.learner, allow_graceful=False)))
            except RoleLost as exc:
                lost = {"role": exc.role, "step": exc.step, "checkpoint": exc.checkpoint, "message": str(exc)}
            nodes.wait_dead(nodes.learner)  # a new run must not be placed on it
            nodes.add_learner()
            resumed = cfg("learner_node_lost", checkpoint_every=2)
            resumed.run, resumed.resume = c.run, True
            report = train(resumed, watcher(seen))
            out["learner_node_lost"] = {**_figures(report, redis.url, seen), "lost": lost}
    finally:
        ray.shutdown()
        nodes.cluster.shutdown()
        redis.stop()
    return out
