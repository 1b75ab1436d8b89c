"""The training loop: start the actors, alternate or overlap rollout and training, report.

:func:`run` is what ``tracestore train`` and ``python -m tracestore.trainer``
call. It returns the :class:`~tracestore.trainer.report.Report` and writes
``report.json`` and ``report.png`` into ``cfg.out``. Before anything starts,
it joins Ray (a private local one, or ``cfg.ray_address``), places the roles
on its nodes (:func:`~.actors.plan`) and checks that every node they may
run on reaches the store. The phases of a run are the methods of
:class:`Driver`, in order: recover (after a crash), start the actors, loop
over the steps, drain the run, close the actors.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError

from tracestore import StorageError, TraceStore, TracestoreError, default_server
from tracestore.connection import ENV_URL, failure_reason, mask_url, resolve_url
from tracestore.ray import destroy_events_group
from tracestore.runlock import RunLockKeeper

from .actors import (
    Handle,
    Plan,
    Workers,
    kill,
    object_store_used,
    object_store_used_per_node,
    plan,
    refuse_local_store,
    remote,
    start_ray,
    unreachable_from,
)
from .checkpoint import (
    CheckpointState,
    ckpt_dir,
    finished_at,
    load_state,
    mark_finished,
    store_path,
)
from .config import ConfigError, TrainConfig
from .dispatch import WorkerPool, WorkersLost
from .housekeeping import drain_run, reclaim_dead_owners, store_counts
from .learner import Learner
from .producer import Producer
from .report import EndState, Phases, Report, Start, build_report
from .rollout import RolloutWorker, WorkerStats, holder_name
from .steps import StepRecord

if TYPE_CHECKING:
    from .gateway_actor import GatewayActorStats

Progress = Callable[[StepRecord], None]
#: What the run's lock says holds it (shown to a second trainer refused).
LOCK_WHAT = "tracestore train"


class SimulatedCrash(RuntimeError):
    """Raised after the checkpoint of ``crash_after_step`` (tests of resume).

    Every actor was killed without cleanup, as if the machine had died:
    sessions, leases and buffered groups are left in the store for the resume.
    """

    def __init__(self, step: int, history: list[StepRecord]) -> None:
        super().__init__(f"simulated crash after the checkpoint of step {step}")
        self.step = step
        self.history = history


class Interrupted(Exception):
    """Ctrl-C during the run: every actor was killed; ``step`` steps were trained.

    ``checkpoint`` is the step of this run's last checkpoint (None: none yet),
    where ``--resume`` continues.
    """

    def __init__(self, step: int, checkpoint: int | None) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step = step
        self.checkpoint = checkpoint


class StoreUnreachable(Exception):
    """The store stopped answering (or never answered): ``url`` and the ``reason``.

    ``step`` is the last step trained (None: before the loop started),
    ``checkpoint`` the step of this run's last checkpoint (None: none yet).
    """

    def __init__(self, url: str, reason: str, step: int | None, checkpoint: int | None) -> None:
        super().__init__(f"cannot reach the store at {url}: {reason}")
        self.url = url
        self.reason = reason
        self.step = step
        self.checkpoint = checkpoint


class RunFinished(Exception):
    """``--resume`` of a run that ended: its checkpoint is of its last step and its report is written.

    Nothing was started or changed (no Ray, no store call, the report left
    as it is). ``run``, ``step`` (the last one trained) and ``out`` name it;
    ``--steps N`` with N > ``step`` trains further.
    """

    def __init__(self, run: str, step: int, out: str) -> None:
        super().__init__(f"run {run} already finished at step {step}: nothing to resume")
        self.run = run
        self.step = step
        self.out = out


class RoleLost(Exception):
    """A role died mid-run (its process, or its Ray node): ``role`` (``learner``, ``producer``,
    ``rollout workers``), where it ran, the last step trained and the last checkpoint.

    Every other actor was killed; ``--resume`` continues from the checkpoint
    on the nodes that are left (a lost rollout worker alone does not end
    the run: the others go on).
    """

    def __init__(self, role: str, node: str, step: int, checkpoint: int | None) -> None:
        super().__init__(f"the {role} was lost after step {step} (on Ray node {node})")
        self.role = role
        self.node = node
        self.step = step
        self.checkpoint = checkpoint


def run(
    cfg: TrainConfig,
    progress: Progress | None = None,
    started: Callable[[str, str], None] | None = None,
    notice: Callable[[str], None] | None = None,
) -> Report:
    """Train; return the report (also written to ``cfg.out``).

    ``progress`` is called with each step's record, ``started`` with the
    URL and run id once the store answers and the run's lock is held,
    ``notice`` with a line about what a resume found (the store restored
    from the checkpoint). The run holds the run's lock
    (:class:`~tracestore.runlock.RunLockKeeper`) from its connect to its
    end: a second trainer of the run is refused. Raises ConfigError (a bad
    option, ``--resume`` without a checkpoint, a Ray cluster that cannot be
    joined or cannot hold the roles, the default server with nodes on other
    hosts), RunFinished (``--resume`` of a run that ended: nothing done),
    RunLocked (another process trains the run, or took its lock mid-run),
    StoreUnreachable (at the start, from the driver or a node, or mid-run),
    RoleLost (the learner, the producer or every rollout worker died),
    Interrupted (Ctrl-C), SimulatedCrash, and the roles' errors; every actor
    is killed before any of them propagates.
    """
    cfg.validate()
    state = resume_state(cfg)
    with _session(cfg) as (store, where, lock):
        if started is not None:
            started(cfg.url or "", cfg.run)
        os.makedirs(cfg.out, exist_ok=True)
        driver = Driver(cfg, store, state, progress, where, lock, notice)
        try:
            report = driver.run()
        except KeyboardInterrupt as exc:
            raise Interrupted(driver.step, last_checkpoint(cfg)) from exc
        except SimulatedCrash:
            raise
        except (RayActorError, WorkersLost) as exc:
            # A role that died while the store does not answer died of it (its calls
            # failed): say so, and how to resume, rather than blame its node.
            reason = unreachable(cfg)
            if reason is not None:
                url = mask_url(cfg.url or "")
                raise StoreUnreachable(url, reason, driver.step, last_checkpoint(cfg)) from exc
            role, node = driver.lost_role(exc)
            raise RoleLost(role, node, driver.step, last_checkpoint(cfg)) from exc
        except Exception as exc:
            reason = unreachable(cfg)
            if reason is None:
                raise
            url = mask_url(cfg.url or "")
            raise StoreUnreachable(url, reason, driver.step, last_checkpoint(cfg)) from exc
    report.write(cfg.out)
    mark_finished(cfg, report.history[-1].step if report.history else 0)
    return report


@contextlib.contextmanager
def _session(cfg: TrainConfig) -> Iterator[tuple[TraceStore, Plan, RunLockKeeper]]:
    """Ray joined, the roles placed, the driver's store connected and reachable from every node,
    the run's lock held.

    A given URL is tried first, and the lock taken (a wrong URL, or a run
    another trainer holds, fails before Ray starts). With no URL, the
    placement comes first: the default server is started only when every
    node can reach it (:func:`~.actors.refuse_local_store`). Releases the
    lock, closes the store and leaves Ray (when it joined or started it
    here) on the way out.
    """
    default = not cfg.url and not os.environ.get(ENV_URL)
    with contextlib.ExitStack() as stack:
        store = None if default else stack.enter_context(connect(cfg))
        lock = None if store is None else _lock(stack, store, cfg)
        if start_ray(cfg.ray_address):
            stack.callback(ray.shutdown)
        where = plan(cfg)
        if store is None:
            refuse_local_store(where, _default_url())
            store = stack.enter_context(connect(cfg))
            lock = _lock(stack, store, cfg)
        assert lock is not None
        bad = unreachable_from(where, cfg.url or "", cfg.run)
        if bad:
            node, why = bad[0]
            more = f" (and {len(bad) - 1} more node(s))" if len(bad) > 1 else ""
            raise StoreUnreachable(mask_url(cfg.url or ""), f"from Ray node {node.label}{more}: {why}", None, None)
        yield store, where, lock


def _lock(stack: contextlib.ExitStack, store: TraceStore, cfg: TrainConfig) -> RunLockKeeper:
    """Hold the run's lock until ``stack`` closes (RunLocked names the trainer holding it)."""
    keeper = RunLockKeeper(store, LOCK_WHAT, cfg.lock_ttl_s)
    stack.enter_context(keeper)
    return keeper


