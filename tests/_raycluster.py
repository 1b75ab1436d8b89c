"""Ray's multi-node test cluster for the trainer's tests and benchmarks (issue 16), and a head
started with the ``ray start`` CLI (:class:`CliHead`, issue 29).

:class:`Nodes` starts a head and three nodes on this machine, each with its
own raylet and object store: two rollout nodes (custom resource
``rollout``; one on 127.0.0.2, which the trainer takes for another host) and
a learner node (``learner``). :func:`freeze_in_flight` stops a node's
processes at a moment a worker holds a gate lease, so that removing the node
then leaves a request in flight deterministically.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil  # a dependency of ray
from ray.cluster_utils import Cluster

from tracestore import TraceStore

NODE: dict[str, Any] = {"num_cpus": 0, "object_store_memory": 80 * 1024**2}


class Nodes:
    """The test cluster and its nodes by role (``Nodes().address`` for ``ray.init``)."""

    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                **NODE,
                "include_dashboard": False,
                # a removed node is declared dead within ~10 s (a loaded 2-core machine must not
                # miss a check of a live node)
                "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 10},
            },
        )
        self.rollout_a = self.cluster.add_node(**NODE, resources={"rollout": 1})
        self.rollout_b = self.cluster.add_node(**NODE, resources={"rollout": 1}, node_ip_address="127.0.0.2")
        self.learner = self.cluster.add_node(**NODE, resources={"learner": 1})

    @property
    def address(self) -> str:
        """The GCS address (``--ray-address``)."""
        return str(self.cluster.address)

    def by_id(self, node_id: str) -> Any:
        """The node with id ``node_id``."""
        return next(n for n in self.cluster.list_all_nodes() if n.node_id == node_id)

    def label(self, node: Any) -> str:
        """How the trainer names ``node`` (``IP/first 8 hex digits of its id``)."""
        return f"{node.node_ip_address}/{node.node_id[:8]}"

    def wait_dead(self, node: Any, timeout_s: float = 60.0) -> None:
        """Wait until the cluster has declared ``node`` (removed) dead."""
        import ray

        end = time.monotonic() + timeout_s
        while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > end:
                raise TimeoutError(f"node {self.label(node)} still alive {timeout_s}s after its removal")
            time.sleep(0.2)

    def add_learner(self) -> Any:
        """Start another learner node (after the first was removed)."""
        self.learner = self.cluster.add_node(**NODE, resources={"learner": 1})
        return self.learner

    def add_rollout_b(self) -> Any:
        """Start another rollout node on 127.0.0.2 (after the first was removed)."""
        self.rollout_b = self.cluster.add_node(**NODE, resources={"rollout": 1}, node_ip_address="127.0.0.2")
        return self.rollout_b


def worker_processes(node: Any) -> list[psutil.Process]:
    """The processes the node's raylet started (its Ray workers among them)."""
    raylet = node.all_processes["raylet"][0].process.pid
    return list(psutil.Process(raylet).children(recursive=True))


def _stays_in_flight(store: TraceStore, lease_id: str, sid: str, worker: str, seconds: float) -> bool:
    """True if lease ``lease_id`` stays unsettled and ``sid`` with ``worker``'s tag for ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        (rec,) = store.gate.lease_records([lease_id])
        if rec is None or rec.outcome is not None:
            return False
        if not (store.owner_of(sid) or "").startswith(f"rollout:{worker}."):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


def freeze_in_flight(
    node: Any, url: str, run_id: str, worker: str, settle_s: float = 1.0
) -> tuple[str, str]:
    """Freeze ``node``'s processes while ``worker`` holds a lease on a session its tag owns.

    Returns (lease id, session id). Polls the gate's live leases; after the
    freeze, watches the lease for ``settle_s``: it must stay unsettled and its
    session with the worker's tag (else thaws and tries again). A worker hands
    its last round's leases back unsettled with its results (the producer
    settles them and takes the sessions back in its next round trip), so an
    unsettled lease alone does not prove the worker is inside a request.
    """
    with TraceStore.connect(url, run=run_id, create_run=False) as store:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ids = [x.decode() for x in store.redis.zrange(store.keys.gate_leases, 0, -1)]
            for rec in store.gate.lease_records(ids):
                if rec is None or rec.holder != worker or rec.outcome is not None:
                    continue
                if not (store.owner_of(rec.sid) or "").startswith(f"rollout:{worker}."):
                    continue
                procs = worker_processes(node)
                for p in procs:
                    p.send_signal(signal.SIGSTOP)
                if _stays_in_flight(store, rec.lease_id, rec.sid, worker, settle_s):
                    return rec.lease_id, rec.sid
                for p in procs:
                    p.send_signal(signal.SIGCONT)
            time.sleep(0.01)
    raise AssertionError(f"{worker} never held a lease on a session of its own tag")


def remove_frozen_node(cluster: Any, node: Any) -> None:
    """Remove ``node`` of ``cluster`` after :func:`freeze_in_flight` stopped its processes.

    Ray kills the raylet and its workers, but not the agents the raylet started (its dashboard
    and runtime-env agents): stopped, they outlived every full run, orphaned. They are killed
    here (SIGKILL ends a stopped process; a SIGTERM would wait for a SIGCONT).
    """
    procs = worker_processes(node)
    cluster.remove_node(node, allow_graceful=False)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"processes of the removed node still alive: {alive}"


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CliHead:
    """A Ray head started as a user starts one: ``ray start --head --block`` in a process of its own.

    On free ports (GCS, dashboard agent, metrics) with its own
    temp dir, in the environment ``env`` (``HOME`` decides which
    ``~/.ray/auth_token`` it finds: with one, Ray 2.60 turns on token
    authentication). :meth:`stop` ends it by its own means, never with
    ``ray stop`` (which would stop every Ray of the machine's users): SIGTERM
    to the ``ray start`` process, which stops the processes it started; then
    SIGKILL to any process left in its session or naming its temp dir.
    """

    def __init__(self, env: dict[str, str], num_cpus: int = 2, timeout_s: float = 120.0) -> None:
        self.port = free_port()
        # short: Ray's unix sockets live under it (a socket path has at most 107 bytes)
        self.temp_dir = tempfile.mkdtemp(prefix="tsray-", dir="/tmp")
        self.log = Path(self.temp_dir) / "head.log"
        args = [
            shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray",  # the venv's CLI
            "start", "--head", "--block", "--port", str(self.port), "--temp-dir", self.temp_dir,
            "--num-cpus", str(num_cpus), "--include-dashboard", "false", "--disable-usage-stats",
            "--object-store-memory", str(100 * 1024**2),
            "--dashboard-agent-listen-port", str(free_port()),
            "--metrics-export-port", str(free_port()),
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while b"Ray runtime started" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"ray start --head did not start (exit {self.proc.returncode}): {text}")
            time.sleep(0.2)

    @property
    def address(self) -> str:
        """``HOST:PORT`` of the head's GCS, as a user passes it to ``--ray-address``."""
        return f"127.0.0.1:{self.port}"

    def _leftovers(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                mine = os.getsid(p.pid) == self.proc.pid or self.temp_dir in " ".join(p.info["cmdline"] or ())
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
            if mine and p.pid != os.getpid():
                out.append(p)
        return out

    def stop(self) -> None:
        """Stop the head and everything it started; remove its temp dir."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        left = self._leftovers()
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
