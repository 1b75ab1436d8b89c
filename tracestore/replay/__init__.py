"""Replay buffer in Redis: groups of finished rollouts between producers and learners (DESIGN section 7).

A *group* is a set of sessions (the rollouts of one prompt, its *members*)
with a status, the oldest weight version of any of its tokens (per member
and overall) and a JSON payload (rewards, finish reasons...). Stored groups
live on the run's control-plane slot:

* ``ts:{R}:rb:groups`` hash gid -> record, a JSON object: ``task``,
  ``status``, ``min_version``, ``seq``, ``retryable``, ``agentic``, ``mv``
  (each member's oldest token version), ``reroll`` (members released by
  per-member expiry), ``put_ms``, ``producer``;
* ``ts:{R}:rb:sids`` hash gid -> the members' session ids (JSON array);
* ``ts:{R}:rb:payloads`` hash gid -> the payload (JSON, verbatim as put);
* ``ts:{R}:rb:q:<task>:<status>`` zset gid -> seq (FIFO order);
* ``ts:{R}:rb:v:<task>:<status>`` zset gid -> ``min_version + seq / 2**32``:
  one index gives both the staleness order (oldest version, then FIFO) and
  the expiry range (``ZRANGEBYSCORE -inf (cutoff``, O(log n + k));
* ``ts:{R}:rb:p:<task>:<status>`` zset ``<seq, 10 digits>:<gid>`` ->
  ``-payload["priority"]`` for the groups that have one (priority order);
  the three indexes of a (task, status) *cell* and the KEYS layout every
  script receives them in: :mod:`~tracestore.replay.layout`;
* ``ts:{R}:rb:bytes`` (bytes of records per task and status),
  ``ts:{R}:rb:seq``, ``ts:{R}:rb:tasks``.

A group lives in three run-level hashes rather than in a key of its own so
that a take reads and deletes its groups with a few commands, whatever
their number, and hands their three strings out undecoded.

Each operation is one atomic script (``lua/rb_*.lua``) that also moves or
releases the group's sessions with the shared ownership primitives, so a
session is owned by its producer, then by ``replay``, then by its taker,
never by two, and a released session gets exactly one event.

Staleness: ``staleness = current_version - min_version``. A group is
*ready* when ``staleness <= max_staleness`` and *stale* otherwise, i.e. stale
iff ``min_version < current_version - max_staleness``. ``put`` reads each
member's oldest version from its stored traces (the trained tokens' weight
versions), so callers need not track it.

Scripts that choose their groups inside Redis (take, claim, expire) reach
those groups' session hashes in one of two ways (``lua/_lib/rb.lua``): by
default the script appends the sids to the session key prefix of the run's
control-plane slot (one round trip; see docs/replay.md for what Redis and
Valkey permit), or, with ``StoreConfig.replay_declared_keys``, every key
travels in KEYS and a first call answers ``NEED`` with the sids (two round
trips).

Take order: a policy by name (:mod:`~tracestore.replay.policies`: ``fifo``,
``staleness``, ``priority``), each one Lua picker and one registry entry.

The package is split by job: :mod:`~tracestore.replay.types` (limits and
value types), :mod:`~tracestore.replay.layout` (cells and their KEYS),
:mod:`~tracestore.replay.policies`, :mod:`~tracestore.replay.put`, :mod:`~tracestore.replay.take`
(take, take_many, claim_retry), :mod:`~tracestore.replay.expire`,
:mod:`~tracestore.replay.reads` (ready, count, stats, groups) and
:mod:`~tracestore.replay._common` (argument checks before any I/O, decoding
of stored groups, the keys of groups a script picks).
"""

from __future__ import annotations

from ..context import Context
from ..twin import AsyncPart, SyncPart, op
from ._common import read_groups
from .expire import expire
from .layout import PRIORITY_FIELD
from .policies import POLICIES, TakePolicy
from .put import put, put_many, put_request, put_result
from .reads import count, groups, ready, ready_many, stats
from .take import claim_retry, take, take_many
from .types import (
    EXPIRABLE_STATUSES,
    EXPIRE_BATCH,
    MAX_ROUNDS,
    MAX_SIDS,
    MAX_STALE_IN_TAKE,
    MAX_TAKE,
    MAX_VERSION,
    REPLAY_OWNER,
    STATUSES,
    STORED_STATUSES,
    ExpireReport,
    Group,
    PutResult,
    StatusStats,
    Taken,
    TakenMany,
)

__all__ = [
    "AsyncReplay",
    "EXPIRABLE_STATUSES",
    "EXPIRE_BATCH",
    "ExpireReport",
    "Group",
    "MAX_ROUNDS",
    "MAX_SIDS",
    "MAX_STALE_IN_TAKE",
    "MAX_TAKE",
    "MAX_VERSION",
    "POLICIES",
    "PRIORITY_FIELD",
    "PutResult",
    "REPLAY_OWNER",
    "Replay",
    "ReplayMethods",
    "STATUSES",
    "STORED_STATUSES",
    "StatusStats",
    "Taken",
    "TakePolicy",
    "TakenMany",
    "claim_retry",
    "count",
    "expire",
    "groups",
    "put",
    "put_many",
    "put_request",
    "put_result",
    "read_groups",
    "ready",
    "ready_many",
    "stats",
    "take",
    "take_many",
]


class ReplayMethods:
    """The replay buffer's methods, listed once for :class:`Replay` and :class:`AsyncReplay`."""

    put = op(put)
    put_many = op(put_many)
    take = op(take)
    take_many = op(take_many)
    ready = op(ready)
    ready_many = op(ready_many)
    claim_retry = op(claim_retry)
    expire = op(expire)
    count = op(count)
    stats = op(stats)
    groups = op(groups)


class Replay(ReplayMethods, SyncPart[Context]):
    """The replay buffer of a run (``store.replay``); see the module docstring."""


class AsyncReplay(ReplayMethods, AsyncPart[Context]):
    """asyncio counterpart of :class:`Replay` (``AsyncTraceStore.replay``); same methods, as coroutines."""
