"""The training loop: start the actors, alternate or overlap rollout and training, report.

:func:`run` is what ``tracestore train`` and ``python -m tracestore.trainer``
call. It returns the :class:`~tracestore.trainer.report.Report` and writes
``report.json`` and ``report.png`` into ``cfg.out``. The phases of a run are
the methods of :class:`Driver`, in order: recover (after a crash), start the
actors, loop over the steps, drain the run, close the actors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from tracestore import StorageError, TraceStore, TracestoreError, default_server
from tracestore.connection import failure_reason, mask_url, resolve_url

from .actors import Handle, Workers, kill, object_store_used, remote, start_ray
from .checkpoint import CheckpointState, ckpt_dir, load_state, store_path
from .config import ConfigError, TrainConfig
from .housekeeping import drain_run, reclaim_dead_owners, store_counts
from .learner import Learner
from .producer import Producer
from .report import EndState, Phases, Report, Start, StepRecord, build_report
from .rollout import RolloutWorker, WorkerStats

if TYPE_CHECKING:
    from .gateway_actor import GatewayActorStats

Progress = Callable[[StepRecord], None]


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


def run(
    cfg: TrainConfig,
    progress: Progress | None = None,
    started: Callable[[str, str], None] | None = None,
) -> Report:
    """Train; return the report (also written to ``cfg.out``).

    ``progress`` is called with each step's record, ``started`` with the
    URL and run id once the store answers. Raises ConfigError (a
    bad option, ``--resume`` without a checkpoint), StoreUnreachable (at the
    start or mid-run), Interrupted (Ctrl-C), SimulatedCrash, and the roles'
    errors; every actor is killed before any of them propagates.
    """
    cfg.validate()
    state = resume_state(cfg)
    store = connect(cfg)
    if started is not None:
        started(cfg.url or "", cfg.run)
    os.makedirs(cfg.out, exist_ok=True)
    started_ray = start_ray()
    driver = Driver(cfg, store, state, progress)
    try:
        report = driver.run()
    except KeyboardInterrupt as exc:
        raise Interrupted(driver.step, last_checkpoint(cfg)) from exc
    except SimulatedCrash:
        raise
    except Exception as exc:
        reason = unreachable(cfg)
        if reason is None:
            raise
        url = mask_url(cfg.url or "")
        raise StoreUnreachable(url, reason, driver.step, last_checkpoint(cfg)) from exc
    finally:
        store.close()
        if started_ray:
            ray.shutdown()
    report.write(cfg.out)
    return report


def resume_state(cfg: TrainConfig) -> CheckpointState | None:
    """With ``--resume``, the checkpoint's state.

    The run continues the checkpoint's run id, and its URL unless ``cfg.url``
    names one (``tracestore train`` also takes the mode from the checkpoint,
    see :meth:`TrainConfig.resumed`).
    """
    if not cfg.resume:
        return None
    state = load_state(cfg)
    if state is None:
        raise ConfigError(f"--resume: no checkpoint in {ckpt_dir(cfg)}")
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
    """The run's Ray actors (``gateway``: the session gateway, with ``--agents http``)."""

    workers: Workers
    learner: Handle
    producer: Handle
    gateway: Handle | None = None

    def all(self) -> list[Handle]:
        """Every actor, producer first."""
        gw = [self.gateway] if self.gateway is not None else []
        return [self.producer, self.learner, *gw, *self.workers.values()]


class Driver:
    """One run in this process: ``Driver(cfg, store, state, progress).run()`` -> the report."""

    def __init__(
        self,
        cfg: TrainConfig,
        store: TraceStore,
        state: CheckpointState | None,
        progress: Progress | None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.state = state
        self.progress = progress
        #: The last step trained (and reported) in this process, 0 before the first.
        self.step = 0
        self._handles: list[Handle] = []

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
            self.close(actors)
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
            self.store.restore(store_path(self.cfg))
        return reclaim_dead_owners(self.store, self.cfg.lease_ttl_s), restored

    def start_actors(self) -> tuple[Actors, int]:
        """Workers, the learner (warm start or checkpoint, first weight push), the producer.

        Returns the actors and the first step to train.
        """
        cfg = self.cfg
        # threaded: the learner borrows refs and pushes weights while a rollout runs (safe: a
        # weight push happens with the gate sealed and drained, so no generation is in flight)
        workers = {f"w{i}": self._spawn(RolloutWorker, 3, cfg, f"w{i}") for i in range(cfg.workers)}
        gateway, url = None, None
        if cfg.agents == "http":  # the workers serve engines; agents reach them through the gateway
            from .gateway_actor import GatewayActor

            engines = ray.get([w.serve_http.remote() for w in workers.values()])
            gateway = self._spawn(GatewayActor, 4, cfg, engines)
            url = ray.get(gateway.url.remote())
        learner = self._spawn(Learner, 1, cfg, workers, gateway, url)
        first: int = ray.get(learner.init.remote(self.state))
        producer = self._spawn(Producer, 2, cfg, workers, first, url)
        return Actors(workers, learner, producer, gateway), first

    def _spawn(self, cls: type, concurrency: int, *args: object) -> Handle:
        handle = remote(cls, concurrency).remote(*args)
        self._handles.append(handle)
        return handle

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
        workers, gateway, plasma_used = self._wait_for_holders(actors.workers, actors.gateway)
        return EndState(
            counts=store_counts(self.store),
            gate=self.store.gate.status(),
            workers=workers,
            producer=producer,
            learner=learner,
            drained=drained,
            object_store_bytes=plasma_used,
            object_store_bytes_max=plasma_max,
            gateway=gateway,
        )

    def _wait_for_holders(
        self, workers: Workers, gateway: Handle | None
    ) -> tuple[list[WorkerStats], GatewayActorStats | None, int]:
        """The workers' (and gateway's) stats once their holders hold no ref and Ray's object store is empty.

        The holders drop refs as their event consumers see the releases, and
        the raylet's view of the object store catches up within a few
        heartbeats; after ``holder_drain_s``, the stats as they are.
        """
        deadline = time.monotonic() + self.cfg.holder_drain_s
        while True:
            stats: list[WorkerStats] = ray.get([w.stats.remote() for w in workers.values()])
            gw: GatewayActorStats | None = ray.get(gateway.stats.remote()) if gateway is not None else None
            used = object_store_used()
            refs = sum(w.holder.refs for w in stats) + (gw.holder.refs if gw is not None else 0)
            if (refs == 0 and used == 0) or time.monotonic() > deadline:
                return stats, gw, used
            time.sleep(0.1)

    def close(self, actors: Actors) -> None:
        """Close every role (holders remove their consumer groups), then end the actors."""
        if actors.gateway is not None:  # before the engines it serves
            ray.get(actors.gateway.close.remote())
        ray.get([w.close.remote() for w in actors.workers.values()])
        ray.get(actors.producer.close.remote())
        ray.get(actors.learner.close.remote())
        kill(actors.all())
