"""Model-based test of the trace data plane against a pure-Python reference trie.

A hypothesis state machine drives random multi-turn, branching sessions
(retried turns, prompts and responses that are prefixes of earlier keys,
empty deltas, unicode text, low-level inserts, two clients with different
cache sizes) and checks every lookup, search, write outcome and export
against :class:`RefTrie`.

RefTrie has XTuner's trace-store semantics (PRIOR_ART.md): a node's key is
the full text from the start; its value is the segment after its parent;
edges are never split; search returns the longest stored key that prefixes
the text with the nodes on its path; insert hangs the new node under the
longest stored proper prefix of its key (XTuner's greedy walk finds exactly
that node when every write is an insert). ``record_turn`` attaches the delta
node under the looked-up prefix and the response under the delta, as
XTuner's session server intends. Differences that are tracestore's contract
rather than XTuner's: an existing key is never overwritten (equal rewrite =
no-op, else NodeConflict) and reads never create a session.

Two hypothesis profiles (``TRACESTORE_MODEL_PROFILE``):

* ``ci`` (default, what ``make test`` runs): derandomized, so every run explores
  the same 100 programs and the test passes or fails the same way each time; a
  failure prints the failing program as found (not shrunk);
* ``ci-shrink``: the same programs, and a failure shrunk to a minimal program
  (minutes against real servers: run it with ``--timeout=0``);
* ``long`` (``make test-model-long``): a random seed and 3,000 programs of up to
  50 steps, for hunting; a failure is shrunk and printed with a
  ``@reproduce_failure`` blob, and ``PYTEST_ARGS=--hypothesis-seed=N`` replays a seed.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.conftest import _selected
from tracestore import InvalidInput, NodeConflict, PromptMismatch, Segment, TraceStore
from tracestore.nodecache import node_cache
from tracestore.traces import node_id

IGNORE = -100
SID = "model"


def f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


@dataclass
class Value:
    """A node's segment, in the resolved form the store exports."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    labels: tuple[int, ...]
    version: int
    expert_key: str | None


@dataclass
class RefNode:
    key: str
    parent: RefNode | None
    value: Value | None  # None only at the root
    children: dict[str, RefNode] = field(default_factory=dict)


class RefTrie:
    """One session's trie (see the module docstring for the semantics)."""

    def __init__(self) -> None:
        self.root = RefNode("", None, None)
        self.by_key: dict[str, RefNode] = {}

    def longest(self, text: str, *, proper: bool = False) -> RefNode:
        """Deepest node whose key prefixes ``text`` (the root when none does)."""
        best = self.root
        stack = [self.root]
        while stack:
            node = stack.pop()
            if len(node.key) > len(best.key) and not (proper and node.key == text):
                best = node
            for edge, child in node.children.items():
                if text.startswith(edge, len(node.key)):
                    stack.append(child)
        return best

    def path(self, node: RefNode) -> list[RefNode]:
        out = []
        cur: RefNode | None = node
        while cur is not None and cur.value is not None:
            out.append(cur)
            cur = cur.parent
        return out[::-1]

    def ids_of(self, node: RefNode) -> list[int]:
        return [t for n in self.path(node) for t in n.value.ids]  # type: ignore[union-attr]

    def check(self, key: str, parent: RefNode, value: Value) -> bool:
        """True when ``key`` is new; False when equal; raise NodeConflict when different."""
        old = self.by_key.get(key)
        if old is None:
            return True
        if old.parent is not parent or old.value != value:
            raise NodeConflict("ref", node_id(key))
        return False

    def attach(self, key: str, parent: RefNode, value: Value) -> RefNode:
        node = RefNode(key, parent, value)
        parent.children[key[len(parent.key) :]] = node
        self.by_key[key] = node
        return node

    def insert(self, key: str, value: Value) -> RefNode:
        old = self.by_key.get(key)
        parent = old.parent if old is not None else self.longest(key, proper=True)
        assert parent is not None
        if self.check(key, parent, value):
            return self.attach(key, parent, value)
        return self.by_key[key]


