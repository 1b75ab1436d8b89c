"""The trainer's report (``trainer/report.py``): what ``tracestore train`` prints and writes.

Pure: the report is built from the roles' stats as the driver collects them.
"""

from __future__ import annotations

import dataclasses

from tracestore import GateStatus
from tracestore.ray import HolderStats
from tracestore.trainer.config import TrainConfig
from tracestore.trainer.housekeeping import StoreCounts
from tracestore.trainer.learner import LearnerStats
from tracestore.trainer.producer import ProducerStats
from tracestore.trainer.report import EndState, Phases, Start, build_report, report_rows
from tracestore.trainer.rollout import WorkerStats


def _end(worker: tuple[float, float], producer: tuple[float, float], learner: tuple[float, float]) -> EndState:
    """An end state whose roles spent (store_s, busy_s) as given."""
    holder = HolderStats(sessions=0, refs=0, bytes=0, events=0, dropped=0, reconciles=0)
    return EndState(
        counts=StoreCounts(opened=0, released=0, live=0, events=0),
        gate=GateStatus("open", 20, 0, 0),
        workers=[WorkerStats(holder, [], worker[0], worker[1], 0, 0, holder_s=worker[0] / 2)],
        producer=ProducerStats({}, 0, 0, producer[0], producer[1]),
        learner=LearnerStats(learner[0], learner[1], 0, 20, 0, None),
        drained={},
        object_store_bytes=0,
        object_store_bytes_max=0,
    )


def _report(end: EndState, steps_done: int) -> dict[str, object]:
    cfg = TrainConfig(steps=20)
    start = Start(step=21 - steps_done, resumed=steps_done < 20)
    return build_report(cfg, start, [], end, Phases(0.0, 0.0, 0.0, 0.0, 0.0)).to_json()


def test_a_run_of_no_step_reports_no_share_above_one() -> None:
    """A resume that trained nothing printed `share of time in tracestore calls 96628100.0%`:
    the learner's start-up read of the gate (about 1 ms) over busy seconds of 0, floored at 1e-9."""
    rep = _report(_end((0.0, 0.0), (0.0, 0.0), (0.000966, 0.0)), steps_done=0)
    shares = [rep["tracestore_time_share"], rep["store_call_time_share"], rep["expert_put_time_share"]]
    by_role = rep["tracestore_time_share_by_role"]
    assert isinstance(by_role, dict)
    for share in [*shares, *by_role.values()]:
        assert isinstance(share, float) and 0.0 <= share <= 1.0, rep


def test_store_time_outside_busy_blocks_never_makes_a_share_above_one() -> None:
    """The producer polls the buffer between its rounds (store time outside its busy blocks):
    each share stays within [0, 1] and the roles' shares sum to the total."""
    end = _end((2.0, 10.0), (3.0, 1.0), (1.0, 4.0))
    rep = _report(end, steps_done=20)
    total = rep["tracestore_time_share"]
    assert isinstance(total, float)
    by_role = rep["tracestore_time_share_by_role"]
    assert isinstance(by_role, dict)
    assert 0.0 <= total <= 1.0
    assert abs(sum(by_role.values()) - total) < 1e-12
    assert abs(total - 6.0 / (10.0 + 3.0 + 4.0)) < 1e-12  # the producer's 3 s count as busy
    for row in report_rows(build_report(TrainConfig(steps=20), Start(1, False), [], end, Phases(0, 0, 0, 0, 0))):
        if str(row[0]).startswith("share of time"):
            assert row[1] == f"{100 * total:.1f}%"


