"""The trainer on a multi-node Ray cluster and a Redis Cluster (issue 16).

Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``) runs a
head and three nodes on this machine, each with its own raylet and its own
object store: two rollout nodes (custom resource ``rollout``; one of them on
the address 127.0.0.2, so the trainer sees it as another host) and a learner
node (``learner``). The store is the local 3-primary Redis Cluster.

* a disaggregated run spreads its rollout workers over the two rollout
  nodes, puts the learner on the third, and ends with no live session, no
  held ref, zero bytes in every node's object store and exactly one release
  event per session;
* a rollout node removed mid-run (its worker frozen inside a request
  first, so a lease is in flight): gc declares the worker's owner tag lost
  and releases its sessions once, its poisoned lease is cleared, and the run
  goes on to its last step with exact counts;
* without ``--url`` the default server (this host only) is refused; a URL
  is tried from every node; roles that cannot be placed are refused before
  anything starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from click.testing import CliRunner

from tests._raycluster import Nodes, freeze_in_flight, remove_frozen_node
from tests.test_trainer_e2e import FAST
from tracestore import TraceStore
from tracestore.cli import main as cli
from tracestore.cli.train import train_command
from tracestore.trainer.actors import ConfigError, kill, plan, remote, unreachable_from
from tracestore.trainer.checkpoint import load_state
from tracestore.trainer.config import TrainConfig
from tracestore.trainer.loop import run
from tracestore.trainer.report import Report

pytestmark = pytest.mark.ray

#: The other trainer tests' small configuration, one checkpoint at the end.
SMALL: dict[str, Any] = {**FAST, "checkpoint_every": 4}


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    n = Nodes()
    ray.init(address=n.address, logging_level=logging.ERROR, log_to_driver=False)
    yield n
    ray.shutdown()
    n.cluster.shutdown()


def _cfg(nodes: Nodes, url: str | None, tmp: Any, **kw: Any) -> TrainConfig:
    opts = {
        "mode": "disaggregated",
        "ray_address": nodes.address,
        "worker_resources": "rollout=1",
        "learner_resources": "learner=1",
        **SMALL,
        **kw,
    }
    return TrainConfig(url=url, run=f"t-{uuid.uuid4().hex[:10]}", out=str(tmp), **opts)


def _events(store: TraceStore) -> list[dict[str, str]]:
    """Every entry of the run's release stream (nothing trims it during these runs)."""
    entries = store.redis.xrange(store.keys.events)
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]


def _check_exact(report: Report, url: str, gone: str | None = None) -> list[dict[str, str]]:
    """Nothing left anywhere, one release event per session; returns the events.

    ``gone``: the label of a node removed during the run. Ray may not have
    declared it dead when the run ended (the report lists the nodes alive
    then): it may be listed, with nothing in its object store.
    """
    assert report.violations() == []
    assert report.sessions_opened > 0
    assert report.sessions_leaked == 0
    assert report.sessions_released == report.release_events == report.sessions_opened
    assert report.refs_held_at_end == 0 and report.expert_bytes_held_at_end == 0
    assert report.poisoned_leases == 0
    # each live node's own object store is empty, and every live node is listed
    live = {f"{n['NodeManagerAddress']}/{n['NodeID'][:8]}" for n in ray.nodes() if n["Alive"]}
    per_node = dict(report.object_store_bytes_per_node_at_end)
    if gone is not None:
        assert per_node.pop(gone, 0) == 0
    assert per_node == dict.fromkeys(live, 0)
    assert report.object_store_bytes_at_end == 0
    with TraceStore.connect(url, run=report.run, create_run=False) as store:
        assert store.sessions() == []
        # the report's counts are the run's exact counters (what the trainer reads)
        st = store.stats()
        assert (st.sessions_opened, st.sessions_released, st.sessions_live, st.release_events) == (
            report.sessions_opened, report.sessions_opened, 0, report.sessions_opened
        )
        # no heartbeat left: every role deregistered its tags when it closed, a lost worker's
        # tag was declared lost (which drops it), a resume deregistered the dead ones
        assert store.redis.zcard(store.keys.owners) == 0
        events = _events(store)
    per_sid = Counter(e["sid"] for e in events)
    assert len(per_sid) == report.sessions_opened and set(per_sid.values()) == {1}
    return events