def _default_url() -> str:
    """The default server's URL, without starting it (what it answers on when it starts)."""
    info = default_server.find()
    return info.url if info is not None else f"unix://{default_server.server_dir() / 'server.sock'}"


def resume_state(cfg: TrainConfig) -> CheckpointState | None:
    """With ``--resume``, the checkpoint's state.

    The run continues the checkpoint's run id, and its URL unless ``cfg.url``
    names one (``tracestore train`` also takes the mode from the checkpoint,
    see :meth:`TrainConfig.resumed`). Raises RunFinished when the checkpoint
    is of the run's last step (``cfg.steps``) and the run ended there
    (:func:`~.checkpoint.finished_at`); a run killed after its last
    checkpoint but before its end is resumed (it reclaims and drains).
    """
    if not cfg.resume:
        return None
    state = load_state(cfg)
    if state is None:
        raise ConfigError(f"--resume: no checkpoint in {ckpt_dir(cfg)}")
    if state.step >= cfg.steps and finished_at(cfg, state.cfg.run) == state.step:
        raise RunFinished(state.cfg.run, state.step, cfg.out)
    cfg.run = state.cfg.run
    if cfg.url is None:
        cfg.url = state.cfg.url
    return state


def last_checkpoint(cfg: TrainConfig) -> int | None:
    """The step of ``cfg.run``'s last checkpoint in ``cfg.out`` (None: none of this run)."""
    state = load_state(cfg)
    return state.step if state is not None and state.cfg.run == cfg.run else None


