"""The caller's side of the rollout workers: place each session on a worker, call the workers.

Used by the producer (training samples), the learner (weights, aborts,
borrowed routed experts), its evaluation and the driver (stats). Each keeps
a :class:`WorkerPool`: placement is sticky
(:meth:`tracestore.router.Router.acquire`), so a continued session goes back
to the worker that holds its routed experts, and a worker whose actor died
(its node was lost) leaves the pool at the first call that finds it dead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from tracestore import TraceStore
from tracestore.gate import Lease
from tracestore.router import Router, RouterOps
from tracestore.scripts import Op
from tracestore.store import StoreOps

from .actors import Workers
from .sample import Sample

log = logging.getLogger(__name__)


def settle_calls(ops: StoreOps, unsettled: Sequence[tuple[Lease, str]]) -> list[Op[Any]]:
    """``settle_many`` calls for ``(lease, outcome)`` pairs, one per outcome (to gather with others).

    ``ops`` is the store's builder (``store.ops``).
    """
    by: dict[str, list[Lease]] = {}
    for lease, status in unsettled:
        by.setdefault(status, []).append(lease)
    return [ops.gate.settle_many(ls, status) for status, ls in by.items()]


def _note(exc: BaseException, text: str) -> None:
    """Add ``text`` to ``exc``'s notes (shown with its traceback; Python 3.11+), and log it."""
    log.warning(text)
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(text)


class WorkersLost(RuntimeError):
    """Every rollout worker of the run died (their nodes were lost): nothing can roll out."""

    def __init__(self, lost: Sequence[str]) -> None:
        super().__init__(f"every rollout worker was lost ({', '.join(lost)})")
        self.lost = list(lost)


class WorkerPool:
    """The rollout workers a role calls, less those Ray reported dead, and a router over the live ones.

    A call that finds a worker's actor dead or unreachable (Ray's
    ``ActorDiedError``, or ``ActorUnavailableError``, which is what a caller
    sees first when the worker's node dies) drops that worker: it is killed
    (an unreachable one might come back, and must not write on), listed in
    :attr:`lost`, its result is left out, and new sessions are routed over
    the others only (a session routed to it moves). What its sessions and leases become is
    the role's business (the producer drops their groups, the learner has gc
    declare its owner tags lost and clears its poisoned leases). Raises
    WorkersLost when the last worker goes. Not thread-safe: one per role.
    """

    def __init__(self, store: TraceStore, workers: Workers) -> None:
        self.store = store
        self.workers: Workers = dict(workers)
        #: Workers found dead, in the order they were found.
        self.lost: list[str] = []
        self.router: Router = store.router(sorted(workers))

    @property
    def router_ops(self) -> RouterOps:
        """The router's operations, built to run in a ``store.gather`` (``retire``, ``acquire_many``).

        With every worker lost, over the lost ones: ``retire`` (what a role's cleanup runs
        then) needs only the run, and an empty entrypoint list would raise InvalidInput
        over the WorkersLost being raised.
        """
        return self.store.ops.router(sorted(self.workers) or sorted(set(self.lost)))

    def call(self, method: str, *args: Any, only: Iterable[str] | None = None) -> dict[str, Any]:
        """``method(*args)`` on every live worker (or those of ``only``) at once; results by worker.

        Workers found dead are dropped and left out of the result.
        """
        names = [w for w in (self.workers if only is None else only) if w in self.workers]
        return self.gather({w: getattr(self.workers[w], method).remote(*args) for w in names})

    def gather(self, refs: dict[str, Any]) -> dict[str, Any]:
        """``ray.get`` of each worker's call; a worker found dead or unreachable is dropped and left out."""
        out: dict[str, Any] = {}
        for w, ref in refs.items():
            try:
                out[w] = ray.get(ref)
            except RayActorError:
                self.lose(w)
        return out

    def lose(self, worker: str) -> None:
        """Kill and drop ``worker`` (found dead or unreachable). Raises WorkersLost when none is left."""
        if worker not in self.workers:
            return
        ray.kill(self.workers.pop(worker), no_restart=True)
        self.lost.append(worker)
        if not self.workers:
            raise WorkersLost(self.lost)
        self.router = self.store.router(sorted(self.workers))

    def route(self, samples: Sequence[Sample]) -> dict[str, list[Sample]]:
        """The samples by worker, each with its ``worker`` set. One round trip (``acquire_many``)."""
        by_worker: dict[str, list[Sample]] = {}
        for s, w in zip(samples, self.router.acquire_many([s.sid for s in samples]), strict=True):
            by_worker.setdefault(w, []).append(dataclasses.replace(s, worker=w))
        return by_worker

    def run_unsettled(
        self, by_worker: dict[str, list[Sample]], temperature: float = 1.0
    ) -> tuple[dict[str, list[Sample]], list[Op[Any]]]:
        """:meth:`run`, each worker handing back the leases of its last round instead of settling them
        (``RolloutWorker.run_unsettled``): returns the results and the ``settle_many`` calls, for the
        caller to gather with its next store calls. Run them before anything waits for the gate to
        drain (a weight update): until then those leases are in flight. When a worker's call
        raises, the leases the others handed back are settled here, then its error is raised.
        """
        calls = {w: self.workers[w].run_unsettled.remote(ss, temperature) for w, ss in by_worker.items()}
        got: dict[str, Any] = {}
        failed: list[Exception] = []
        for w, ref in calls.items():  # every worker's answer, even after one failed
            try:
                got.update(self.gather({w: ref}))
            except Exception as exc:  # a failing worker settled its own leases (RolloutWorker.run_unsettled)
                failed.append(exc)
        unsettled = [pair for _out, pairs in got.values() for pair in pairs]
        if failed:
            first = failed[0]
            for other in failed[1:]:
                _note(first, f"another rollout worker failed too: {type(other).__name__}: {other}")
            try:  # the others' handed-back leases would otherwise expire into poison: settle them now
                self.store.gather(*settle_calls(self.store.ops, unsettled))
            except Exception as exc:
                _note(first, f"settling the other workers' {len(unsettled)} leases failed too: "
                      f"{type(exc).__name__}: {exc}")
            raise first
        return {w: list(out) for w, (out, _pairs) in got.items()}, settle_calls(self.store.ops, unsettled)

    def run(self, by_worker: dict[str, list[Sample]], temperature: float = 1.0) -> dict[str, list[Sample]]:
        """Continue each worker's samples there (all workers at once); their results by worker.

        A worker found dead is dropped: its samples are not in the result.
        """
        calls = {w: self.workers[w].run.remote(ss, temperature) for w, ss in by_worker.items()}
        return {w: list(out) for w, out in self.gather(calls).items()}
