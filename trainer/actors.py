"""Ray plumbing of the trainer: which Ray, where each role runs, what the object stores hold.

Kept in one place so that the roles never know where they run:

* :func:`start_ray`: a private local Ray (the default), or an existing
  cluster joined by address (``--ray-address``, ``$RAY_ADDRESS``), with no
  resource arguments (the cluster's nodes declare their own), with Ray's
  token authentication when a token is found, as Ray's own ``auto`` does
  (:func:`enable_token_auth`);
* :func:`plan`: the run's :class:`Plan`, which node each rollout worker is
  pinned to (``spread``: round-robin over the nodes that offer the workers'
  resources) or that Ray places them (``pack``), and the options that place
  the learner by its resources and the producer beside the driver;
* :func:`refuse_local_store` and :func:`unreachable_from`: whether every
  node a role may run on can use the store (the default server answers on
  the driver's host only; any other URL is tried from each of those nodes);
* :func:`object_store_used` and :func:`object_store_used_per_node`: bytes
  in Ray's object stores (one per node), as the raylets report them.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import ray
from ray.exceptions import TaskUnschedulableError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tracestore.durability import ENV_NAMES

from .config import ConfigError, TrainConfig, resources

#: A Ray actor handle (methods are called as ``handle.method.remote(...)``; Ray types them loosely).
Handle = Any
#: Rollout workers by name (the router's entrypoints).
Workers = dict[str, Handle]


def start_ray(address: str | None = None) -> bool:
    """Start or join Ray unless this process already has it; True when done here.

    ``address`` None or ``"local"``: a private local Ray (``address="local"``
    always starts a new instance: a stale cluster record on the machine never
    makes the run join it). Any other address joins that cluster
    (``auto``, ``HOST:PORT`` of its GCS, ``ray://HOST:PORT`` for Ray Client)
    without resource arguments. A HOST:PORT address joins with token
    authentication when a token is found (:func:`enable_token_auth`), as
    ``auto`` does. Raises ConfigError when the cluster cannot be joined (the
    reason in one line, and for a refused connection what to set when the
    cluster wants a token).
    """
    if ray.is_initialized():
        return False
    quiet: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address in (None, "", "local"):
        # workers at the driver's priority (Ray's default niceness for them is 15): the gateway of
        # --agents http keeps it and the bulk roles lower their own (lower_priority)
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, _system_config={"worker_niceness": 0}, **quiet
        )
        return True
    _check_address(address)
    token = enable_token_auth() if address != "auto" and not address.startswith("ray://") else None
    try:
        ray.init(address=address, **quiet)
    except _JOIN_ERRORS as exc:
        reason = " ".join(str(exc).split())
        hint = _token_hint(token) if isinstance(exc, _REFUSED) else ""
        raise ConfigError(f"cannot join the Ray cluster at {address!r}: {reason}{hint}") from None
    return True


#: A join refused (Ray's error for a missing or refused token exists since Ray 2.52), and
#: every error of ``ray.init`` that ends the run with one line.
_REFUSED: tuple[type[BaseException], ...] = (ConnectionError,) + tuple(
    e for e in (getattr(ray.exceptions, "AuthenticationError", None),) if isinstance(e, type)
)
_JOIN_ERRORS: tuple[type[BaseException], ...] = (*_REFUSED, RuntimeError, ValueError)


#: Where Ray looks for its authentication token, in its order (Ray 2.52+, docs.ray.io
#: "Ray token authentication"): the variable's value, the file it names, the default file.
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def _default_token_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def find_token() -> str | None:
    """Where this process's Ray authentication token is, as Ray looks for it; None when none is.

    ``$RAY_AUTH_TOKEN`` (its value), else the file ``$RAY_AUTH_TOKEN_PATH``
    names, else ``~/.ray/auth_token`` (what ``ray start --head`` and
    ``ray get-auth-token --generate`` write). Reads no token's value.
    """
    if os.environ.get(TOKEN_ENV, "").strip():
        return f"${TOKEN_ENV}"
    named = os.environ.get(TOKEN_PATH_ENV)
    for path in ([named] if named else [_default_token_path()]):
        try:
            if os.path.getsize(path) > 0:
                return path
        except OSError:
            pass
    return None


def enable_token_auth() -> str | None:
    """Turn on Ray's token authentication for a join by address when a token is found.

    Ray 2.60 does it by itself only for ``auto``: a driver given an explicit
    address connects with authentication ``disabled`` unless
    ``RAY_AUTH_MODE=token`` is set, and a cluster started by ``ray start
    --head`` where a token exists wants one, so the join fails with a bare
    "Failed to connect". Here, as ``auto`` does: an explicit
    ``RAY_AUTH_MODE`` is respected; else, with a token (:func:`find_token`)
    the mode becomes ``token`` for this process and the processes it starts
    (a cluster without authentication accepts such a driver too). Returns
    where the token is (None: the join goes without one).
    """
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None:
        return find_token() if mode.lower() == "token" else None
    where = find_token()
    if where is None:
        return None
    try:  # Ray's own step for `auto` (it also refreshes the config Ray has read already)
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray: its documented switch
        os.environ[AUTH_MODE_ENV] = "token"
        return where
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = log.level
    log.setLevel(logging.ERROR)  # its notice that token auth is on is not the run's news
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        log.setLevel(level)
    return where


def _token_hint(token: str | None) -> str:
    """What to set when a join by address was refused, with or without a token."""
    if token is None:
        return (
            f" (a cluster with token authentication, as `ray start --head` starts one where a token "
            f"exists, needs its token here: copy the head's ~/.ray/auth_token to "
            f"{_default_token_path()}, or set {TOKEN_ENV} to the output of `ray get-auth-token` "
            "on the head)"
        )
    return (
        f" (the join used token authentication with the token of {token}; if it is not the "
        f"cluster's, set {TOKEN_ENV} to the output of `ray get-auth-token` on the head)"
    )


def _check_address(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a ``HOST:PORT`` (or ``ray://HOST:PORT``) nobody listens on, before ``ray.init``.

    ``ray.init`` retries an unreachable GCS for minutes; one TCP connect says
    at once that nothing listens there. ``auto`` is left to Ray (it fails
    fast when no cluster runs on this machine). Raises ConfigError.
    """
    if address == "auto":
        return
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None:
        raise ConfigError(
            f"--ray-address {address!r} is not HOST:PORT, ray://HOST:PORT, auto or local"
        )
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or ("timed out" if isinstance(exc, TimeoutError) else type(exc).__name__)
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: {reason} (is `ray start --head` "
            "running there, on that port?)"
        ) from None


@dataclass(frozen=True)
class Node:
    """A live Ray node: its id, IP address and total resources."""

    id: str
    ip: str
    resources: dict[str, float]

    @property
    def label(self) -> str:
        """``IP/first 8 hex digits of the id``: how reports and messages name a node."""
        return f"{self.ip}/{self.id[:8]}"

    def offers(self, wanted: dict[str, float], times: int = 1) -> bool:
        """True when the node's totals cover ``times`` requests of ``wanted``."""
        return all(self.resources.get(k, 0.0) >= v * times for k, v in wanted.items())


def alive_nodes() -> list[Node]:
    """The cluster's live nodes, sorted by IP address, then id (``ray.nodes()``)."""
    nodes = [
        Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return sorted(nodes, key=lambda n: (n.ip, n.id))


def _ray_options(wanted: dict[str, float]) -> dict[str, Any]:
    """``.options(...)`` keywords for a resource request (CPU and GPU have their own)."""
    custom = {k: v for k, v in wanted.items() if k not in ("CPU", "GPU")}
    opts: dict[str, Any] = {"num_cpus": wanted.get("CPU", 0)}
    if "GPU" in wanted:
        opts["num_gpus"] = wanted["GPU"]
    if custom:
        opts["resources"] = custom
    return opts


@dataclass(frozen=True)
class Plan:
    """Where the run's roles go on the cluster.

    ``workers`` maps each rollout worker to the node it is pinned to
    (``spread``), or to None when Ray places it by its resources (``pack``).
    ``candidates`` are the nodes any role may run on (the reachability checks
    look at them). ``driver`` is the node of this process (None with Ray Client).
    """

    driver: Node | None
    workers: dict[str, Node | None]
    worker_resources: dict[str, float]
    learner_resources: dict[str, float]
    candidates: list[Node] = field(default_factory=list)

    def worker_options(self, name: str) -> dict[str, Any]:
        """Ray options of rollout worker ``name``: its resources, pinned to its node when spread."""
        opts = _ray_options(self.worker_resources)
        node = self.workers[name]
        if node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node.id, soft=False)
        return opts

    def learner_options(self) -> dict[str, Any]:
        """Ray options of the learner: its resources, else on the driver's node."""
        if self.learner_resources:
            return _ray_options(self.learner_resources)
        return self.driver_options()

    def driver_options(self) -> dict[str, Any]:
        """Ray options of the producer (and the gateway of HTTP agents): on the driver's node.

        No resources; anywhere with Ray Client (the driver is on no node).

        Pinned, not a preference: Ray's scheduler may place a zero-CPU actor
        with a soft affinity on another node.
        """
        opts: dict[str, Any] = {"num_cpus": 0}
        if self.driver is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.driver.id, soft=False)
        return opts


