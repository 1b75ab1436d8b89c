"""compose.yaml describes the same cluster as ``tracestore cluster up --primaries 3 --replicas 1``.

The file is parsed and checked against the topology the local cluster really
starts; where a Docker engine and Debian's ``docker-compose`` are present (CI
starts both), the 6-node cluster is brought up from the file with the local
server image, a short ``tracestore train --url`` runs against it, and it is
brought down again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from tests._docker import build_image, engine_reason
from tracestore import NotEnoughReplicas, StorageError, TraceStore
from tracestore.servers import LocalCluster, port_is_free

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


def test_compose_image_comes_from_a_variable_defaulting_to_the_public_image() -> None:
    services = _parse()["services"]
    images = {s["image"] for n, s in services.items() if n != "trainer"}
    assert images == {"${TRACESTORE_REDIS_IMAGE:-redis:7.4}"}
    for name, svc in services.items():  # exec form only: the local image has no shell
        if name != "trainer":
            assert "entrypoint" not in svc and isinstance(svc["command"], list), name


def _compose(project: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRACESTORE_REDIS_IMAGE": build_image()}
    return subprocess.run(
        ["docker-compose", "-p", project, "-f", str(COMPOSE), *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def _compose_cluster_ready(url: str) -> bool:
    """Every node says ``cluster_state:ok`` and every primary has an in-sync replica
    (``min-replicas-to-write 1``), so that a durable write goes through now."""
    for port in range(7001, 7007):
        c = redis.Redis(port=port, socket_timeout=2)
        try:
            if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO").decode():
                return False
        except redis.RedisError:
            return False
        finally:
            c.close()
    try:
        with TraceStore.connect(url, run="compose-probe", create_run=False) as st:
            infos = st.redis.info("replication", target_nodes=st.redis.PRIMARIES)
            return len(infos) == 3 and all(
                int(i.get("connected_slaves", 0)) >= 1 and i.get("slave0", {}).get("state") == "online"
                for i in infos.values()
            )
    except StorageError:
        return False


@pytest.mark.ray
def test_compose_cluster_comes_up_trains_and_comes_down(tmp_path: Path) -> None:
    reason = engine_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does)")
    ports = [p for base in (7001, 17001) for p in range(base, base + 6)]
    busy = [p for p in ports if not port_is_free(p)]
    if busy:
        pytest.skip(f"compose.yaml's fixed ports are taken on this machine: {busy}")
    project = f"tracestore-test-{os.getpid()}"
    try:
        up = _compose(project, "up", "-d", "cluster-init")
        assert up.returncode == 0, up.stderr
        init = _compose(project, "ps", "-q", "cluster-init").stdout.strip()
        waited = subprocess.run(["docker", "wait", init], capture_output=True, text=True, timeout=120)
        assert waited.stdout.strip() == "0", _compose(project, "logs", "cluster-init").stdout
        url = "redis+cluster://127.0.0.1:7001"
        deadline = time.monotonic() + 60
        while not _compose_cluster_ready(url):  # the replicas finish their sync after the slots are covered
            assert time.monotonic() < deadline, "the compose cluster did not become writable within 60 s"
            time.sleep(0.2)
        out = tmp_path / "train-out"
        res = subprocess.run(
            [sys.executable, "-m", "tracestore.cli", "train", "--url", url, "--steps", "2",
             "--checkpoint-every", "2", "--out", str(out)],
            capture_output=True, text=True, timeout=600,
            # as the compose trainer runs; a patient wait (a busy machine's replicas acknowledge late)
            env={**os.environ, "TRACESTORE_DURABILITY": "replicas", "TRACESTORE_DURABILITY_TIMEOUT_S": "10"},
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        report = json.loads((out / "report.json").read_text())
        assert report["sessions_opened"] > 0 and report["sessions_leaked"] == 0
        assert report["release_events"] == report["sessions_opened"]
        with TraceStore.connect(url, run=report["run"], create_run=False) as st:
            assert st.cluster and st.sessions() == []
            nodes = st.redis.get_nodes()
            assert sorted(n.port for n in nodes) == list(range(7001, 7007))
    finally:
        down = _compose(project, "down", "-v", "--remove-orphans")
    assert down.returncode == 0, down.stderr
    assert _compose(project, "ps", "-q").stdout.strip() == ""
    assert all(port_is_free(p) for p in range(7001, 7007))


def _node_flags(service: dict) -> dict[str, str]:  # type: ignore[type-arg]
    cmd = service["command"]
    return dict(zip(cmd[1::2], cmd[2::2], strict=True))


def test_compose_is_configured_for_the_durability_it_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    """AOF on every node, writes refused without an in-sync replica, the trainer on durability=replicas;
    a local cluster with the same flags behaves as docs/durability.md says."""
    services = _parse()["services"]
    nodes = [s for s in services.values() if "--cluster-enabled" in s.get("command", [])]
    wanted = {"--appendonly": "yes", "--appendfsync": "everysec", "--min-replicas-to-write": "1"}
    for s in nodes:
        flags = _node_flags(s)
        assert {k: flags.get(k) for k in wanted} == wanted
    env = services["trainer"]["environment"]
    assert env["TRACESTORE_DURABILITY"] == "replicas"
    doc = (COMPOSE.parent / "docs" / "durability.md").read_text()
    assert "min-replicas-to-write 1" in doc and "compose.yaml" in doc

    flags = _node_flags(nodes[0])
    extra = [x for k in ("--appendonly", "--appendfsync", "--min-replicas-to-write", "--min-replicas-max-lag")
             for x in (k, flags[k])]
    monkeypatch.setenv("TRACESTORE_DURABILITY", env["TRACESTORE_DURABILITY"])
    monkeypatch.setenv("TRACESTORE_DURABILITY_TIMEOUT_S", "10")  # for the writes that must be confirmed
    local = LocalCluster(primaries=3, replicas=1, extra_args=extra).start()
    try:
        with TraceStore.connect(local.url, run="compose-durability") as st:
            assert st.durability.level == "replicas"
            st.open_session("a", "w")
            replica = local.cut_replica(local.primary_of(st.keys.meta))
            try:
                with pytest.raises(NotEnoughReplicas):  # refused: nothing written, outcome known
                    st.open_session("b", "w")
                with TraceStore.connect(local.url, run="compose-durability") as other:  # connect still works
                    assert other.owner_of("a") == "w" and other.owner_of("b") is None
            finally:
                replica.resume()
            local.wait_replicas_online()
            st.open_session("b", "w")
    finally:
        local.stop()
