"""Baseline: session traces and ownership in one Ray actor's Python memory.

The shape of XTuner's ``RolloutTraceStore`` (PRIOR_ART.md): one actor holds
every session's trace nodes in dicts; ``release_sessions`` deletes what it
is given. Written with the same release-if-owned semantics as tracestore
(one event per released session, owned sessions only), so the comparison is
about where the state lives, not about doing less work. Not a product: no
durability, no sharing except through the actor, no retry idempotency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Node:
    parent: str
    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclass
class ActorTraceStore:
    """The actor's state and operations (wrapped in ``ray.remote`` by :func:`remote_class`)."""

    owner_of: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, dict[str, _Node]] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    #: Seconds spent inside the last ``release_sessions`` call (the actor's "server time").
    last_call_s: float = 0.0

    def open_sessions(self, sids: list[str], owner: str) -> int:
        for s in sids:
            if s in self.owner_of:
                raise ValueError(f"session {s} exists")
            self.owner_of[s] = owner
            self.nodes[s] = {}
        return len(sids)

    def record_turns(self, turns: list[tuple[str, str, str, list[int], list[float]]]) -> int:
        """Bulk setup: ``(sid, node_id, parent_id, token_ids, logprobs)`` per node."""
        for sid, nid, parent, ids, lps in turns:
            self.nodes[sid][nid] = _Node(parent, ids, lps, f"text of {nid}")
        return len(turns)

    def release_sessions(self, sids: list[str], owner: str, reason: str = "released") -> list[str]:
        """Release-if-owned, one event each, and delete the released sessions' traces."""
        t0 = time.perf_counter()
        out = []
        for s in sids:
            if self.owner_of.get(s) == owner:
                self.owner_of[s] = "#released"
                self.nodes.pop(s, None)
                self.events.append((s, owner, reason))
                out.append(s)
        self.last_call_s = time.perf_counter() - t0
        return out

    def sessions(self, owner: str) -> list[str]:
        return [s for s, o in self.owner_of.items() if o == owner]

    def release_owner(self, owner: str, reason: str = "released") -> list[str]:
        return self.release_sessions(self.sessions(owner), owner, reason)

    def last_call(self) -> float:
        return self.last_call_s


def remote_class() -> Any:
    """``ray.remote(ActorTraceStore)`` (imported lazily: the module itself needs no Ray)."""
    import ray

    return ray.remote(ActorTraceStore)
