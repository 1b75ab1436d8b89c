"""The training loop: start the actors, alternate or overlap rollout and training, report.

``run(cfg)`` is what ``tracestore train`` and ``python -m trainer`` call. It
returns the report (a JSON-serialisable dict) and writes ``report.json`` and
``report.png`` into ``cfg.out``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from tracestore import TraceStore
from tracestore.connection import resolve_url

from . import deps
from .config import TASK, ConfigError, TrainConfig
from .roles import Learner, Producer, RolloutWorker, SimulatedCrash

Progress = Callable[[dict[str, Any]], None]


def _ckpt_dir(cfg: TrainConfig) -> str:
    return os.path.join(cfg.out, "ckpt")


def load_resume_state(cfg: TrainConfig) -> dict[str, Any] | None:
    path = os.path.join(_ckpt_dir(cfg), "state.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    return state


def store_counts(store: TraceStore) -> dict[str, int]:
    """Sessions opened / released / live and release events, read from the server."""
    k = store.keys
    live = len(store.sessions())
    released = int(store.redis.zcard(k.released))
    events = int(store.redis.xlen(k.events))
    return {"opened": live + released, "released": released, "live": live, "events": events}


def reclaim_dead_owners(
    store: TraceStore, lease_ttl_s: float, keep: tuple[str, ...] = ("replay",)
) -> dict[str, int]:
    """After a crash: release what the dead processes' owner tags still hold; resolve their leases.

    Requests in flight when the processes died hold leases nobody will
    settle: they stay live until their deadline, then poison the gate. The
    resuming trainer knows those holders are dead, so it waits for the
    deadlines and clears the poison (a weight update is refused until then),
    and reopens a gate that a learner killed inside a weight update left sealed.
    """
    out: dict[str, int] = {}
    for o in store.owners():
        if o.owner not in keep and o.sessions:
            out[o.owner] = len(store.release_owner(o.owner, "owner-lost"))
    deadline = time.monotonic() + lease_ttl_s + 5.0
    st = store.gate.status()
    while st.live and time.monotonic() < deadline:
        time.sleep(0.2)
        st = store.gate.status()
    cleared = 0
    while st.poison:  # status() lists the poison set 100 at a time
        got = store.gate.clear_poison([p.lease_id for p in st.poison], "resumed-holders-restarted")
        cleared += len(got)
        if not got:
            break
        st = store.gate.status()
    if cleared:
        out["poisoned leases cleared"] = cleared
    if st.state == "sealed":  # the learner died inside a weight update: nobody else reopens
        store.gate.reopen()
        out["gate reopened"] = 1
    return out


def drain_run(store: TraceStore, version: int) -> dict[str, int]:
    """End of run: take what is left in the buffer and release every owner's sessions."""
    left: dict[str, int] = {}
    try:
        n = deps.replay_count(store, TASK, "completed")
        if n:
            got = deps.replay_take(
                store, TASK, n, owner="shutdown", current_version=version, max_staleness=10**9
            )
            left["completed"] = len(got)
        for _ in range(100):
            got = deps.replay_claim_retry(store, TASK, 64, "shutdown")
            if not got:
                break
            left["retry"] = left.get("retry", 0) + len(got)
    finally:
        for o in store.owners():
            if o.sessions:
                left[f"released:{o.owner}"] = len(store.release_owner(o.owner, "run-end"))
    return left


def _actor(cls: Any, concurrency: int = 1) -> Any:
    import ray

    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": concurrency}
    return ray.remote(**opts)(cls)


def _object_store_used() -> int:
    """Bytes in use in the Ray object store, as the raylet reports them (lags by a heartbeat)."""
    import ray

    total = ray.cluster_resources().get("object_store_memory", 0.0)
    return int(total - ray.available_resources().get("object_store_memory", 0.0))


