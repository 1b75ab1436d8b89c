"""Evaluation: the same ``eval_prompts`` problems every time, one sample each at ``eval_temperature``.

Runs in the learner. Sessions are opened for the owner tag ``eval:<step>``
and released in a ``finally`` (only those: replay-owned sessions are never
touched), and their routes retired.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import numpy as np

from tracestore import TraceStore
from tracestore.scripts import Op

from .clock import Stopwatch
from .config import TrainConfig
from .dispatch import WorkerPool
from .sample import Sample
from .task import make_problem


class Evaluator:
    """``evaluator(step, version)``: the mean reward of the evaluation problems now."""

    def __init__(
        self,
        cfg: TrainConfig,
        store: TraceStore,
        pool: WorkerPool,
        store_time: Stopwatch,
        gateway_url: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.pool = pool
        self.store_time = store_time
        #: With --agents http: evaluate through the session gateway, as agents.
        self.gateway_url = gateway_url

    def samples(self, step: int) -> list[Sample]:
        """Fresh samples of the evaluation problems (the same problems for every step)."""
        rng = random.Random(10_000 + self.cfg.seed)
        nonce = uuid.uuid4().hex[:6]
        return [
            Sample.new(f"eval-{step}-{nonce}-{i}", make_problem(rng, f"e{i}"), self.cfg.max_calls)
            for i in range(self.cfg.eval_prompts)
        ]

    def __call__(self, step: int, version: int) -> float:
        """Roll the evaluation samples out with weights ``version``; their mean reward.

        Samples on a worker that died meanwhile are left out of the mean.
        """
        owner = f"eval:{step}"
        samples = self.samples(step)
        sids = [s.sid for s in samples]
        settles: list[Op[Any]] = []  # the workers' last leases: settled with the release
        try:
            with self.store_time():
                self.store.open_sessions(sids, owner, version=version)
            if self.gateway_url is not None:
                from .http_agents import run_over_http

                done, _ = run_over_http(self.gateway_url, samples, self.cfg, owner, self.cfg.eval_temperature)
                rewards = [s.reward for s in done]
            else:
                with self.store_time():
                    by_worker = self.pool.route(samples)
                out, settles = self.pool.run_unsettled(by_worker, self.cfg.eval_temperature)
                rewards = [s.reward for ss in out.values() for s in ss]
            return float(np.mean(rewards))
        finally:
            ops = self.store.ops
            with self.store_time():  # settle, release and retire share the release's first round trip
                self.store.gather(*settles, ops.release_owner(owner, "eval-done"), self.pool.router_ops.retire(sids))