def _mixes(parent: RefNode, first: str | None, last: str | None) -> bool:
    """True when new nodes with these expert keys under ``parent`` would mix keyed and unkeyed nodes."""
    if (first is None) != (last is None):
        return True
    return parent.value is not None and (parent.value.expert_key is None) != (last is None)


# -- strategies --------------------------------------------------------------------------------

ALPHABET = "ab<|>\n é✓😀"
texts = st.text(alphabet=ALPHABET, min_size=1, max_size=6)
ids_st = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4)
logprob_st = st.one_of(st.floats(-20.0, 0.0, allow_nan=False), st.just(-math.inf), st.just(0.0))
versions = st.integers(0, 3)


def _reset(clients: list[TraceStore], sid: str) -> None:
    """Delete the session's data keys (tombstone included) and empty every client's cache."""
    k = clients[0].keys
    clients[0].redis.delete(*k.data_keys(sid), k.dead(sid))
    for c in clients:
        node_cache(c.context).clear()


def make_machine(clients: list[TraceStore]) -> type[RuleBasedStateMachine]:
    class TraceModel(RuleBasedStateMachine):
        @initialize(experts=st.sampled_from(["none", "all", "mixed"]))
        def start(self, experts: str) -> None:
            # Every example, and every replay of one while hypothesis shrinks a failure,
            # starts from the same state: one session id, no data, empty client caches.
            # (Fresh ids per example left the caches' LRU order to earlier examples, so a
            # failure did not replay: FlakyStrategyDefinition, and no minimal example.)
            _reset(clients, SID)
            self.sid = SID
            self.ref = RefTrie()
            self.experts = experts
            self.prompts: list[str] = []  # keys written as delta (prompt) nodes, or seen prompts
            self.old_keys: list[str] = []  # keys of incarnations purged by purge_and_reopen
            self.last_key = ""  # the response key of the last recorded turn

        # -- helpers ----------------------------------------------------------------------------

        def _keys(self) -> list[str]:
            return list(self.ref.by_key)

        def _text(self, data: Any) -> str:
            """A text built from stored keys (or keys of before a purge): a key, a prefix of
            one, or one plus new text."""
            keys = self._keys() + self.old_keys
            if not keys or data.draw(st.integers(0, 5), label="fresh") == 0:
                return data.draw(texts, label="fresh text")
            base = data.draw(st.sampled_from(keys), label="base key")
            how = data.draw(st.sampled_from(["key", "prefix", "extend"]), label="how")
            if how == "key":
                return base
            if how == "prefix":
                return base[: data.draw(st.integers(1, len(base)), label="cut")]
            return base + data.draw(texts, label="ext")

        def _ekey(self, data: Any, name: str) -> str | None:
            if self.experts == "none":
                return None
            if self.experts == "mixed" and data.draw(st.booleans(), label=f"{name} none"):
                return None
            return f"{name}:{data.draw(st.integers(0, 2), label=name)}"

        def _client(self, data: Any) -> TraceStore:
            return clients[data.draw(st.integers(0, len(clients) - 1), label="client")]

        def _check_match(self, got: Any, text: str) -> RefNode:
            want = self.ref.longest(text)
            assert got.text_len == len(want.key), (text, got.text_len, want.key)
            assert got.token_ids == self.ref.ids_of(want)
            assert [n.id for n in got.path] == [node_id(n.key) for n in self.ref.path(want)]
            return want

        # -- rules ------------------------------------------------------------------------------

        @rule(data=st.data())
        def turn(self, data: Any) -> None:
            """lookup -> engine -> record_turn, as a session server does."""
            st_ = self._client(data)
            if self.prompts and data.draw(st.integers(0, 3), label="retry?") == 0:
                prompt = data.draw(st.sampled_from(self.prompts), label="retried prompt")
            else:
                prompt = self._text(data) + data.draw(
                    st.one_of(st.just(""), texts), label="user turn"
                )
            if data.draw(st.integers(0, 3), label="prefix response?") == 0:
                longer = [k for k in self._keys() if k.startswith(prompt) and k != prompt]
                if longer:  # a response that is a prefix (or extension) of an earlier one
                    k = data.draw(st.sampled_from(longer), label="earlier key")
                    cut = data.draw(st.integers(len(prompt) + 1, len(k)), label="cut")
                    response = k[len(prompt) : cut]
                else:
                    response = data.draw(texts, label="response")
            else:
                response = data.draw(texts, label="response")
            m = st_.lookup(self.sid, prompt)
            parent = self._check_match(m, prompt)
            adds_text = m.text_len < len(prompt)
            delta = (
                data.draw(st.lists(st.integers(0, 1000), max_size=3), label="delta")
                if adds_text
                else []
            )
            r_ids = data.draw(ids_st, label="response ids")
            lps = data.draw(st.lists(logprob_st, min_size=len(r_ids), max_size=len(r_ids)))
            version = data.draw(versions, label="version")
            dkey = self._ekey(data, "d") if delta else None
            rkey = self._ekey(data, "r")
            call = {
                "prefix": m,
                "delta_token_ids": delta,
                "response_token_ids": r_ids,
                "response_logprobs": lps,
                "version": version,
                "delta_expert_key": dkey,
                "response_expert_key": rkey,
            }
            if _mixes(parent, dkey if delta else rkey, rkey):
                # a turn that would make the path unexportable is refused, nothing written
                with pytest.raises(InvalidInput) as bad:
                    st_.record_turn(self.sid, prompt, response, **call)
                assert bad.value.field in ("delta_expert_key", "response_expert_key")
                event("turn: expert key mix refused")
                return
            # the reference outcome, decided before the store call and applied after it
            plan: list[tuple[str, Value]] = []
            want_err: NodeConflict | None = None
            try:
                pending: RefNode | None = None
                if delta:
                    dval = Value(
                        tuple(delta), (0.0,) * len(delta), (IGNORE,) * len(delta), version, dkey
                    )
                    if self.ref.check(prompt, parent, dval):
                        plan.append((prompt, dval))
                        pending = RefNode(prompt, parent, dval)  # not attached yet
                    else:
                        parent = self.ref.by_key[prompt]
                rval = Value(tuple(r_ids), tuple(f32(x) for x in lps), tuple(r_ids), version, rkey)
                if self.ref.check(prompt + response, pending or parent, rval):
                    plan.append((prompt + response, rval))
            except NodeConflict as exc:
                want_err = exc
            try:
                t = st_.record_turn(self.sid, prompt, response, **call)
            except NodeConflict as exc:
                assert want_err is not None, f"unexpected {exc}"
                assert exc.digest == want_err.digest
                event("turn: NodeConflict")
                return
            assert want_err is None, f"expected {want_err}"
            event(f"turn: wrote {len(plan)} node(s), delta={'yes' if delta else 'empty'}")
            for key, val in plan:  # the delta first: the response hangs under it
                under = self.ref.by_key[prompt] if key != prompt and delta else parent
                self.ref.attach(key, under, val)
            assert t.written == len(plan)
            self.last_key = prompt + response
            if data.draw(st.integers(0, 4), label="replay the call?") == 0:
                # a client retry after a lost reply: equal nodes, nothing written
                again = self._client(data).record_turn(self.sid, prompt, response, **call)
                assert (again.written, again.response) == (0, t.response)
                event("turn: replayed call wrote 0")
            if prompt in self.ref.by_key and prompt not in self.prompts:
                self.prompts.append(prompt)

        @rule(data=st.data())
        def insert(self, data: Any) -> None:
            """Low-level XTuner-style insert."""
            key = self._text(data)
            ids = data.draw(ids_st, label="ids")
            lps = data.draw(st.lists(logprob_st, min_size=len(ids), max_size=len(ids)))
            lab_kind = data.draw(st.sampled_from(["none", "ids", "ignore", "mixed"]))
            labels: list[int] | None = {
                "none": None,
                "ids": list(ids),
                "ignore": [IGNORE] * len(ids),
                "mixed": [IGNORE] + list(ids[1:]),
            }[lab_kind]
            version = data.draw(versions, label="version")
            ekey = self._ekey(data, "i")
            val = Value(
                tuple(ids),
                tuple(f32(x) for x in lps),
                tuple(labels) if labels is not None else (IGNORE,) * len(ids),
                version,
                ekey,
            )
            if key not in self.ref.by_key and _mixes(self.ref.longest(key, proper=True), ekey, ekey):
                with pytest.raises(InvalidInput) as bad:
                    self._client(data).insert(self.sid, key, Segment(ids, lps, labels, version, ekey))
                assert bad.value.field == "segment.expert_key"
                event("insert: expert key mix refused")
                return
            try:
                want = self.ref.insert(key, val)
                want_err = None
            except NodeConflict as exc:
                want_err = exc
            try:
                got = self._client(data).insert(
                    self.sid, key, Segment(ids, lps, labels, version, ekey)
                )
            except NodeConflict as exc:
                assert want_err is not None, f"unexpected {exc}"
                assert exc.digest == want_err.digest
                event("insert: NodeConflict")
                return
            assert want_err is None, f"expected {want_err}"
            event(f"insert: under {'root' if want.parent is self.ref.root else 'a node'}")
            assert got.id == node_id(key)
            assert got.parent == (node_id(want.parent.key) if want.parent.value else None)  # type: ignore[union-attr]

        @rule(data=st.data())
        def lookup(self, data: Any) -> None:
            text = self._text(data)
            self._check_match(self._client(data).lookup(self.sid, text), text)

        @rule(data=st.data())
        def search(self, data: Any) -> None:
            text = self._text(data)
            got = self._client(data).search(self.sid, text)
            want = self._check_match(got, text)
            path = self.ref.path(want)
            assert len(got.segments) == len(path)
            start = 0
            for seg, n in zip(got.segments, path, strict=True):
                v = n.value
                assert v is not None
                assert list(seg.token_ids) == list(v.ids)
                assert list(seg.labels or []) == list(v.labels)
                assert list(seg.logprobs or []) == list(v.logprobs)
                assert (seg.version, seg.expert_key) == (v.version, v.expert_key)
                assert seg.text == n.key[start:]
                start = len(n.key)

        @precondition(lambda self: bool(self.ref.by_key))
        @rule(data=st.data())
        def export_stored_key(self, data: Any) -> None:
            key = data.draw(st.sampled_from(self._keys()), label="key")
            self._check_export(self._client(data), key)

        @rule(data=st.data())
        def export_any_text(self, data: Any) -> None:
            self._check_export(self._client(data), self._text(data))

        def _check_export(self, client: TraceStore, key: str) -> None:
            node = self.ref.by_key.get(key)
            if node is None:
                with pytest.raises(PromptMismatch) as ei:
                    client.export_training_trace(self.sid, key)
                assert ei.value.matched_len == len(self.ref.longest(key).key)
                assert ei.value.prompt_len == len(key)
                event("export: PromptMismatch")
                return
            path = self.ref.path(node)
            keys = [n.value.expert_key for n in path]  # type: ignore[union-attr]
            if any(k is None for k in keys) and not all(k is None for k in keys):
                with pytest.raises(InvalidInput) as ei2:
                    client.export_training_trace(self.sid, key)
                assert ei2.value.field == "expert_keys"
                event("export: expert key mix")
                return
            event(f"export: {len(path)} node(s)")
            tr = client.export_training_trace(self.sid, key)
            vals = [n.value for n in path]
            assert tr.input_ids == [t for v in vals for t in v.ids]  # type: ignore[union-attr]
            assert tr.labels == [t for v in vals for t in v.labels]  # type: ignore[union-attr]
            assert tr.logprobs == [t for v in vals for t in v.logprobs]  # type: ignore[union-attr]
            assert tr.versions == [v.version for v in vals for _ in v.ids]  # type: ignore[union-attr]
            assert tr.expert_keys == (None if keys[0] is None else keys)
            assert [n.id for n in tr.nodes] == [node_id(n.key) for n in path]

        @precondition(lambda self: bool(self.ref.by_key))
        @rule(data=st.data())
        def purge_and_reopen(self, data: Any) -> None:
            """The session's data is purged and the id used again: a new incarnation.

            Every client may still hold a cached index and a continuation of the
            old one. The new incarnation may start with the path of the last
            turn again, the same keys and node shapes with other token ids (what
            a client's continuation would match), and later turns reuse the old
            texts: no client may ever see an old node or id.
            """
            if data.draw(st.integers(0, 3), label="purge?") != 0:
                return
            c = self._client(data)
            c.drop_session_data(self.sid)
            c.redis.delete(c.keys.dead(self.sid))
            old = self.ref
            self.old_keys = list(dict.fromkeys(self.old_keys + self._keys()))
            self.ref = RefTrie()
            self.prompts = []
            event("purged and reopened")
            last = old.by_key.get(self.last_key)
            if last is None or not data.draw(st.booleans(), label="rewrite the last path?"):
                return
            for n in old.path(last):
                v = n.value
                assert v is not None
                ids = tuple((x + 1) % 2**31 for x in v.ids)
                labels = tuple(x if x == IGNORE else (x + 1) % 2**31 for x in v.labels)
                val = Value(ids, v.logprobs, labels, v.version, v.expert_key)
                self.ref.insert(n.key, val)
                self._client(data).insert(
                    self.sid, n.key, Segment(list(ids), list(v.logprobs), list(labels), v.version, v.expert_key)
                )
            event("reopened with the last path, other ids")
            for client in clients:  # whoever recorded that turn holds a continuation of it
                text = self.last_key + data.draw(st.one_of(st.just(""), texts), label="ext")
                self._check_match(client.lookup(self.sid, text), text)

        @invariant()
        def node_count(self) -> None:
            if not hasattr(self, "sid"):
                return
            n = clients[0].redis.hlen(clients[0].keys.idx(self.sid))
            assert n == (len(self.ref.by_key) + 2 if self.ref.by_key else 0)  # + #e, #v

        def teardown(self) -> None:
            if hasattr(self, "sid"):
                cold = clients[-1]
                for key in self._keys():
                    self._check_export(cold, key)
                _reset(clients, self.sid)

    return TraceModel


