"""Baseline: the trace store users run today, a text trie in one Ray actor.

The shape of XTuner's ``RolloutTraceStore`` (PRIOR_ART.md), written from its
description: one actor holds a dict of per-session tries; a key is the full
rendered text from the start of the conversation; a node's value is a
:class:`TokenizedSegment`; insert follows the longest child edge label that
prefixes the remaining key, else adds one child holding the whole remainder
(edges are never split; an existing key is overwritten); search returns the
matched length and the segments on the path; reads create an empty session.

:class:`TextTrieStore` is a plain class (usable in-process, and by other
benchmarks); :func:`remote_class` wraps it in ``ray.remote`` (Ray imported
lazily). :class:`SessionServerClient` calls it the way XTuner's session
server does: search before the request; search again and two inserts (delta
node, response node) after it; export at the end. Not a product: no
durability, no sharing except through the actor, no retry idempotency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenizedSegment:
    """A node's value: the text it adds and its tokens (labels -100, logprobs 0.0 by default)."""

    text: str
    token_ids: list[int]
    labels: list[int] | None = None
    logprobs: list[float] | None = None
    expert_key: Any = None
    version: int = 0

    def __post_init__(self) -> None:
        if self.labels is None:
            self.labels = [-100] * len(self.token_ids)
        if self.logprobs is None:
            self.logprobs = [0.0] * len(self.token_ids)

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class _TrieNode:
    value: TokenizedSegment | None = None
    children: dict[str, _TrieNode] = field(default_factory=dict)


class TextTrieStore:
    """Every session's text trie in one process (the actor's state and methods)."""

    def __init__(self) -> None:
        self._sessions: dict[str, _TrieNode] = {}

    def _root(self, sid: str) -> _TrieNode:
        return self._sessions.setdefault(sid, _TrieNode())  # reads create the session

    @staticmethod
    def _walk(root: _TrieNode, text: str) -> tuple[int, list[_TrieNode]]:
        node, pos, path = root, 0, []
        while True:
            best: tuple[str, _TrieNode] | None = None
            for edge, child in node.children.items():
                if text.startswith(edge, pos) and (best is None or len(edge) > len(best[0])):
                    best = (edge, child)
            if best is None:
                return pos, path
            pos += len(best[0])
            node = best[1]
            path.append(node)

    def search(self, sid: str, text: str) -> tuple[int, list[TokenizedSegment]]:
        """Matched length and the (non-empty) segments on the longest path prefixing ``text``."""
        pos, path = self._walk(self._root(sid), text)
        return pos, [n.value for n in path if n.value is not None]

    def insert(self, sid: str, key: str, segment: TokenizedSegment) -> None:
        """Store ``segment`` at ``key`` (overwrites an existing key, as XTuner does)."""
        root = self._root(sid)
        pos, path = self._walk(root, key)
        node = path[-1] if path else root
        if pos == len(key):
            node.value = segment
        else:
            node.children[key[pos:]] = _TrieNode(segment)

    def insert_many(self, items: list[tuple[str, str, TokenizedSegment]]) -> int:
        """Bulk setup for other benchmarks: ``(sid, key, segment)`` each."""
        for sid, key, seg in items:
            self.insert(sid, key, seg)
        return len(items)

    def export_training_trace(self, sid: str, prompt_text: str) -> dict[str, Any]:
        """``input_ids``, ``labels``, ``logprobs``, ``versions`` and ``expert_keys`` of an exact key."""
        pos, segs = self.search(sid, prompt_text)
        if pos != len(prompt_text):
            raise KeyError(
                f"session {sid!r}: prompt matches only {pos} of {len(prompt_text)} chars"
            )
        out: dict[str, Any] = {"input_ids": [], "labels": [], "logprobs": [], "versions": []}
        for s in segs:
            out["input_ids"].extend(s.token_ids)
            out["labels"].extend(s.labels or [])
            out["logprobs"].extend(s.logprobs or [])
            out["versions"].extend([s.version] * s.length)
        keys = [s.expert_key for s in segs]
        if all(k is None for k in keys):
            out["expert_keys"] = None
        elif any(k is None for k in keys):
            raise ValueError(f"session {sid!r}: some nodes have routed experts, others not")
        else:
            out["expert_keys"] = keys
        return out

    def release_sessions(self, sids: list[str]) -> int:
        """Drop the tries of ``sids``; returns how many existed."""
        return sum(self._sessions.pop(s, None) is not None for s in sids)

    def session_count(self) -> int:
        return len(self._sessions)


def remote_class() -> Any:
    """The Ray actor class (Ray imported lazily: this module imports without it)."""
    import ray

    return ray.remote(num_cpus=0)(TextTrieStore)


class SessionServerClient:
    """Calls a :class:`TextTrieStore` (actor handle or plain instance) like XTuner's session server."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._remote = hasattr(store.search, "remote")
        if self._remote:
            import ray

            self._get = ray.get

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self._store, name)
        return self._get(fn.remote(*args)) if self._remote else fn(*args)

    def before_request(self, sid: str, prompt: str) -> tuple[int, list[int]]:
        """Search the longest stored prefix: (matched chars, its token ids)."""
        pos, segs = self._call("search", sid, prompt)
        return pos, [t for s in segs for t in s.token_ids]

    def after_response(
        self,
        sid: str,
        prompt: str,
        response: str,
        delta_ids: list[int],
        out_ids: list[int],
        logprobs: list[float],
        version: int,
    ) -> None:
        """Search again, then insert the delta node (key = prompt) and the response node."""
        pos, _ = self._call("search", sid, prompt)
        delta = TokenizedSegment(prompt[pos:], delta_ids, version=version)
        resp = TokenizedSegment(response, out_ids, list(out_ids), logprobs, version=version)
        if self._remote:
            refs = []
            if delta_ids:
                refs.append(self._store.insert.remote(sid, prompt, delta))
            refs.append(self._store.insert.remote(sid, prompt + response, resp))
            self._get(refs)
        else:
            if delta_ids:
                self._store.insert(sid, prompt, delta)
            self._store.insert(sid, prompt + response, resp)

    def export(self, sid: str, key: str) -> dict[str, Any]:
        return self._call("export_training_trace", sid, key)  # type: ignore[no-any-return]

    def release(self, sids: list[str]) -> int:
        return self._call("release_sessions", sids)  # type: ignore[no-any-return]