def test_the_gateway_overhead_is_reported_by_part() -> None:
    """With HTTP agents the report splits the gateway's own time (its p50 per part), gives the
    engine call's p50 and the event loop's time on a core and waiting for one; local agents: None."""
    from tracestore.gateway.metrics import Metrics, Recent, Timing
    from tracestore.gateway.server import GatewayStats
    from tracestore.trainer.gateway_actor import GatewayActorStats

    recent, metrics = Recent(), Metrics()
    timing = Timing(start=0.0, engine_s=0.050, parts={"parse": 0.001, "admit": 0.002, "record": 0.003})
    metrics.observe(timing, 0.060, recent)  # 10 ms own time: 6 in parts, 4 other
    parts = {p: x for p in ("parse", "admit", "experts", "record", "respond", "other", "engine") if (x := recent.pct(p, 0.5)) is not None}
    assert abs(parts["other"] - 0.004) < 1e-9 and parts["experts"] == 0.0
    assert metrics.registry.get_sample_value("tracestore_gateway_latency_seconds_count", {"part": "admit"}) == 1
    holder = HolderStats(sessions=0, refs=0, bytes=0, events=0, dropped=0, reconciles=0)
    stats = GatewayStats(1, {"200": 1}, 0, recent.pct("overhead", 0.5), None, 0.060, parts, loop_run_s=2.0, loop_wait_s=3.0)
    end = dataclasses.replace(_end((0.0, 1.0), (0.0, 1.0), (0.0, 1.0)), gateway=GatewayActorStats(stats, holder))
    rep = _report(end, steps_done=20)
    assert abs(rep["gateway_overhead_p50_ms"] - 10.0) < 1e-6  # type: ignore[operator]
    split = rep["gateway_overhead_parts_p50_ms"]
    assert isinstance(split, dict) and "engine" not in split and abs(split["record"] - 3.0) < 1e-6
    assert abs(rep["gateway_engine_p50_ms"] - 50.0) < 1e-6  # type: ignore[operator]
    assert rep["gateway_loop_run_s"] == 2.0 and rep["gateway_loop_wait_s"] == 3.0
    rows = dict((str(r[0]), r[1]) for r in report_rows(build_report(TrainConfig(steps=20), Start(1, False), [], end, Phases(0, 0, 0, 0, 0))))
    assert str(rows["  by part (p50, ms)"]).startswith("parse 1, admit 2, experts 0, record 3")
    assert rows["gateway loop on a core / waiting for one (s)"] == "2 / 3"
    local = _report(_end((0.0, 1.0), (0.0, 1.0), (0.0, 1.0)), steps_done=20)
    assert local["gateway_overhead_parts_p50_ms"] is None and local["gateway_loop_run_s"] is None


def test_the_stats_of_several_gateways_merge_into_one() -> None:
    """--gateways N: counts, holders and the loops' times are summed; the p50s are those of the
    gateway with the highest p50 overhead, the p99 the highest; one gateway is itself."""
    from tracestore.gateway.server import GatewayStats
    from tracestore.trainer.gateway_actor import GatewayActorStats, merged

    def one(requests: int, p50: float, p99: float, refs: int) -> GatewayActorStats:
        holder = HolderStats(sessions=refs, refs=refs, bytes=10 * refs, events=1, dropped=2, reconciles=0)
        gw = GatewayStats(
            requests, {"200": requests, "503": 1}, 0, p50, p99, 2 * p50, {"admit": p50 / 2}, loop_run_s=1.0, loop_wait_s=0.5
        )
        return GatewayActorStats(gw, holder, tokens_discarded=3, turns_continued=1)

    a, b = one(100, 0.004, 0.050, 1), one(80, 0.006, 0.020, 2)
    assert merged([]) is None and merged([a]) is a
    m = merged([a, b])
    assert m is not None
    assert m.gateway.requests == 180 and m.gateway.by_status == {"200": 180, "503": 2}
    assert m.gateway.overhead_p50_s == 0.006 and m.gateway.parts_p50_s == {"admit": 0.003}
    assert m.gateway.total_p50_s == 0.012 and m.gateway.overhead_p99_s == 0.050
    assert m.gateway.loop_run_s == 2.0 and m.gateway.loop_wait_s == 1.0
    assert m.holder.refs == 3 and m.holder.bytes == 30 and m.holder.dropped == 4
    assert m.tokens_discarded == 6 and m.turns_continued == 2
    no_sched = dataclasses.replace(b, gateway=dataclasses.replace(b.gateway, loop_run_s=None, loop_wait_s=None))
    m2 = merged([a, no_sched])
    assert m2 is not None and m2.gateway.loop_run_s is None  # not a sum of what one could not read


def test_each_session_sticks_to_one_gateway() -> None:
    """The producer places a session on the same gateway every step (its experts are in that
    gateway's holder); the names are gateway, gateway-1, ...; the sessions spread over all."""
    from tracestore.trainer.http_agents import gateway_name, gateway_of

    names = [gateway_name(i) for i in range(3)]
    assert names == ["gateway", "gateway-1", "gateway-2"]
    sids = [f"s-{i}" for i in range(300)]
    placed = [gateway_of(s, names) for s in sids]
    assert placed == [gateway_of(s, names) for s in sids]
    assert all(placed.count(n) > 60 for n in names)
    assert {gateway_of(s, names[:1]) for s in sids} == {"gateway"}
