"""Learner: takes ``train:<step>`` batches, trains with routing replay, syncs weights through the gate.

A step: ``replay.take`` moves ``prompts_per_step`` completed groups to the
owner tag ``train:<step>`` -> every sample's training trace is exported (key:
the conversation up to its last answer) and its routed experts borrowed from
the worker that recorded them -> one GRPO step -> ``release_owner`` of the
step's tag and ``router.retire`` -> every ``sync_every`` steps, a weight update
through the gate (abort generation in flight, seal, drain, push, install,
reopen) -> every ``eval_every`` steps, an evaluation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from tracestore import Group, Trace, TraceStore, expert_key_lost
from tracestore.router import Router

from . import checkpoint as ckpt
from .actors import Workers
from .checkpoint import CheckpointState
from .clock import Stopwatch
from .config import TASK, TrainConfig
from .evaluation import Evaluator
from .grpo import TrainSample, collate, group_advantages, train_step
from .policy import new_policy, replay_logprobs, set_determinism, state_to_numpy
from .report import StepRecord
from .sample import Sample, from_payload
from .tokenizer import TOKENIZER as TOK


@dataclass(frozen=True)
class Batch:
    """A step's training samples and what its record reports about them."""

    samples: list[TrainSample]
    sids: list[str]
    rewards: list[float]
    #: Versions behind the current weights, per group.
    staleness: list[int]
    #: Indices of samples made entirely by the current weights, with their routing.
    same_version: list[int]
    groups: int


@dataclass(frozen=True)
class LearnerStats:
    """Time in tracestore and busy, weight updates, the current version, routing fallbacks."""

    store_s: float
    busy_s: float
    gate_cycles: int
    version: int
    replay_fallbacks: int
    baseline_eval: float | None