@pytest.mark.parametrize("how", ["option", "RAY_ADDRESS"])
def test_a_ray_address_nobody_listens_on_is_one_line_and_exit_2(how: str, tmp_path: Any) -> None:
    """Checked with one TCP connect before ``ray.init``, which would retry for minutes."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = [sys.executable, "-m", "tracestore.trainer", "--steps", "1", "--out", str(tmp_path)]
    if how == "option":
        args += ["--ray-address", "127.0.0.1:1"]
    else:
        env["RAY_ADDRESS"] = "127.0.0.1:1"
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "error: cannot join the Ray cluster at '127.0.0.1:1': Connection refused (is `ray start "
        "--head` running there, on that port?)\n"
    )


def test_the_default_server_is_refused_when_nodes_are_on_other_hosts(nodes: Nodes, tmp_path: Any) -> None:
    """No --url on a cluster with a node on 127.0.0.2: exit 2, one line, nothing started."""
    r = CliRunner().invoke(
        cli, ["train", "--ray-address", nodes.address, "--steps", "1", "--out", str(tmp_path)]
    )
    assert r.exit_code == 2, r.output
    assert r.output == (
        "error: the Ray cluster has nodes on other hosts (127.0.0.2) and no --url was given: the "
        f"default server (unix://{os.environ['TRACESTORE_HOME']}/server/server.sock) answers on "
        "this host only; start a server every node reaches and pass its URL with --url or "
        "$TRACESTORE_URL (docs/deploy.md)\n"
    )
    assert not os.path.exists(tmp_path / "report.json")


def test_placement_and_reachability_are_checked_before_anything_starts(
    nodes: Nodes, cluster_url: str, tmp_path: Any
) -> None:
    cfg = _cfg(nodes, cluster_url, tmp_path, workers=2)
    p = plan(cfg)
    rollout = {n.node_id for n in (nodes.rollout_a, nodes.rollout_b)}
    assert {node.id for node in p.workers.values() if node is not None} == rollout
    # every node a role may land on tries the URL: a good one passes, a bad one names them all
    assert {n.id for n in p.candidates} >= rollout
    assert unreachable_from(p, cluster_url, cfg.run) == []
    bad = unreachable_from(p, "redis://127.0.0.1:1", cfg.run)
    assert [n.id for n, _ in bad] == [n.id for n in p.candidates]
    assert all(why == "Connection refused" for _, why in bad)
    with pytest.raises(ConfigError, match="no node of the Ray cluster offers --learner-resources 'gpu_box=1'"):
        plan(_cfg(nodes, cluster_url, tmp_path, learner_resources="gpu_box=1"))
    with pytest.raises(ConfigError, match="puts 2 on .* which cannot hold 2 x --worker-resources 'rollout=1'"):
        plan(_cfg(nodes, cluster_url, tmp_path, workers=4))
    assert set(plan(_cfg(nodes, cluster_url, tmp_path, placement="pack")).workers.values()) == {None}


def test_the_drivers_durability_level_reaches_the_roles_on_other_nodes(
    nodes: Nodes, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role's process inherits its node's ``ray start`` environment, not the driver's.

    The nodes of this cluster were started before the variable was set (as
    a ``TRACESTORE_DURABILITY`` exported only where ``tracestore train``
    runs): the learner, on another node, still connects with that level.
    """

    class Env:  # local: Ray ships it by value (a worker cannot import this test module)
        def get(self, name: str) -> str | None:
            return os.environ.get(name)

    monkeypatch.setenv("TRACESTORE_DURABILITY", "replicas")
    p = plan(_cfg(nodes, None, tmp_path))
    h = remote(Env, 1, **p.learner_options()).remote()
    try:
        assert ray.get(h.get.remote("TRACESTORE_DURABILITY"), timeout=120) == "replicas"
    finally:
        kill([h])


