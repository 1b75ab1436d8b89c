"""What the learner trains on: every taken sample's trace, advantage and borrowed routing.

For each sample of the groups a step took: its group-relative advantage, the
training trace of its last turn (``export_training_trace``; key: the
conversation up to its last answer) and its routed experts, borrowed from
the worker whose ``RefHolder`` keeps them (one ``get_refs`` call per worker,
one ``ray.get`` of the distinct refs it lent), concatenated, the dummy row
dropped. A sample whose experts are gone (keys marked lost by a store
restore, a holder that no longer has them, or a worker that died with them)
trains without routing replay.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import ray

from tracestore import Group, PromptMismatch, Trace, TraceStore, expert_key_lost
from tracestore.ray import expert_values

from .actors import Workers
from .clock import Stopwatch
from .dispatch import WorkerPool, WorkersLost
from .grpo import TrainSample, group_advantages
from .sample import Sample, from_payload

log = logging.getLogger(__name__)


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


class BatchBuilder:
    """``builder.build(groups, version)`` -> :class:`Batch`; counts routing fallbacks."""

    def __init__(
        self, store: TraceStore, pool: WorkerPool, store_time: Stopwatch, holders: Workers | None = None
    ) -> None:
        self.store = store
        self.pool = pool
        #: Other holders of routed experts than the workers, by name (the session gateway).
        self.holders: Workers = dict(holders or {})
        self.store_time = store_time
        #: Borrow calls that failed (those samples trained without routing replay).
        self.fallbacks = 0

    def build(self, groups: Sequence[Group], version: int) -> Batch:
        """The batch of ``groups`` for a policy at weight ``version``."""
        scored: list[tuple[Sample, float]] = []
        staleness: list[int] = []
        for g in groups:
            samples = from_payload(g.payload)
            scored += zip(samples, group_advantages([s.reward for s in samples]), strict=True)
            staleness.append(g.staleness(version))
        traces = self._export([s for s, _ in scored])
        wanted = [
            (s.worker, tr.expert_keys or []) for (s, _), tr in zip(scored, traces, strict=True)
        ]
        train: list[TrainSample] = []
        same_version: list[int] = []
        for (_, adv), tr, parts in zip(scored, traces, self._borrow(wanted), strict=True):
            routing = _routing(parts, len(tr.input_ids))
            if routing is not None and min(tr.versions) == max(tr.versions) == version:
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
        """The training trace of each sample's last turn: one ``export_many`` (1-2 round trips).

        A sample whose rendered conversation is no stored key was not recorded as it was
        played: a bug of whatever carried its turns (an HTTP agent once sent back a call
        in another form than the gateway recorded it). Any stored path would be another
        conversation than the one its reward scores, so the step fails with the
        PromptMismatch, after logging each such sample's key and its session's stored
        keys (the difference shows in those two texts).
        """
        keys = [(s.sid, s.final_key()) for s in samples]
        with self.store_time():
            try:
                return self.store.export_many(keys)
            except PromptMismatch:
                for sid, key in keys:
                    try:
                        self.store.export_training_trace(sid, key)
                    except PromptMismatch as exc:
                        log.error("%s; the sample's key %r; stored keys %r", exc, key, self.store.trace_keys(sid))
                raise

    def _borrow(self, wanted: list[tuple[str | None, list[str]]]) -> list[list[np.ndarray] | None]:
        """Routed-expert parts of each ``(worker, keys)``: one borrow call per worker, then
        one ``ray.get`` of the distinct refs it lent (the keys of a worker's round share one
        ref, see ``RefHolder.put_many``; :func:`~tracestore.ray.expert_values`).

        None for a trace whose keys are lost or whose holder no longer has them.
        """
        by_worker: dict[str, list[str]] = {}
        for w, keys in wanted:
            if w is not None and keys and not any(expert_key_lost(k) for k in keys):
                by_worker.setdefault(w, []).extend(keys)
        lent: dict[str, np.ndarray] = {}
        for w, keys in by_worker.items():
            try:
                if w in self.holders:
                    refs = ray.get(self.holders[w].get_refs.remote(keys))
                else:
                    refs = self.pool.call("get_refs", keys, only=[w]).get(w)  # None: the worker died
                if refs is None:
                    self.fallbacks += 1
                    continue
                lent.update(zip(keys, expert_values(keys, refs), strict=True))
                del refs
            except WorkersLost:
                raise
            except Exception:  # a key the holder no longer has (ExpertRefMissing), a lost object
                self.fallbacks += 1
        return [
            [lent[k] for k in keys] if keys and all(k in lent for k in keys) else None
            for _, keys in wanted
        ]


def _routing(parts: list[np.ndarray] | None, n_tokens: int) -> np.ndarray | None:
    """A trace's routed experts, ``[n_tokens - 1, layers, k]`` (dummy row dropped), or None."""
    if parts is None:
        return None
    routing = np.concatenate([np.asarray(p) for p in parts])[1:].astype(np.int64)
    return routing if routing.shape[0] == n_tokens - 1 else None