def _p50(xs: list[float]) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[len(s) // 2]


def run(cfg: TrainConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Train; return the report. Raises ConfigError on a bad configuration."""
    import ray

    cfg.validate()
    resume_state = load_resume_state(cfg) if cfg.resume else None
    if cfg.resume and resume_state is None:
        raise ConfigError(f"--resume: no checkpoint in {_ckpt_dir(cfg)}")
    if resume_state is not None:
        cfg.run = resume_state["cfg"]["run"]
    cfg.url = resolve_url(cfg.url)
    try:
        store = TraceStore.connect(cfg.url, run=cfg.run, retries=1, socket_timeout_s=5.0)
    except Exception as exc:
        raise ConfigError(f"cannot reach the store at {cfg.url}: {exc}") from exc
    os.makedirs(cfg.out, exist_ok=True)
    started_ray = False
    if not ray.is_initialized():
        # address="local": always a private Ray, never a cluster a stale record points at
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        started_ray = True
    t_wall = time.perf_counter()
    reclaimed: dict[str, int] = {}
    restored = False
    if resume_state is not None:
        if store_counts(store)["opened"] == 0:
            # an empty run: the server was lost too, the store comes back from the checkpoint
            deps.restore_store(store, os.path.join(_ckpt_dir(cfg), "store.ckpt"))
            restored = True
        reclaimed = reclaim_dead_owners(store, cfg.lease_ttl_s)
    t_reclaimed = time.perf_counter()
    names = [f"w{i}" for i in range(cfg.workers)]
    cj = cfg.to_json()
    # threaded: the learner borrows refs and pushes weights while a rollout runs (safe: a
    # weight push happens with the gate sealed and drained, so no generation is in flight)
    workers = {n: _actor(RolloutWorker, 3).remote(cj, n) for n in names}
    learner = _actor(Learner).remote(cj, workers)
    model_path = os.path.join(_ckpt_dir(cfg), "model.pt") if resume_state else None
    start = ray.get(learner.init.remote(resume_state, model_path))
    producer = _actor(Producer, 2).remote(cj, workers, start)
    t_loop = time.perf_counter()
    crashed = False
    history: list[dict[str, Any]] = list(resume_state["history"]) if resume_state else []
    forever = None
    plasma_max = 0
    try:
        if cfg.mode == "disaggregated":
            forever = producer.run_forever.remote()
        for step in range(start, cfg.steps + 1):
            if cfg.mode == "colocated":
                ray.get(producer.produce.remote(cfg.prompts_per_step))
            rec = ray.get(learner.step.remote(step, 5.0 if cfg.mode == "colocated" else 60.0))
            history.append(rec)
            plasma_max = max(plasma_max, _object_store_used())
            if progress is not None:
                progress(rec)
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                ray.get(learner.checkpoint.remote(step, _ckpt_dir(cfg)))
                if cfg.crash_after_step == step:
                    raise SimulatedCrash(f"simulated crash after the checkpoint of step {step}")
    except SimulatedCrash:
        crashed = True
        for h in [producer, learner, *workers.values()]:
            ray.kill(h, no_restart=True)
        store.close()
        if started_ray:
            ray.shutdown()
        return {"crashed_after_step": cfg.crash_after_step, "history": history}
    finally:
        if not crashed and forever is not None:
            ray.get(producer.stop.remote())
            ray.get(forever)
    t_loop_end = time.perf_counter()
    steps_done = cfg.steps + 1 - start
    lstats = ray.get(learner.stats.remote())
    pstats = ray.get(producer.stats.remote())
    drained = drain_run(store, lstats["version"])
    # the holders drop refs as their event consumers see the releases
    # and the raylet's view of the object store catches up within a few heartbeats
    deadline = time.monotonic() + cfg.holder_drain_s
    while True:
        wstats = ray.get([w.stats.remote() for w in workers.values()])
        refs = sum(w["holder"]["refs"] for w in wstats)
        plasma_used = _object_store_used()
        if (refs == 0 and plasma_used == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    t_drained = time.perf_counter()
    counts = store_counts(store)
    gate = store.gate.status()
    for h in [*workers.values()]:
        ray.get(h.close.remote())
    ray.get(producer.close.remote())
    ray.get(learner.close.remote())
    for h in [producer, learner, *workers.values()]:
        ray.kill(h)
    wall = time.perf_counter() - t_wall
    turn_s = [t for w in wstats for t in w["turn_s"]]
    store_s = sum(w["store_s"] for w in wstats) + pstats["store_s"] + lstats["store_s"]
    busy_s = sum(w["busy_s"] for w in wstats) + pstats["busy_s"] + lstats["busy_s"]
    rewards = [h["reward"] for h in history]
    k = max(1, min(5, len(rewards) // 4))  # first and last quarter, at most 5 steps
    evals = [h["eval_reward"] for h in history if "eval_reward" in h]
    aligns = [h["replay_max_abs_diff"] for h in history if h.get("replay_max_abs_diff") is not None]
    report: dict[str, Any] = {
        "mode": cfg.mode,
        "run": cfg.run,
        "steps": cfg.steps,
        "steps_this_process": steps_done,
        "resumed_from_step": start - 1 if resume_state else None,
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "eval_reward_before": lstats["baseline_eval"],
        "eval_reward_first": evals[0] if evals else None,
        "eval_reward_last": evals[-1] if evals else None,
        "steps_per_s": steps_done / max(1e-9, t_loop_end - t_loop),
        "wall_s": wall,
        "phases_s": {
            "reclaim": t_reclaimed - t_wall,
            "start_actors_and_warm_start": t_loop - t_reclaimed,
            "loop": t_loop_end - t_loop,
            "drain_and_holders": t_drained - t_loop_end,
        },
        "sessions_opened": counts["opened"],
        "sessions_released": counts["released"],
        "sessions_leaked": counts["live"],
        "release_events": counts["events"],
        "refs_held_at_end": refs,
        "expert_bytes_held_at_end": sum(w["holder"]["bytes"] for w in wstats),
        "object_store_bytes_at_end": plasma_used,
        "object_store_bytes_max_seen": plasma_max,
        "gate_cycles": lstats["gate_cycles"],
        "gate_version": gate.version,
        "poisoned_leases": gate.poisoned,
        "p50_turn_latency_ms": 1000 * _p50(turn_s),
        "turns": len(turn_s),
        "tracestore_time_share": store_s / max(1e-9, busy_s),
        "groups": pstats["groups"],
        "aborted_groups_claimed": pstats["claimed"],
        "aborted_requests": sum(w["aborted_requests"] for w in wstats),
        "replay_max_abs_diff": max(aligns) if aligns else None,
        "routing_replay_fallbacks": lstats["replay_fallbacks"],
        "invalid_responses": sum(w["invalid"] for w in wstats),
        "reclaimed_after_crash": reclaimed,
        "store_restored": restored,
        "drained_at_end": drained,
        "history": history,
    }
    store.close()
    if started_ray:
        ray.shutdown()
    with open(os.path.join(cfg.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(cfg.out, "report.png"))
    return report


def plot(report: dict[str, Any], path: str) -> None:
    """Reward (batch mean, evaluation) and staleness over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = report["history"]
    steps = [r["step"] for r in h]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, [r["reward"] for r in h], marker="o", label="batch reward")
    ev = [(r["step"], r["eval_reward"]) for r in h if "eval_reward" in r]
    if report.get("eval_reward_before") is not None:
        ev.insert(0, (0, report["eval_reward_before"]))
    if ev:
        a.plot(*zip(*ev, strict=True), marker="s", label="eval reward")
    a.set_ylabel("reward")
    a.legend()
    a.set_title(f"tracestore train ({report['mode']}, run {report['run']})")
    b.plot(steps, [r["staleness_mean"] for r in h], marker="o", label="mean staleness")
    b.plot(steps, [r["staleness_max"] for r in h], marker="x", label="max staleness")
    b.set_xlabel("step")
    b.set_ylabel("versions behind")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


REPORT_ROWS: list[tuple[str, str]] = [
    ("reward, first steps", "reward_first"),
    ("reward, last steps", "reward_last"),
    ("eval reward, before RL", "eval_reward_before"),
    ("eval reward, first eval", "eval_reward_first"),
    ("eval reward, last eval", "eval_reward_last"),
    ("steps/s", "steps_per_s"),
    ("wall time (s)", "wall_s"),
    ("sessions opened", "sessions_opened"),
    ("sessions released", "sessions_released"),
    ("sessions leaked", "sessions_leaked"),
    ("release events", "release_events"),
    ("refs held at end", "refs_held_at_end"),
    ("routed-expert bytes held at end", "expert_bytes_held_at_end"),
    ("Ray object store bytes in use at end", "object_store_bytes_at_end"),
    ("gate cycles", "gate_cycles"),
    ("poisoned leases", "poisoned_leases"),
    ("p50 turn latency (ms)", "p50_turn_latency_ms"),
    ("turns", "turns"),
    ("share of time in tracestore calls", "tracestore_time_share"),
    ("routing replay max |dlogp|", "replay_max_abs_diff"),
    ("requests aborted in flight", "aborted_requests"),
    ("aborted groups claimed back", "aborted_groups_claimed"),
]


def report_rows(report: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for label, key in REPORT_ROWS:
        v = report.get(key)
        if isinstance(v, float):
            v = f"{v:.3g}" if key != "tracestore_time_share" else f"{100 * v:.1f}%"
        rows.append([label, "-" if v is None else v])
    return rows