def test_disaggregated_run_over_three_nodes_leaves_every_object_store_empty(
    nodes: Nodes, cluster_url: str, tmp_path: Any
) -> None:
    """Workers on the two rollout nodes, the learner on the third: experts cross nodes and all go."""
    seen: dict[str, int] = Counter()

    def progress(rec: Any) -> None:  # each node's store while the run goes on
        from tracestore.trainer.actors import object_store_used_per_node

        for node, used in object_store_used_per_node().items():
            seen[node] = max(seen[node], used)

    report = run(_cfg(nodes, cluster_url, tmp_path, workers=2), progress)
    assert report.placement == {
        "producer": nodes.label(nodes.by_id(ray.get_runtime_context().get_node_id())),  # the driver's
        "learner": nodes.label(nodes.learner),
        "w0": nodes.label(nodes.rollout_b),  # 127.0.0.2 sorts first
        "w1": nodes.label(nodes.rollout_a),
    }
    assert [h.step for h in report.history] == [1, 2, 3, 4] and report.gate_cycles == 4
    # the learner borrowed every sample's experts from the workers on the other nodes
    assert report.routing_replay_fallbacks == 0
    assert report.workers_lost == {} and "lost" not in report.groups
    events = _check_exact(report, cluster_url)
    assert {e["reason"] for e in events} <= {"trained", "eval-done", "filtered", "failed", "run-end"}
    print(f"\nper-node object store bytes: max seen {dict(seen)}, at end {report.object_store_bytes_per_node_at_end}")