def plan(cfg: TrainConfig) -> Plan:
    """Place the run's roles on the live nodes of the Ray this process is connected to.

    ``spread`` pins worker ``i`` to the ``i``-th node (round-robin) of those
    whose totals offer ``--worker-resources`` (every node when none are
    asked); ``pack`` leaves the workers to Ray's scheduler. The learner goes
    where its resources are. Raises ConfigError, before any actor starts,
    when no node offers the learner's or the workers' resources, or when
    the spread workers do not fit on their nodes.
    """
    nodes = alive_nodes()
    driver_id = ray.get_runtime_context().get_node_id()
    remote_driver = (cfg.ray_address or "").startswith("ray://")
    driver = None if remote_driver else next((n for n in nodes if n.id == driver_id), None)
    wres = resources(cfg.worker_resources, "worker_resources")
    lres = resources(cfg.learner_resources, "learner_resources")
    hosts = [n for n in nodes if n.offers(wres)]
    if not hosts:
        raise ConfigError(
            f"no node of the Ray cluster offers --worker-resources {cfg.worker_resources!r} "
            f"(nodes: {_describe(nodes)})"
        )
    learners = [n for n in nodes if n.offers(lres)] if lres else ([driver] if driver else nodes[:1])
    if not learners:
        raise ConfigError(
            f"no node of the Ray cluster offers --learner-resources {cfg.learner_resources!r} "
            f"(nodes: {_describe(nodes)})"
        )
    names = [f"w{i}" for i in range(cfg.workers)]
    if cfg.placement == "spread":
        workers: dict[str, Node | None] = {w: hosts[i % len(hosts)] for i, w in enumerate(names)}
        for node in hosts:
            n = sum(1 for p in workers.values() if p is node)
            if wres and not node.offers(wres, n):
                raise ConfigError(
                    f"--workers {cfg.workers} spread over {len(hosts)} node(s) puts {n} on "
                    f"{node.label}, which cannot hold {n} x --worker-resources "
                    f"{cfg.worker_resources!r} (it has {_describe([node])})"
                )
    else:
        workers = dict.fromkeys(names)
    chosen = [p for p in workers.values() if p is not None] if cfg.placement == "spread" else hosts
    candidates = {n.id: n for n in [*chosen, *learners, *([driver] if driver else [])]}
    return Plan(driver, workers, wres, lres, sorted(candidates.values(), key=lambda n: (n.ip, n.id)))