class Learner:
    """A Ray actor (one thread)."""

    def __init__(self, cfg: TrainConfig, workers: Workers) -> None:
        self.cfg = cfg
        self.workers = workers
        set_determinism(cfg.seed)
        self.store = TraceStore.connect(cfg.url, run=cfg.run)
        self.router: Router = self.store.router(sorted(workers))
        self.store_time = Stopwatch()
        self.busy = Stopwatch()
        self.evaluate = Evaluator(cfg, self.store, self.router, workers, self.store_time)
        self.model = new_policy(TOK.vocab_size, seed=cfg.seed, max_len=256)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.version = 0
        self.history: list[StepRecord] = []
        self.gate_cycles = 0
        self.replay_fallbacks = 0
        self.baseline_eval: float | None = None

    def init(self, state: CheckpointState | None) -> int:
        """Warm start (or load the checkpoint), push weights to the workers; returns the next step."""
        start = 1
        if state is not None:
            ckpt.load_model(self.cfg, self.model, self.opt)
            self.history = list(state.history)
            self.gate_cycles = state.gate_cycles
            self.baseline_eval = state.baseline_eval
            start = state.step + 1
        else:
            from .warmup import warm_start

            warm_start(self.model, TOK, steps=self.cfg.warmup_steps, seed=self.cfg.seed)
        with self.store_time():
            self.version = self.store.gate.status().version
        self._push(self.version)
        if start == 1:
            self.baseline_eval = self.evaluate(0, self.version)  # the warm start, before RL
        return start

    # -- one step ------------------------------------------------------------------------------

    def step(self, step: int, wait_s: float = 60.0) -> StepRecord:
        """Train on one batch (waiting up to ``wait_s`` for it); the step's record.

        Raises RuntimeError when no batch is ready in time (every group
        filtered, i.e. the policy collapsed, or the producer stalled).
        """
        with self.busy():
            owner = f"train:{step}"
            t0 = time.perf_counter()
            groups = self._take(owner, step, wait_s)
            wait = time.perf_counter() - t0
            batch = self._batch(groups)
            align = self._alignment(batch)
            stats = train_step(self.model, self.opt, batch.samples, TOK.pad_id)
            released = self._release(owner, batch.sids)
            synced = self._sync_weights(step)
            rec = StepRecord(
                step=step,
                reward=float(np.mean(batch.rewards)),
                staleness_mean=float(np.mean(batch.staleness)),
                staleness_max=int(max(batch.staleness)),
                groups=batch.groups,
                samples=len(batch.samples),
                released=released,
                taken=len(batch.sids),
                loss=stats["loss"],
                approx_kl=stats["approx_kl"],
                replay_max_abs_diff=align,
                version=self.version,
                synced=synced,
                wait_s=wait,
            )
            if step % self.cfg.eval_every == 0 or step == self.cfg.steps:
                rec = dataclasses.replace(rec, eval_reward=self.evaluate(step, self.version))
            self.history.append(rec)
            return rec

    def _take(self, owner: str, step: int, wait_s: float) -> list[Group]:
        end = time.monotonic() + wait_s
        n = self.cfg.prompts_per_step
        while True:
            with self.store_time():
                taken = self.store.replay.take(
                    TASK,
                    n,
                    owner=owner,
                    current_version=self.version,
                    max_staleness=self.cfg.max_staleness,
                )
            if taken:
                return list(taken)
            if time.monotonic() > end:
                raise RuntimeError(
                    f"step {step}: no batch of {n} groups within {wait_s}s ({taken.ready} ready; "
                    "every group filtered, i.e. the policy collapsed, or the producer stalled)"
                )
            time.sleep(0.02)

    def _batch(self, groups: Sequence[Group]) -> Batch:
        """Group-relative advantages, exported traces and borrowed routing of every sample."""
        scored: list[tuple[Sample, float]] = []
        staleness: list[int] = []
        for g in groups:
            samples = from_payload(g.payload)
            scored += zip(samples, group_advantages([s.reward for s in samples]), strict=True)
            staleness.append(self.version - g.min_version)
        traces = self._export([s for s, _ in scored])
        wanted = [(s.worker, tr.expert_keys or []) for (s, _), tr in zip(scored, traces, strict=True)]
        train: list[TrainSample] = []
        same_version: list[int] = []
        for (_, adv), tr, parts in zip(scored, traces, self._fetch_routing(wanted), strict=True):
            routing = _routing(parts, len(tr.input_ids))
            if routing is not None and min(tr.versions) == max(tr.versions) == self.version:
                same_version.append(len(train))
            train.append(
                TrainSample(
                    np.asarray(tr.input_ids, dtype=np.int64),
                    np.asarray(tr.labels, dtype=np.int64),
                    np.asarray(tr.logprobs, dtype=np.float32),
                    routing,
                    adv,
                )
            )
        sids = [s.sid for s, _ in scored]
        rewards = [s.reward for s, _ in scored]
        return Batch(train, sids, rewards, staleness, same_version, len(groups))

    def _export(self, samples: Sequence[Sample]) -> list[Trace]:
        """The training trace of each sample's last turn. One round trip per sample."""
        with self.store_time():
            return [self.store.export_training_trace(s.sid, s.final_key()) for s in samples]

    def _fetch_routing(self, wanted: list[tuple[str | None, list[str]]]) -> list[list[Any] | None]:
        """Routed-expert parts of each ``(worker, keys)``: one borrow call per worker, one get.

        None for a trace whose keys are lost (restored checkpoint) or whose
        holder no longer has them (worker restarted): that sample trains
        without routing replay.
        """
        by_worker: dict[str, list[str]] = {}
        for w, keys in wanted:
            if w is not None and keys and not any(expert_key_lost(k) for k in keys):
                by_worker.setdefault(w, []).extend(keys)
        lent: dict[str, Any] = {}
        for w, keys in by_worker.items():
            try:
                refs = ray.get(self.workers[w].get_refs.remote(keys))
                lent.update(zip(keys, ray.get(refs), strict=True))
                del refs
            except Exception:
                self.replay_fallbacks += 1
        return [
            [lent[k] for k in keys] if keys and all(k in lent for k in keys) else None
            for _, keys in wanted
        ]

    def _alignment(self, batch: Batch) -> float | None:
        """Max |replayed - rollout| logprob over generated tokens of samples made by these weights."""
        chosen = [batch.samples[i] for i in batch.same_version]
        if not chosen:
            return None
        b = collate(chosen, TOK.pad_id)
        with torch.no_grad():
            lp = replay_logprobs(self.model, b.input_ids, b.routing)
        return float(((lp - b.old_logprobs).abs() * b.mask).max())

    def _release(self, owner: str, sids: list[str]) -> int:
        """Release the step's sessions (their holders drop the experts) and retire their routes."""
        with self.store_time():
            released = self.store.release_owner(owner, "trained")
            self.router.retire(sids)
        return len(released)

    def _sync_weights(self, step: int) -> bool:
        """Every ``sync_every`` steps: a weight update through the gate; True when it ran."""
        if step % self.cfg.sync_every:
            return False
        new = self.version + 1
        # like an engine pause: abort generation in flight, so the drain is short
        ray.get([w.abort_requests.remote() for w in self.workers.values()])
        t0 = time.perf_counter()
        with self.store.gate.weight_update(new, self.cfg.drain_timeout_s):
            t1 = time.perf_counter()
            self._push(new)
            t2 = time.perf_counter()
        # seal + drain before the push and install + reopen after it are tracestore time
        self.store_time.add((t1 - t0) + (time.perf_counter() - t2))
        self.version = new
        self.gate_cycles += 1
        return True

    def _push(self, version: int) -> None:
        ref = ray.put(state_to_numpy(self.model))
        ray.get([w.set_weights.remote(ref, version) for w in self.workers.values()])
        del ref

    # -- checkpoint and report -----------------------------------------------------------------

    def checkpoint(self, step: int) -> CheckpointState:
        """Write the checkpoint of ``step``: model and optimizer, the store, then ``state.json``."""
        state = CheckpointState(
            step, self.version, list(self.history), self.gate_cycles, self.baseline_eval, self.cfg
        )
        ckpt.save(state, self.model, self.opt, self.store)
        return state

    def stats(self) -> LearnerStats:
        """Counters for the report."""
        return LearnerStats(
            store_s=self.store_time.seconds,
            busy_s=self.busy.seconds,
            gate_cycles=self.gate_cycles,
            version=self.version,
            replay_fallbacks=self.replay_fallbacks,
            baseline_eval=self.baseline_eval,
        )

    def close(self) -> None:
        """Close the store."""
        self.store.close()


def _routing(parts: list[Any] | None, n_tokens: int) -> np.ndarray | None:
    """A trace's routed experts, ``[n_tokens - 1, layers, k]`` (dummy row dropped), or None."""
    if parts is None:
        return None
    routing = np.concatenate([np.asarray(p) for p in parts])[1:].astype(np.int64)
    return routing if routing.shape[0] == n_tokens - 1 else None