def test_the_learner_node_lost_is_one_line_and_exit_4_then_resume_finishes_the_run(
    nodes: Nodes, cluster_url: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The learner's node dies after the checkpoint of step 4: exit 4, then ``--resume`` on a new one."""
    opts = {
        **SMALL, "mode": "disaggregated", "url": cluster_url, "run": f"t-{uuid.uuid4().hex[:10]}",
        "ray_address": nodes.address, "worker_resources": "rollout=1", "learner_resources": "learner=1",
        "steps": 8, "checkpoint_every": 2, "lease_ttl_s": 3.0, "owner_ttl_s": 3.0, "out": str(tmp_path),
    }
    old = nodes.learner

    def kill_learner() -> None:
        while (state := load_state(TrainConfig(out=str(tmp_path)))) is None or state.step < 4:
            time.sleep(0.05)
        nodes.cluster.remove_node(old, allow_graceful=False)

    killer = threading.Thread(target=kill_learner, daemon=True)
    killer.start()
    with pytest.raises(SystemExit) as ended:
        train_command(**opts)
    killer.join()
    assert ended.value.code == 4
    last = capsys.readouterr().err.strip().splitlines()[-1]
    m = re.fullmatch(
        rf"error: the learner was lost after step (\d) \(on Ray node {re.escape(nodes.label(old))}\); "
        rf"resume on the nodes left with: tracestore train --resume --out {re.escape(str(tmp_path))}",
        last,
    )
    assert m is not None, last
    lost_after = int(m.group(1))
    assert 4 <= lost_after < 8
    nodes.wait_dead(old)
    new = nodes.add_learner()
    # the real resume: URL, run and mode from the checkpoint; the cluster from the option
    train_command(resume=True, out=str(tmp_path), ray_address=nodes.address)  # returns: no violation
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    assert report["run"] == opts["run"] and report["resumed_from_step"] >= 4
    assert [h["step"] for h in report["history"]] == list(range(1, 9))
    assert report["placement"]["learner"] == nodes.label(new)
    assert report["sessions_leaked"] == 0 and report["refs_held_at_end"] == 0
    assert report["sessions_released"] == report["release_events"] == report["sessions_opened"] > 0
    assert set(report["object_store_bytes_per_node_at_end"].values()) == {0}
    assert nodes.label(old) not in report["object_store_bytes_per_node_at_end"]


def _lose_w0_mid_run(nodes: Nodes, cluster_url: str, tmp_path: Any) -> tuple[Report, dict[str, str]]:
    """One run whose w0 node is frozen inside a request after step 2, then removed: (report, frozen)."""
    # The freeze must prove w0 is inside a request: a lease it handed back with its results stays
    # unsettled too, until the producer has every worker's results (w1's round can take over a
    # second on a busy machine: a 1 s watch was fooled in CI). Watching 4 s needs TTLs above it,
    # or gc would declare w0's tag lost during the watch.
    cfg = _cfg(nodes, cluster_url, tmp_path, workers=2, steps=5, lease_ttl_s=6.0, owner_ttl_s=6.0)
    victim = nodes.rollout_b  # w0's node (127.0.0.2 sorts first)
    frozen: dict[str, str] = {}
    errors: list[BaseException] = []

    def kill_node() -> None:  # while step 3 trains and the producer refills the buffer
        try:
            frozen["lease"], frozen["sid"] = freeze_in_flight(victim, cluster_url, cfg.run, "w0", settle_s=4.0)
            remove_frozen_node(nodes.cluster, victim)
        except BaseException as exc:
            errors.append(exc)

    killer = threading.Thread(target=kill_node)

    def progress(rec: Any) -> None:
        if rec.step == 2:
            killer.start()

    try:
        report = run(cfg, progress)
    finally:
        killer.join()
    assert not errors, errors
    nodes.wait_dead(victim)
    return report, frozen


def _settled_by_its_holder(url: str, run_id: str, lease: str) -> bool:
    """True if ``lease`` ended with an outcome its holder gave (settled, nobody resolved it).

    Then the freeze did not catch the worker inside that request (its
    precondition failed, whatever the watch saw): the run says nothing about a
    lease lost with its node.
    """
    with TraceStore.connect(url, run=run_id, create_run=False) as store:
        (rec,) = store.gate.lease_records([lease])
    return rec is not None and rec.outcome is not None and rec.resolution is None


def test_a_rollout_node_lost_mid_run_is_reclaimed_and_the_run_goes_on(
    nodes: Nodes, cluster_url: str, tmp_path: Any
) -> None:
    """The node of w0 dies inside a request after step 2; the run ends at step 5 with exact counts.

    Runs last in this module: the cluster keeps one rollout node afterwards.
    When the lease the freeze watched was settled by w0 after all (the
    freeze's precondition did not hold, which the lease's record shows), the
    run is repeated once on a new rollout node: the assertions below judge a
    run whose worker really died inside a request.
    """
    victim = nodes.rollout_b
    report, frozen = _lose_w0_mid_run(nodes, cluster_url, tmp_path / "a")
    if _settled_by_its_holder(cluster_url, report.run, frozen["lease"]):
        print(f"\nthe freeze missed w0's request ({frozen}): once more on a new node")
        victim = nodes.add_rollout_b()
        report, frozen = _lose_w0_mid_run(nodes, cluster_url, tmp_path / "b")
    assert [h.step for h in report.history] == [1, 2, 3, 4, 5]
    assert list(report.workers_lost) == ["w0"]
    reclaimed = report.workers_lost["w0"]
    with TraceStore.connect(cluster_url, run=report.run, create_run=False) as store:
        (rec,) = store.gate.lease_records([frozen["lease"]])
        # the frozen request's lease: poisoned at its deadline, cleared as its holder's loss
        assert rec is not None and rec.resolution == "holder-lost:w0", (rec, reclaimed, frozen)
        tags = {o.owner: o for o in store.owners()}
        (tag,) = [t for t in tags if t.startswith("rollout:w0.")]
        assert tags[tag].lost_ms is not None  # gc's script declared it lost
    assert reclaimed["owner tags declared lost"] == 1
    assert reclaimed["sessions released (owner-lost)"] >= 1
    assert reclaimed["poisoned leases cleared"] >= 1
    assert report.groups.get("lost", 0) >= 1  # the frozen session's group was dropped
    events = _check_exact(report, cluster_url, gone=nodes.label(victim))
    lost = [e for e in events if e["reason"] == "owner-lost"]
    assert len(lost) == reclaimed["sessions released (owner-lost)"]
    assert all(e["owner"].startswith("rollout:w0.") for e in lost)
    assert frozen["sid"] in {e["sid"] for e in lost}
    print(f"\nnode loss: {reclaimed}; groups {report.groups}; per-node bytes at end {report.object_store_bytes_per_node_at_end}")