def connect(cfg: TrainConfig) -> TraceStore:
    """The driver's store (``cfg.url`` resolved). Raises StoreUnreachable.

    A run on this user's default server finds it again on resume, and
    starts it when it was stopped (the run is then restored from its
    checkpoint).
    """
    cfg.url = resolve_url(cfg.url)
    if default_server.is_default(cfg.url):
        default_server.ensure()
    try:
        return TraceStore.connect(cfg.url, run=cfg.run, retries=1, socket_timeout_s=5.0)
    except StorageError as exc:
        raise StoreUnreachable(mask_url(cfg.url), failure_reason(exc.__cause__ or exc), None, None) from exc


def unreachable(cfg: TrainConfig) -> str | None:
    """Why the store does not answer now, or None when it does (one PING, 2 s at most)."""
    try:
        with TraceStore.connect(
            cfg.url, run=cfg.run, create_run=False, retries=0,
            connect_timeout_s=2.0, socket_timeout_s=2.0,
        ):
            return None
    except TracestoreError as exc:
        return failure_reason(exc.__cause__ or exc)


@dataclass(frozen=True)
class Actors:
    """The run's Ray actors (``gateways``: the session gateways by name, with ``--agents http``)."""

    workers: Workers
    learner: Handle
    producer: Handle
    gateways: Workers = field(default_factory=dict)

    def all(self) -> list[Handle]:
        """Every actor, producer first."""
        return [self.producer, self.learner, *self.gateways.values(), *self.workers.values()]


