"""compose.yaml describes the same cluster as ``tracestore cluster up --primaries 3 --replicas 1``.

No Docker engine runs on the CI machines, so the file is parsed and checked
against the topology the local cluster really starts.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tracestore.servers import LocalCluster

COMPOSE = Path(__file__).resolve().parent.parent / "compose.yaml"


def _parse() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_topology_matches_local_cluster() -> None:
    doc = _parse()
    services = doc["services"]
    nodes = {n: s for n, s in services.items() if "--cluster-enabled" in " ".join(s.get("command", []))}
    assert len(nodes) == 6
    ports = sorted(int(s["command"][s["command"].index("--port") + 1]) for s in nodes.values())
    assert ports == list(range(7001, 7007))
    for s in nodes.values():
        assert s["healthcheck"]["test"][-1] == "ping"
    init = services["cluster-init"]
    create = " ".join(init["command"])
    m = re.search(r"--cluster-replicas (\d+)", create)
    assert m is not None
    replicas = int(m.group(1))
    members = re.findall(r"127\.0\.0\.1:(\d+)", create.split("--cluster-replicas")[0])
    assert sorted(int(p) for p in members) == ports
    assert set(init["depends_on"]) == set(nodes)
    primaries = len(members) // (1 + replicas)

    local = LocalCluster(primaries=primaries, replicas=replicas).start()
    try:
        roles = [r["role"] for r in local.status()]
        assert roles.count("primary") == 3 and roles.count("replica") == 3
        assert len(roles) == len(nodes)
    finally:
        local.stop()


def test_compose_trainer_runs_the_main_job_against_the_cluster() -> None:
    from tracestore.cli import main

    services = _parse()["services"]
    trainer = services["trainer"]
    assert trainer["depends_on"]["cluster-init"]["condition"] == "service_completed_successfully"
    assert trainer["environment"]["TRACESTORE_URL"] == "redis+cluster://127.0.0.1:7001"
    script = " ".join(trainer["command"])
    assert "torch==2.13.0" in script and "download.pytorch.org/whl/cpu" in script
    args = script.split("tracestore train", 1)[1].split("&&")[0].split()
    # the options parse with the real command (a renamed or removed option fails here)
    ctx = main.commands["train"].make_context("train", list(args))
    assert ctx.params["mode"] == "disaggregated" and ctx.params["steps"] > 0
