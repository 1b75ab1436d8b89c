"""The trainer's only contact points with ``tracestore.ray.RefHolder`` and ``store.replay``.

Kept in one place so that the rest of the trainer reads as a user's loop and
so that an API detail of those modules changes one function here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracestore import TraceStore

# -- routed-expert holder (DESIGN s5, Ray side) ------------------------------------------


def new_holder(store: TraceStore, name: str) -> Any:
    """A :class:`tracestore.ray.RefHolder` for this process, consuming release events as ``name``."""
    from tracestore.ray import RefHolder

    return RefHolder(store, name=name)


def holder_stats(holder: Any) -> dict[str, int]:
    """``{"sessions", "refs", "bytes"}`` of a holder."""
    st = holder.stats()
    return {"sessions": st.sessions, "refs": st.refs, "bytes": st.bytes}


def holder_get(holder: Any, keys: Sequence[str]) -> list[Any]:
    """Lend the ObjectRefs of ``keys`` (raises when the holder does not have one)."""
    return list(holder.get(list(keys)))


def expert_key_lost(key: str) -> bool:
    """True for an expert key that a checkpoint restore marked lost (its Ray object is gone)."""
    from tracestore import expert_key_lost as lost

    return lost(key)


def close_holder(holder: Any) -> None:
    """Stop the holder's consumer and remove its consumer group (the run is over)."""
    holder.close(destroy_group=True)


# -- replay buffer (DESIGN s7) -----------------------------------------------------------


def make_group(
    gid: str,
    task: str,
    sids: Sequence[str],
    status: str,
    min_version: int,
    retryable: bool,
    payload: dict[str, Any],
) -> Any:
    """A :class:`tracestore.replay.Group`."""
    from tracestore.replay import Group

    return Group(
        gid=gid,
        task=task,
        sids=tuple(sids),
        status=status,
        min_version=min_version,
        retryable=retryable,
        payload=payload,
    )


def replay_put(store: TraceStore, group: Any, owner: str) -> None:
    store.replay.put(group, owner)


def replay_take(
    store: TraceStore, task: str, n: int, *, owner: str, current_version: int, max_staleness: int
) -> list[Any]:
    """``n`` completed groups (all or nothing: [] when fewer are ready), moved to ``owner``."""
    got = store.replay.take(
        task,
        n,
        owner=owner,
        current_version=current_version,
        policy="fifo",
        max_staleness=max_staleness,
    )
    return list(got or [])


def replay_claim_retry(store: TraceStore, task: str, n: int, owner: str) -> list[Any]:
    """Up to ``n`` aborted/expired retryable groups, their sessions moved to ``owner``."""
    return list(store.replay.claim_retry(task, n, owner) or [])


def replay_count(store: TraceStore, task: str, status: str | None = None) -> int:
    return int(store.replay.count(task=task, status=status))


def checkpoint_store(store: TraceStore, path: str) -> Any:
    return store.checkpoint(path)


def restore_store(store: TraceStore, path: str) -> Any:
    return store.restore(path)