class Driver:
    """One run in this process: ``Driver(cfg, store, state, progress, plan).run()`` -> the report."""

    def __init__(
        self,
        cfg: TrainConfig,
        store: TraceStore,
        state: CheckpointState | None,
        progress: Progress | None,
        where: Plan,
        lock: RunLockKeeper | None = None,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.state = state
        self.progress = progress
        self.plan = where
        self.lock = lock
        self.notice = notice
        #: The last step trained (and reported) in this process, 0 before the first.
        self.step = 0
        #: Where each role runs (role -> node label), once the actors started.
        self.placement: dict[str, str] = {}
        self._handles: list[Handle] = []
        self._roles: dict[str, str] = {}  # actor id (hex) -> role

    def lost_role(self, exc: BaseException) -> tuple[str, str]:
        """The role and node of an actor whose death ended the run (``exc`` as Ray raised it)."""
        if isinstance(exc, WorkersLost):
            nodes = sorted({self.placement.get(w, "?") for w in exc.lost})
            return "rollout workers", ", ".join(nodes)
        role = self._roles.get(getattr(exc, "actor_id", None) or "", "an actor")
        return role, self.placement.get(role, "?")

    def run(self) -> Report:
        """Every phase in order; on any error the actors are killed and the error raised."""
        t0 = time.perf_counter()
        try:
            reclaimed, restored = self.recover()
            t1 = time.perf_counter()
            actors, first = self.start_actors()
            start = Start(first, self.state is not None, reclaimed, restored)
            t2 = time.perf_counter()
            history, plasma_max = self.loop(actors, first)
            t3 = time.perf_counter()
            end = self.drain(actors, plasma_max)
            t4 = time.perf_counter()
            self.close(actors, end.lost_workers)
        except BaseException:
            kill(self._handles)  # a crash, an error or Ctrl-C: a resume reclaims what they held
            raise
        phases = Phases(t1 - t0, t2 - t1, t3 - t2, t4 - t3, wall=time.perf_counter() - t0)
        return build_report(self.cfg, start, history, end, phases)

    def recover(self) -> tuple[dict[str, int], bool]:
        """On a resume: restore an empty server from the checkpoint, reclaim what dead owners hold.

        Returns what :func:`reclaim_dead_owners` did and whether the store was restored.
        """
        if self.state is None:
            return {}, False
        restored = store_counts(self.store).opened == 0
        if restored:  # an empty run: the server was lost too
            info = self.store.restore(store_path(self.cfg))
            if self.notice is not None:
                self.notice(
                    f"the server had lost run {self.cfg.run}: restored it from {info.path} "
                    f"(checkpoint of step {self.state.step}: {info.sessions} sessions, {info.groups} "
                    f"groups, {info.nodes} trace nodes; {info.lost_expert_keys} routed-expert keys "
                    "marked lost)"
                )
        return reclaim_dead_owners(self.store, self.cfg.lease_ttl_s), restored

    def start_actors(self) -> tuple[Actors, int]:
        """Workers, the learner (warm start or checkpoint, first weight push), the producer.

        Returns the actors and the first step to train.
        """
        cfg, p = self.cfg, self.plan
        # threaded: the learner borrows refs and pushes weights while a rollout runs (safe: a
        # weight push happens with the gate sealed and drained, so no generation is in flight)
        workers = {
            w: self._spawn(w, RolloutWorker, 3, p.worker_options(w), cfg, w) for w in p.workers
        }
        gateways: Workers = {}
        urls: dict[str, str] | None = None
        if cfg.agents == "http":  # the workers serve engines; agents reach them through the gateways
            from .gateway_actor import GatewayActor
            from .http_agents import gateway_name

            engines = ray.get([w.serve_http.remote() for w in workers.values()])
            for name in map(gateway_name, range(cfg.gateways)):
                gateways[name] = self._spawn(name, GatewayActor, 4, p.driver_options(), cfg, engines, name)
            urls = dict(zip(gateways, ray.get([g.url.remote() for g in gateways.values()]), strict=True))
        learner = self._spawn("learner", Learner, 1, p.learner_options(), cfg, workers, gateways, urls)
        first: int = ray.get(learner.init.remote(self.state))
        producer = self._spawn("producer", Producer, 2, p.driver_options(), cfg, workers, first, urls)
        actors = Actors(workers, learner, producer, gateways)
        self._locate(actors)
        return actors, first

    def _spawn(self, role: str, cls: type, concurrency: int, options: dict[str, object], *args: object) -> Handle:
        handle = remote(cls, concurrency, **options).remote(*args)
        self._handles.append(handle)
        self._roles[handle._actor_id.hex()] = role
        return handle

    def _locate(self, actors: Actors) -> None:
        """Ask every role which node it runs on (for messages and the report)."""
        from .actors import alive_nodes

        labels = {n.id: n.label for n in alive_nodes()}
        roles = {"producer": actors.producer, "learner": actors.learner, **actors.workers, **actors.gateways}
        ids = ray.get([h.node_id.remote() for h in roles.values()])
        self.placement = {role: labels.get(i, i[:8]) for role, i in zip(roles, ids, strict=True)}

    def loop(self, actors: Actors, first: int) -> tuple[list[StepRecord], int]:
        """Steps ``first..steps``; the history (with the checkpoint's) and the object store's peak.

        Colocated: the producer fills the buffer, then the learner trains.
        Disaggregated: the producer runs all along and the learner waits longer.
        """
        cfg = self.cfg
        colocated = cfg.mode == "colocated"
        forever = None if colocated else actors.producer.run_forever.remote()
        history = list(self.state.history) if self.state else []
        plasma_max = 0
        for step in range(first, cfg.steps + 1):
            if colocated:
                ray.get(actors.producer.produce.remote(cfg.prompts_per_step))
            rec: StepRecord = ray.get(actors.learner.step.remote(step, 5.0 if colocated else 60.0))
            history.append(rec)
            self.step = step
            plasma_max = max(plasma_max, object_store_used())
            if self.progress is not None:
                self.progress(rec)
            if self.lock is not None:
                self.lock.check()  # another trainer took the run's lock: stop here
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                ray.get(actors.learner.checkpoint.remote(step))
                if cfg.crash_after_step == step:
                    raise SimulatedCrash(step, history)
        if forever is not None:
            ray.get(actors.producer.stop.remote())
            ray.get(forever)
        return history, plasma_max

    def drain(self, actors: Actors, plasma_max: int) -> EndState:
        """Take what is left in the buffer, release every owner, wait for the holders; what is left."""
        learner = ray.get(actors.learner.stats.remote())
        producer = ray.get(actors.producer.stats.remote())
        drained = drain_run(self.store)
        pool = WorkerPool(self.store, actors.workers)
        workers, gateway, per_node = self._wait_for_holders(pool, actors.gateways)
        return EndState(
            counts=store_counts(self.store),
            gate=self.store.gate.status(),
            workers=workers,
            producer=producer,
            learner=learner,
            drained=drained,
            object_store_bytes=sum(per_node.values()),
            object_store_bytes_max=plasma_max,
            gateway=gateway,
            object_store_bytes_per_node=per_node,
            placement=dict(self.placement),
            lost_workers=sorted({*pool.lost, *producer.lost_workers, *learner.lost_workers}),
        )

    def _wait_for_holders(
        self, pool: WorkerPool, gateways: Workers
    ) -> tuple[list[WorkerStats], GatewayActorStats | None, dict[str, int]]:
        """The live workers' (and the gateways', merged) stats once their holders hold no ref and
        every node's object store is empty.

        The holders drop refs as their event consumers see the releases, and
        the raylets' view of their object stores catches up within a few
        heartbeats; after ``holder_drain_s``, the stats as they are. A
        worker that died is left out (its refs and its node's store went
        with it).
        """
        deadline = time.monotonic() + self.cfg.holder_drain_s
        while True:
            stats: list[WorkerStats] = list(pool.call("stats").values())
            gw: GatewayActorStats | None = None
            if gateways:
                from .gateway_actor import merged

                gw = merged(ray.get([g.stats.remote() for g in gateways.values()]))
            used = object_store_used_per_node()
            refs = sum(w.holder.refs for w in stats) + (gw.holder.refs if gw is not None else 0)
            if (refs == 0 and not any(used.values())) or time.monotonic() > deadline:
                return stats, gw, used
            time.sleep(0.1)

    def close(self, actors: Actors, lost: list[str]) -> None:
        """Close every role (holders remove their consumer groups), then end the actors.

        The consumer groups of holders that died with their workers are
        removed here (nobody else would, until gc finds them idle).
        """
        ray.get([g.close.remote() for g in actors.gateways.values()])  # before the engines they serve
        WorkerPool(self.store, actors.workers).call("close")
        ray.get(actors.producer.close.remote())
        ray.get(actors.learner.close.remote())
        for w in lost:
            self.store.run(destroy_events_group(self.store.context, holder_name(w)))
        kill(actors.all())
