"""What a run reports: one :class:`StepRecord` per step, and the :class:`Report` at the end.

:func:`build_report` assembles the report from typed parts (the roles'
stats, what the store and Ray hold at the end, the phase timings);
:func:`report_rows` is the table ``tracestore train`` prints,
:meth:`Report.violations` what makes it exit 1, :func:`plot` the figure.
``report.json`` is :meth:`Report.to_json` (one flat object).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .steps import StepRecord as StepRecord  # the records type of a step (checkpoints use it too)

if TYPE_CHECKING:
    from tracestore import GateStatus

    from .config import TrainConfig
    from .gateway_actor import GatewayActorStats
    from .housekeeping import StoreCounts
    from .learner import LearnerStats
    from .producer import ProducerStats
    from .rollout import WorkerStats


@dataclass(frozen=True)
class Start:
    """How this process started: the first step it runs, and what it did with a resumed run."""

    step: int
    resumed: bool
    #: Sessions released per dead owner tag, leases cleared, gate reopened (after a crash).
    reclaimed: dict[str, int] = field(default_factory=dict)
    #: The server was empty: the store came back from the checkpoint.
    restored: bool = False


@dataclass(frozen=True)
class EndState:
    """What is left when the loop is over: the store's counts and gate, the roles, Ray's store."""

    counts: StoreCounts
    gate: GateStatus
    workers: list[WorkerStats]
    producer: ProducerStats
    learner: LearnerStats
    drained: dict[str, int]
    object_store_bytes: int
    object_store_bytes_max: int
    #: With ``--agents http``: the gateway's counters and holder.
    gateway: GatewayActorStats | None = None
    #: Each live node's object store (node label -> bytes in use).
    object_store_bytes_per_node: dict[str, int] = field(default_factory=dict)
    #: Role -> the node it ran on.
    placement: dict[str, str] = field(default_factory=dict)
    #: Rollout workers that died during the run.
    lost_workers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Phases:
    """Wall-clock seconds of each phase of the run, and steps/s of the loop."""

    reclaim: float
    start_actors_and_warm_start: float
    loop: float
    drain_and_holders: float
    wall: float


@dataclass(frozen=True)
class Report:
    """The end-of-run report (``report.json``); see docs/trainer.md for each field."""

    mode: str
    agents: str
    run: str
    steps: int
    steps_this_process: int
    resumed_from_step: int | None
    # learning
    reward_first: float
    reward_last: float
    eval_reward_before: float | None
    eval_reward_first: float | None
    eval_reward_last: float | None
    replay_max_abs_diff: float | None
    routing_replay_fallbacks: int
    # speed
    steps_per_s: float
    wall_s: float
    phases_s: dict[str, float]
    p50_turn_latency_ms: float
    turns: int
    tracestore_time_share: float
    #: Of ``tracestore_time_share``: the Redis calls, and the holders' puts of routed experts (Ray).
    store_call_time_share: float
    expert_put_time_share: float
    #: Each role's seconds in tracestore calls over the same total busy seconds (they sum to
    #: ``tracestore_time_share``): ``workers`` (gate, traces, expert puts), ``producer``, ``learner``.
    tracestore_time_share_by_role: dict[str, float]
    # bookkeeping: nothing may be left behind
    sessions_opened: int
    sessions_released: int
    sessions_leaked: int
    release_events: int
    refs_held_at_end: int
    expert_bytes_held_at_end: int
    object_store_bytes_at_end: int
    object_store_bytes_max_seen: int
    #: Each live node's object store at the end (node ``IP/id`` -> bytes in use).
    object_store_bytes_per_node_at_end: dict[str, int]
    gate_cycles: int
    gate_version: int
    poisoned_leases: int
    # rollouts
    groups: dict[str, int]
    aborted_groups_claimed: int
    aborted_requests: int
    invalid_responses: int
    #: Weight updates and generations in flight (DESIGN section 15): ``continue`` or ``abort``;
    #: tokens generated and then thrown away (0 in ``continue`` mode unless a turn was held past
    #: ``hold_timeout_s``); turns a weight update stopped that were continued and recorded once.
    #: With ``--agents http`` these count the gateway's too (its Prometheus counters).
    on_weight_update: str
    tokens_generated: int
    tokens_discarded: int
    turns_continued: int
    # HTTP agents (None with local agents)
    #: Gateway processes (``--gateways``); with more than one, the p50s and parts below are
    #: those of the gateway whose p50 overhead is the highest, the counts and times their sums.
    gateways: int | None
    gateway_requests: int | None
    gateway_503s_retried: int | None
    gateway_410s: int | None
    agent_turns_given_up: int | None
    gateway_overhead_p50_ms: float | None
    #: The p50 of each part of the gateway's own time of a turn (ms; the parts of
    #: ``tracestore_gateway_latency_seconds{part}``: parse, admit, experts, record, respond, other)
    #: and of its engine call; p50s of parts do not add up to the p50 of the whole.
    gateway_overhead_parts_p50_ms: dict[str, float] | None
    gateway_engine_p50_ms: float | None
    #: Seconds the gateway's event-loop thread ran on a core and waited runnable for one during
    #: the run (Linux; None elsewhere): the CPU contention its turns queue behind.
    gateway_loop_run_s: float | None
    gateway_loop_wait_s: float | None
    # the cluster: where each role ran, rollout workers lost mid-run and how each was reclaimed
    placement: dict[str, str]
    workers_lost: dict[str, dict[str, int]]
    # resume and end of run
    reclaimed_after_crash: dict[str, int]
    store_restored: bool
    drained_at_end: dict[str, int]
    history: list[StepRecord]

    def violations(self) -> list[str]:
        """The invariants this run broke (empty when nothing leaked)."""
        bad = [
            name
            for name, n in (
                ("sessions leaked", self.sessions_leaked),
                ("refs held at end", self.refs_held_at_end),
                ("poisoned leases", self.poisoned_leases),
            )
            if n
        ]
        if self.release_events != self.sessions_opened:
            bad.append("release events != sessions opened")
        return bad

    def to_json(self) -> dict[str, Any]:
        """``report.json``: every field, the history as step records' JSON."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["history"] = [h.to_json() for h in self.history]
        return d

    def write(self, directory: str) -> None:
        """Write ``report.json`` and ``report.png`` into ``directory``."""
        with open(os.path.join(directory, "report.json"), "w") as f:
            json.dump(self.to_json(), f, indent=2)
        plot(self, os.path.join(directory, "report.png"))


