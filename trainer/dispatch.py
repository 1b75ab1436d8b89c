"""The caller's side of a rollout: place each session on a worker, run the samples there.

Used by the producer (training samples) and the evaluation. Placement is
sticky (:meth:`tracestore.router.Router.acquire`): a continued session goes
back to the worker that holds its routed experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ray

from tracestore.router import Router

from .actors import Workers
from .sample import Sample


def route(router: Router, samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    """The samples by worker, each with its ``worker`` set. One round trip (``acquire_many``)."""
    by_worker: dict[str, list[Sample]] = {}
    for s, w in zip(samples, router.acquire_many([s.sid for s in samples]), strict=True):
        by_worker.setdefault(w, []).append(dataclasses.replace(s, worker=w))
    return by_worker


def run_on_workers(
    workers: Workers, by_worker: dict[str, list[Sample]], temperature: float = 1.0
) -> dict[str, list[Sample]]:
    """Continue each worker's samples there (all workers at once); their results by worker."""
    calls = {w: workers[w].run.remote(ss, temperature) for w, ss in by_worker.items()}
    return {w: list(ray.get(ref)) for w, ref in calls.items()}