def _describe(nodes: Sequence[Node]) -> str:
    shown = []
    for n in nodes[:8]:
        res = ", ".join(
            f"{k}={v:g}" for k, v in sorted(n.resources.items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")
        )
        shown.append(f"{n.label} [{res or 'no CPU/GPU/custom resources'}]")
    return "; ".join(shown) + (" ..." if len(nodes) > 8 else "")


def local_only(url: str) -> bool:
    """True when ``url`` names a unix socket or a loopback address (reachable on its host only)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@ray.remote(num_cpus=0)
def _try_store(url: str, run: str) -> str | None:
    """On a node: connect to ``url`` as the roles will (one PING); the reason it failed, or None."""
    from tracestore import TraceStore, TracestoreError
    from tracestore.connection import failure_reason

    try:
        with TraceStore.connect(
            url, run=run, create_run=False, retries=0, connect_timeout_s=5.0, socket_timeout_s=5.0
        ):
            return None
    except TracestoreError as exc:
        return failure_reason(exc.__cause__ or exc)


def refuse_local_store(p: Plan, url: str) -> None:
    """Raise ConfigError when the default server cannot serve the cluster (no ``--url`` given).

    The default server (``url``) answers on a unix socket or a loopback
    address, so when a node a role may run on is on another host (another IP
    address than the driver's, or any node when the driver is a Ray Client)
    the run is refused before anything starts. A default server that
    listens on a reachable address passes (and is then tried like any URL).
    """
    others = [n for n in p.candidates if p.driver is None or n.ip != p.driver.ip]
    if local_only(url) and others:
        from tracestore.connection import mask_url

        shown = ", ".join(sorted({n.ip for n in others}))
        raise ConfigError(
            f"the Ray cluster has nodes on other hosts ({shown}) and no --url was given: the "
            f"default server ({mask_url(url)}) answers on this host only; start a server "
            "every node reaches and pass its URL with --url or $TRACESTORE_URL (docs/deploy.md)"
        )


def unreachable_from(p: Plan, url: str, run: str) -> list[tuple[Node, str]]:
    """The candidate nodes that cannot use the store at ``url``, each with the reason.

    Each node tries as its roles will (a zero-CPU task pinned there, one
    PING of run ``run``), which catches a firewall, a wrong address and a
    loopback URL that only some hosts serve. Nothing to try when the only
    candidate is the driver's node (the driver's own connection was the
    test). Cost: one task per candidate node, in parallel.
    """
    if [n.id for n in p.candidates] == ([p.driver.id] if p.driver else []):
        return []
    tries = [
        _try_store.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.id, soft=False), **store_env()
        ).remote(url, run)
        for n in p.candidates
    ]
    out: list[tuple[Node, str]] = []
    for n, ref in zip(p.candidates, tries, strict=True):
        try:
            why = ray.get(ref)
        except TaskUnschedulableError:
            raise ConfigError(
                f"Ray node {n.label} left the cluster while the run was starting; start it again"
            ) from None
        if why is not None:
            out.append((n, why))
    return out


#: Environment variables of the driver that every role must see as well: the durability
#: level (``TRACESTORE_DURABILITY``, ``_REPLICAS``, ``_TIMEOUT_S``) makes every process's
#: acknowledged calls mean the same.
STORE_ENV = ENV_NAMES


def store_env() -> dict[str, Any]:
    """Ray options that give a role the driver's store settings from the environment.

    A worker Ray starts on another machine inherits that machine's ``ray
    start`` environment, not the driver's: a ``TRACESTORE_DURABILITY`` set
    where ``tracestore train`` runs would reach the driver and the producer
    only. Empty when none is set (the roles' own environment then decides).
    """
    env = {k: v for k in STORE_ENV if (v := os.environ.get(k))}
    return {"runtime_env": {"env_vars": env}} if env else {}


def remote(cls: type, concurrency: int = 1, **options: Any) -> Any:
    """``cls`` as a Ray actor class; ``concurrency`` > 1 runs that many methods at once (threads).

    ``options`` are Ray's (resources, scheduling strategy); without them the
    actor claims no CPU. The actor gets the driver's store settings
    (:func:`store_env`).
    """
    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": concurrency, **store_env(), **options}
    return ray.remote(**opts)(cls)


def kill(handles: list[Handle]) -> None:
    """Kill actors without running their cleanup (a crash, an error, or after ``close``)."""
    for h in handles:
        ray.kill(h, no_restart=True)


#: The CPU priority (nice value) of the run's bulk roles (the learner, the rollout workers and
#: the producer): Ray's own default for its worker processes. The gateway of ``--agents http``
#: stays at the niceness Ray started it with (0 on a private local Ray, :func:`start_ray`), so on
#: a busy machine its event loop, which answers every agent turn, gets a core ahead of them.
BULK_NICENESS = 15


def bulk_idle(cfg: TrainConfig) -> bool:
    """Whether the bulk roles of ``cfg``'s run also take the ``SCHED_IDLE`` policy
    (:func:`lower_priority`): on a private local Ray, where they share the machine's cores with
    the gateway by construction. Not on a joined cluster, whose nodes may run other work at
    normal priority that an idle-policy learner would wait behind."""
    return not cfg.joins_cluster


def lower_priority(niceness: int = BULK_NICENESS, *, idle: bool = False) -> int:
    """Run this whole process (every thread, and the threads they start) at ``niceness`` or lower
    priority; returns the niceness it now has.

    Linux keeps a nice value per thread and ``setpriority(PRIO_PROCESS, 0)`` changes only the
    calling thread's, so each thread of ``/proc/self/task`` is set (a Ray worker's own threads
    were started before the actor's ``__init__`` runs). Only ever raises the nice value (lowers
    the priority), which any user may do; a thread already nicer is left as it is. Elsewhere
    than Linux, the calling process. Never raises: the priority is a preference.

    ``idle``: each thread also takes the ``SCHED_IDLE`` policy (Linux; unprivileged, as it only
    lowers). A nice value sets a share of the CPU, not who runs first: the kernel's EEVDF
    scheduler lets a running nice-15 thread finish its slice (a few ms) before a woken nice-0
    one gets the core, so the gateway's loop waited for a core after every wake-up. An
    idle-policy thread is preempted at once by any normal one that wakes (measured in
    ``make train``: the loop's wait for a core 0.84-0.95 s -> 0.36-0.50 s; docs/benchmarks.md).
    """
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:  # a thread that ended meanwhile, or no setpriority here
            pass
        if idle and hasattr(os, "SCHED_IDLE"):
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # a thread that ended meanwhile
                pass
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return niceness


def node_id() -> str:
    """The id of the Ray node this process runs on (the roles' ``node_id`` methods call it)."""
    return str(ray.get_runtime_context().get_node_id())


def serve_host(cfg: TrainConfig) -> str:
    """The address a role's HTTP server listens on: loopback on a private local Ray, else this
    node's IP address (the engines and the gateway of HTTP agents are called from other nodes)."""
    return str(ray.util.get_node_ip_address()) if cfg.joins_cluster else "127.0.0.1"


def object_store_used() -> int:
    """Bytes in use in the Ray object stores of every node, as the raylets report them (lags by a heartbeat)."""
    total = ray.cluster_resources().get("object_store_memory", 0.0)
    return int(total - ray.available_resources().get("object_store_memory", 0.0))


def object_store_used_per_node() -> dict[str, int]:
    """Bytes in use in each live node's object store, by :attr:`Node.label`.

    Each node has its own store; a node that left the cluster is not listed.
    Read from the resource view the raylets report to the GCS (Ray's
    developer API ``ray._private.state``, the per-node form of
    ``ray.available_resources()``), so it lags by a heartbeat too.
    """
    from ray._private import state

    total = state.total_resources_per_node()
    avail = state.available_resources_per_node()
    out: dict[str, int] = {}
    for n in alive_nodes():
        cap = total.get(n.id, {}).get("object_store_memory", 0.0)
        free = avail.get(n.id, {}).get("object_store_memory", 0.0)
        out[n.label] = int(cap - free)
    return out
