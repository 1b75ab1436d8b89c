"""A buffer full of stale groups must not starve the learner (issue 29, item 1).

The disaggregated producer (``Producer.run_forever``) keeps ``max_buffer``
*completed* groups and stops producing while the count is reached; the
learner takes with ``max_staleness``. When every group in the buffer is
stale, the learner's take is short. Before the fix a short take changed
nothing, not even the expiry: the stale groups stayed completed, the
producer stayed paused, and the learner's wait ran out with "no batch of n
groups ... the producer stalled". Now the short take expires them, the
producer refills the buffer under the new version and the step trains.

The scenario is built with the trainer's real roles (Ray actors of
:class:`~tracestore.trainer.rollout.RolloutWorker`,
:class:`~tracestore.trainer.learner.Learner` and
:class:`~tracestore.trainer.producer.Producer`, as ``tracestore train``
starts them) on a real store, step by step so that the buffer is stale
for certain: step 1 trains on two of four version-0 groups and syncs the
weights (version 1, ``max_staleness`` 0), which leaves two stale groups,
as many as ``max_buffer``; then ``run_forever`` starts and step 2 runs.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.test_trainer_e2e import FAST
from tracestore import TraceStore
from tracestore.trainer.actors import kill, remote
from tracestore.trainer.config import TASK, TrainConfig
from tracestore.trainer.housekeeping import drain_run
from tracestore.trainer.learner import Learner
from tracestore.trainer.producer import Producer
from tracestore.trainer.rollout import RolloutWorker

# the roles on Ray over the store; the store's own buffer tests run on every backend
pytestmark = [pytest.mark.ray, pytest.mark.backends("valkey", "cluster")]


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_buffer_of_stale_groups_does_not_starve_the_learner(url: str, tmp_path: Any) -> None:
    cfg = TrainConfig(
        mode="disaggregated", url=url, run=f"t-{uuid.uuid4().hex[:10]}", out=str(tmp_path),
        **{**FAST, "steps": 10, "eval_every": 10, "max_buffer": 2, "max_staleness": 0, "sync_every": 1},
    ).validate()
    n = cfg.prompts_per_step
    workers = {f"w{i}": remote(RolloutWorker, 3).remote(cfg, f"w{i}") for i in range(cfg.workers)}
    learner = remote(Learner, 1).remote(cfg, workers)
    handles = [*workers.values(), learner]
    store = TraceStore.connect(url, run=cfg.run)
    try:
        first = ray.get(learner.init.remote(None))
        producer = remote(Producer, 2).remote(cfg, workers, first)
        handles.append(producer)
        ray.get(producer.produce.remote(2 * n))  # version 0: enough for step 1, and max_buffer more
        one = ray.get(learner.step.remote(first, 60.0))
        assert one.synced and one.version == 1
        stale = [g.gid for g in store.replay.groups(TASK)]
        assert len(stale) >= cfg.max_buffer and all(
            g.min_version == 0 for g in store.replay.groups(TASK)
        )  # every completed group is stale at version 1: the producer will not add any
        forever = producer.run_forever.remote()
        # before the fix: RuntimeError "no batch of 2 groups within 60.0s (0 ready; ... stalled)"
        two = ray.get(learner.step.remote(first + 1, 60.0))
        assert two.groups == n and two.staleness_max == 0
        ray.get(producer.stop.remote())
        ray.get(forever)
        # the stale groups were expired by the learner's short take (completed groups of the
        # trainer are not retryable: released, one event per session)
        assert not set(stale) & {g.gid for g in store.replay.groups(TASK)}
        assert store.stats().groups_expired >= len(stale)
        drain_run(store)
        events = store.redis.xrange(store.keys.events)
        per_sid = Counter(fields[b"sid"] for _, fields in events)
        assert per_sid and set(per_sid.values()) == {1}  # each session released once
        reasons = Counter(fields[b"reason"].decode() for _, fields in events)
        assert reasons["expired"] >= cfg.group_size * len(stale)
    finally:
        store.close()
        kill(handles)
