"""Ray plumbing of the trainer: a private local Ray, the roles as actors, object store usage.

Kept in one place so that joining an existing cluster (placing workers on
its nodes) changes these functions, not the roles.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

#: A Ray actor handle (methods are called as ``handle.method.remote(...)``; Ray types them loosely).
Handle = Any
#: Rollout workers by name (the router's entrypoints).
Workers = dict[str, Handle]


def start_ray() -> bool:
    """Start a private local Ray unless this process already has one; True when started here.

    ``address="local"`` always starts a new local instance: a stale cluster
    record on the machine (``ray start`` run once) never makes the run join it.
    """
    if ray.is_initialized():
        return False
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    return True


def remote(cls: type, concurrency: int = 1) -> Any:
    """``cls`` as a Ray actor class; ``concurrency`` > 1 runs that many methods at once (threads)."""
    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": concurrency}
    return ray.remote(**opts)(cls)


def kill(handles: list[Handle]) -> None:
    """Kill actors without running their cleanup (a crash, an error, or after ``close``)."""
    for h in handles:
        ray.kill(h, no_restart=True)


def object_store_used() -> int:
    """Bytes in use in the Ray object store, as the raylet reports them (lags by a heartbeat)."""
    total = ray.cluster_resources().get("object_store_memory", 0.0)
    return int(total - ray.available_resources().get("object_store_memory", 0.0))
