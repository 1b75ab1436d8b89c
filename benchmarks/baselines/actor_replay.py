"""Baseline: the replay buffer as one Ray actor holding everything in Python memory.

What today's frameworks do (PRIOR_ART.md): groups, their order and session
ownership live in one actor; every producer and learner call is a remote
call that the actor serves one at a time. Same semantics as
``tracestore.replay`` (put moves sessions to the buffer, failed/filtered
puts release them, take is all-or-nothing and expires first, retryable
expiry keeps sessions, one release event per session), written the way such
actors usually are: per-(task, status) insertion-ordered dicts, and expiry
by a scan of the ready groups (there is no ordered index in the standard
library; keeping one with ``bisect`` would make every take O(n) instead).

Not a product: no durability, no sharing across processes except through
the actor, no retry idempotency.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _G:
    gid: str
    task: str
    sids: tuple[str, ...]
    status: str
    min_version: int
    retryable: bool
    payload: dict[str, Any]
    seq: int = 0


@dataclass
class ActorReplayBuffer:
    """The buffer's state and operations (wrapped in ``ray.remote`` by :func:`remote_class`)."""

    owner_of: dict[str, str] = field(default_factory=dict)
    queues: dict[tuple[str, str], OrderedDict[str, _G]] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    seq: int = 0

    def _q(self, task: str, status: str) -> OrderedDict[str, _G]:
        return self.queues.setdefault((task, status), OrderedDict())

    def open_sessions(self, sids: list[str], owner: str) -> int:
        for s in sids:
            if s in self.owner_of:
                raise ValueError(f"session {s} exists")
            self.owner_of[s] = owner
        return len(sids)

    def _release(self, sids: tuple[str, ...], owner: str, reason: str) -> list[str]:
        out = []
        for s in sids:
            if self.owner_of.get(s) == owner:
                self.owner_of[s] = "#released"
                self.events.append((s, owner, reason))
                out.append(s)
        return out

    def put(self, gid: str, task: str, sids: tuple[str, ...], status: str, min_version: int,
            retryable: bool, payload: dict[str, Any], owner: str) -> int | None:
        for s in sids:
            if self.owner_of.get(s) != owner:
                raise PermissionError(f"session {s} not owned by {owner}")
        if status in ("failed", "filtered"):
            self._release(sids, owner, status)
            return None
        for q in self.queues.values():
            if gid in q:
                raise KeyError(f"group {gid} exists")
        self.seq += 1
        self._q(task, status)[gid] = _G(gid, task, sids, status, min_version, retryable, payload, self.seq)
        for s in sids:
            self.owner_of[s] = "replay"
        return self.seq

    def put_many(self, groups: list[tuple[Any, ...]], owner: str) -> int:
        """Bulk load for the benchmark's untimed setup: :meth:`put` of each ``(gid, task, sids,
        status, min_version, retryable, payload)`` in one remote call."""
        for g in groups:
            self.put(*g, owner)
        return len(groups)

    def _expire_task(self, task: str, cutoff: int, keep: bool | None) -> tuple[list[str], list[str]]:
        """Expire the stale ready groups of ``task``; returns (kept gids, released gids)."""
        ready = self._q(task, "completed")
        stale = [g for g in ready.values() if g.min_version < cutoff]  # a scan of the ready groups
        stale.sort(key=lambda g: (g.min_version, g.seq))
        kept, released = [], []
        expired = self._q(task, "expired")
        for g in stale:
            del ready[g.gid]
            if g.retryable if keep is None else keep:
                g.status = "expired"
                expired[g.gid] = g
                kept.append(g.gid)
            else:
                self._release(g.sids, "replay", "expired")
                released.append(g.gid)
        if kept:  # keep the expired queue in put order
            self.queues[(task, "expired")] = OrderedDict(sorted(expired.items(), key=lambda kv: kv[1].seq))
        return kept, released

    def expire(self, current_version: int, max_staleness: int, retryable: bool | None = None) -> int:
        cutoff = current_version - max_staleness
        n = 0
        for task in sorted({t for t, _ in self.queues}):
            kept, released = self._expire_task(task, cutoff, retryable)
            n += len(kept) + len(released)
        return n

    def take(self, task: str, n: int, owner: str, current_version: int | None = None,
             policy: str = "fifo", max_staleness: int | None = None) -> list[tuple[str, tuple[str, ...], int, dict[str, Any]]]:
        ready = self._q(task, "completed")
        cutoff = None if max_staleness is None or current_version is None else current_version - max_staleness
        cands = [g for g in ready.values() if cutoff is None or g.min_version >= cutoff]
        if len(cands) < n:
            return []
        if cutoff is not None:
            self._expire_task(task, cutoff, None)
        if policy == "staleness":
            cands.sort(key=lambda g: (g.min_version, g.seq))
        picked = cands[:n]
        out = []
        for g in picked:
            del ready[g.gid]
            for s in g.sids:
                if self.owner_of.get(s) == "replay":
                    self.owner_of[s] = owner
            out.append((g.gid, g.sids, g.min_version, g.payload))
        return out

    def claim_retry(self, task: str, n: int, owner: str) -> list[str]:
        both = list(self._q(task, "aborted").values()) + list(self._q(task, "expired").values())
        both.sort(key=lambda g: g.seq)
        out = []
        for g in both[:n]:
            del self.queues[(task, g.status)][g.gid]
            for s in g.sids:
                if self.owner_of.get(s) == "replay":
                    self.owner_of[s] = owner
            out.append(g.gid)
        return out

    def count(self, task: str | None = None) -> int:
        return sum(len(q) for (t, _), q in self.queues.items() if task is None or t == task)


def remote_class() -> Any:
    """The Ray actor class (import Ray lazily: the benchmarks import this module without it)."""
    import ray

    return ray.remote(num_cpus=0)(ActorReplayBuffer)