def build_report(
    cfg: TrainConfig, start: Start, history: list[StepRecord], end: EndState, phases: Phases
) -> Report:
    """The report of a run that ended normally."""
    rewards = [h.reward for h in history]
    k = max(1, min(5, len(rewards) // 4))  # first and last quarter, at most 5 steps
    evals = [h.eval_reward for h in history if h.eval_reward is not None]
    aligns = [h.replay_max_abs_diff for h in history if h.replay_max_abs_diff is not None]
    turn_s = [t for w in end.workers for t in w.turn_s]
    http = end.producer.http
    gw = end.gateway
    if http is not None:  # HTTP agents: a turn's latency as the agent saw it
        turn_s += http.turn_s
    holders = [w.holder for w in end.workers] + ([gw.holder] if gw is not None else [])
    by_status = gw.gateway.by_status if gw is not None else {}
    overhead = gw.gateway.overhead_p50_s if gw is not None else None
    parts = gw.gateway.parts_p50_s if gw is not None else {}
    steps_done = cfg.steps + 1 - start.step
    return Report(
        mode=cfg.mode,
        agents=cfg.agents,
        run=cfg.run,
        steps=cfg.steps,
        steps_this_process=steps_done,
        resumed_from_step=start.step - 1 if start.resumed else None,
        reward_first=sum(rewards[:k]) / k,
        reward_last=sum(rewards[-k:]) / k,
        eval_reward_before=end.learner.baseline_eval,
        eval_reward_first=evals[0] if evals else None,
        eval_reward_last=evals[-1] if evals else None,
        replay_max_abs_diff=max(aligns) if aligns else None,
        routing_replay_fallbacks=end.learner.replay_fallbacks,
        steps_per_s=steps_done / max(1e-9, phases.loop),
        wall_s=phases.wall,
        phases_s={k: v for k, v in dataclasses.asdict(phases).items() if k != "wall"},
        p50_turn_latency_ms=1000 * _p50(turn_s),
        turns=len(turn_s),
        tracestore_time_share=_store_share(end),
        store_call_time_share=_store_share(end) - _put_share(end),
        expert_put_time_share=_put_share(end),
        tracestore_time_share_by_role=_shares_by_role(end),
        sessions_opened=end.counts.opened,
        sessions_released=end.counts.released,
        sessions_leaked=end.counts.live,
        release_events=end.counts.events,
        refs_held_at_end=sum(h.refs for h in holders),
        expert_bytes_held_at_end=sum(h.bytes for h in holders),
        object_store_bytes_at_end=end.object_store_bytes,
        object_store_bytes_max_seen=end.object_store_bytes_max,
        object_store_bytes_per_node_at_end=end.object_store_bytes_per_node,
        gate_cycles=end.learner.gate_cycles,
        gate_version=end.gate.version,
        poisoned_leases=end.gate.poisoned,
        groups=end.producer.groups,
        aborted_groups_claimed=end.producer.claimed,
        aborted_requests=sum(w.aborted_requests for w in end.workers),
        invalid_responses=sum(w.invalid for w in end.workers),
        on_weight_update=cfg.on_weight_update,
        tokens_generated=sum(w.tokens_generated for w in end.workers),
        tokens_discarded=sum(w.tokens_discarded for w in end.workers) + (gw.tokens_discarded if gw is not None else 0),
        turns_continued=sum(w.turns_continued for w in end.workers) + (gw.turns_continued if gw is not None else 0),
        gateways=cfg.gateways if gw is not None else None,
        gateway_requests=gw.gateway.requests if gw is not None else None,
        gateway_503s_retried=(by_status.get("503", 0) - http.gave_up) if gw is not None and http is not None else None,
        gateway_410s=by_status.get("410", 0) if gw is not None else None,
        agent_turns_given_up=http.gave_up if http is not None else None,
        gateway_overhead_p50_ms=1000 * overhead if overhead is not None else None,
        gateway_overhead_parts_p50_ms={k: 1000 * v for k, v in parts.items() if k != "engine"} if gw is not None else None,
        gateway_engine_p50_ms=1000 * parts["engine"] if "engine" in parts else None,
        gateway_loop_run_s=gw.gateway.loop_run_s if gw is not None else None,
        gateway_loop_wait_s=gw.gateway.loop_wait_s if gw is not None else None,
        placement=end.placement,
        workers_lost={w: end.learner.lost_workers.get(w, {}) for w in end.lost_workers},
        reclaimed_after_crash=start.reclaimed,
        store_restored=start.restored,
        drained_at_end=end.drained,
        history=history,
    )


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


def _busy_s(end: EndState) -> float:
    """The roles' busy seconds; a role's tracestore calls count as busy even outside its busy
    blocks (the producer polls the buffer between rounds), so no share exceeds 1."""
    times = [(w.busy_s, w.store_s) for w in end.workers]
    times += [(end.producer.busy_s, end.producer.store_s), (end.learner.busy_s, end.learner.store_s)]
    return sum(max(busy, store) for busy, store in times)


def _share(seconds: float, end: EndState) -> float:
    """``seconds`` over the roles' busy seconds; 0 when they were never busy (a run of no step:
    the share of nothing, not ``seconds`` over a 1e-9 floor as before, which printed 96628100%)."""
    busy = _busy_s(end)
    return seconds / busy if busy > 0 else 0.0


def _store_share(end: EndState) -> float:
    """Seconds inside tracestore calls over the roles' busy seconds (in [0, 1])."""
    return _share(sum(w.store_s for w in end.workers) + end.producer.store_s + end.learner.store_s, end)


def _shares_by_role(end: EndState) -> dict[str, float]:
    """Each role's seconds inside tracestore calls over all roles' busy seconds (they sum to the share)."""
    return {
        "workers": _share(sum(w.store_s for w in end.workers), end),
        "producer": _share(end.producer.store_s, end),
        "learner": _share(end.learner.store_s, end),
    }


def _put_share(end: EndState) -> float:
    """Seconds the holders spent putting routed experts (``ray.put``) over the roles' busy seconds."""
    return _share(sum(w.holder_s for w in end.workers), end)


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
    ("Ray nodes used", "placement"),
    ("rollout workers lost", "workers_lost"),
    ("gate cycles", "gate_cycles"),
    ("poisoned leases", "poisoned_leases"),
    ("p50 turn latency (ms)", "p50_turn_latency_ms"),
    ("turns", "turns"),
    ("share of time in tracestore calls", "tracestore_time_share"),
    ("  of which Redis calls", "store_call_time_share"),
    ("  of which expert puts (ray.put)", "expert_put_time_share"),
    ("  by role: workers / producer / learner", "tracestore_time_share_by_role"),
    ("routing replay max |dlogp|", "replay_max_abs_diff"),
    ("on weight update", "on_weight_update"),
    ("requests aborted in flight", "aborted_requests"),
    ("tokens generated", "tokens_generated"),
    ("tokens discarded (generated, then thrown away)", "tokens_discarded"),
    ("turns continued across a weight update", "turns_continued"),
    ("aborted groups claimed back", "aborted_groups_claimed"),
    ("agents", "agents"),
    ("gateways", "gateways"),
    ("gateway requests", "gateway_requests"),
    ("gateway 503s retried by the SDK", "gateway_503s_retried"),
    ("gateway 410s", "gateway_410s"),
    ("agent turns given up after retries", "agent_turns_given_up"),
    ("p50 gateway overhead (ms)", "gateway_overhead_p50_ms"),
    ("  by part (p50, ms)", "gateway_overhead_parts_p50_ms"),
    ("p50 gateway engine call (ms)", "gateway_engine_p50_ms"),
    ("gateway loop on a core / waiting for one (s)", "gateway_loop_run_s"),
]


def report_rows(report: Report) -> list[list[object]]:
    """The ``[label, value]`` rows ``tracestore train`` prints (floats to 3 digits, share in %)."""
    rows: list[list[object]] = []
    for label, key in REPORT_ROWS:
        v = getattr(report, key)
        if key == "placement":
            v = len(set(v.values())) or "-"
        elif key == "tracestore_time_share_by_role":
            v = " / ".join(f"{100 * x:.1f}%" for x in v.values())
        elif key == "gateway_overhead_parts_p50_ms" and v is not None:
            v = ", ".join(f"{k} {x:.3g}" for k, x in v.items()) or "-"
        elif key == "gateway_loop_run_s" and v is not None:
            w = report.gateway_loop_wait_s
            v = f"{v:.3g} / {w:.3g}" if w is not None else f"{v:.3g} / -"
        elif key == "workers_lost":
            v = ", ".join(v) if v else 0
        elif isinstance(v, float):
            v = f"{100 * v:.1f}%" if key.endswith("time_share") else f"{v:.3g}"
        rows.append([label, "-" if v is None else v])
    return rows


def plot(report: Report, path: str) -> None:
    """Reward (batch mean, evaluation) and staleness over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = report.history
    steps = [r.step for r in h]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, [r.reward for r in h], marker="o", label="batch reward")
    ev = [(r.step, r.eval_reward) for r in h if r.eval_reward is not None]
    if report.eval_reward_before is not None:
        ev.insert(0, (0, report.eval_reward_before))
    if ev:
        a.plot(*zip(*ev, strict=True), marker="s", label="eval reward")
    a.set_ylabel("reward")
    a.legend()
    a.set_title(f"tracestore train ({report.mode}, run {report.run})")
    b.plot(steps, [r.staleness_mean for r in h], marker="o", label="mean staleness")
    b.plot(steps, [r.staleness_max for r in h], marker="x", label="max staleness")
    b.set_xlabel("step")
    b.set_ylabel("versions behind")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