_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    "database": None,
}
_CI: dict[str, Any] = {"max_examples": 100, "stateful_step_count": 30, "derandomize": True}
PROFILES = {
    # No shrinking in make test: against real servers it takes minutes and would meet the
    # per-test timeout; the failing program is printed as found, first bug only.
    "ci": settings(
        **_CI,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        report_multiple_bugs=False,
        **_COMMON,
    ),
    # The same programs as ci, shrunk to a minimal failing one (run with --timeout=0).
    "ci-shrink": settings(**_CI, **_COMMON),
    "long": settings(
        max_examples=3000, stateful_step_count=50, derandomize=False, print_blob=True, **_COMMON
    ),
}


def _profile() -> settings:
    name = os.environ.get("TRACESTORE_MODEL_PROFILE", "ci")
    if name not in PROFILES:
        raise pytest.UsageError(f"TRACESTORE_MODEL_PROFILE={name!r}: choose from {sorted(PROFILES)}")
    return PROFILES[name]


# Standalone and cluster only (one node and slot routing); on redis7 and the container,
# both single-node Redis 7, the data plane's scripts run in test_traces.py.
@pytest.mark.parametrize("backend", [b for b in _selected() if b in ("valkey", "cluster")])
def test_traces_match_the_reference_trie(url: str, run_id: str, backend: str) -> None:
    clients = [
        TraceStore.connect(url, run=run_id),
        TraceStore.connect(url, run=run_id, cache_bytes=2048, store_text=True),
        TraceStore.connect(url, run=run_id, cache_bytes=0),
    ]
    try:
        machine = make_machine(clients)
        run_state_machine_as_test(machine, settings=_profile())
    finally:
        for c in clients:
            c.close()
