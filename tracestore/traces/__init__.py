"""Prefix traces of multi-turn sessions: the data plane (DESIGN sections 3 and 4).

A session's trace is a trie of immutable *nodes*. A node's key is the full
rendered text from the start of the conversation to the node's end; its id
is the first 64 bits of ``blake2b-128(key UTF-8)`` (16 hex characters); its
value is the segment between its parent's end and its own end (token ids,
logprobs, a labels flag, the weight version, an optional expert key). Per
session, in the slot ``{R/sid}``:

* ``idx``: id -> ``"num.wid,parent_num,end,ntok,flags,version,expert_key"``
  (``num`` the node's number, given by the write script; ``wid`` the write
  id of the call that stored it; ``end`` in characters of the key), plus
  ``#e`` (the data's epoch) and ``#v`` (``version.chain``: the index
  version, bumped by every write that adds nodes, and the chain of those
  writes' ids: a cached index is current only while epoch, version and
  chain all match, which survives a store that rolls back; docs/traces.md,
  Write ids);
* ``tok``: number -> packed payload (:mod:`tracestore.codec`);
* ``txt``: number -> the segment's text (``StoreConfig.store_text``).

Cost model: the prompt text never goes to Redis. A client keeps the index of
each session it touches and the payloads of nodes it has read or written in
a bounded cache (:mod:`tracestore.nodecache`); nodes are immutable so cached
payloads (keyed by the write that stored them) never go stale, and each read checks the index version on the
server in the same round trip that fetches what the cache lacks. The client
hashes its prompt incrementally at the stored node ends and takes the
longest stored key that prefixes it. Redis CPU and bytes on the wire per turn
are O(new tokens + number of nodes), independent of the context length.

Semantics follow XTuner's trace store (see PRIOR_ART.md): a lookup returns
the longest stored key that prefixes the text and the nodes on its path;
insert hangs a new node under that longest prefix. Unlike XTuner, nodes are
never overwritten (equal rewrite = no-op, else :class:`NodeConflict`) and
reads never create a session.

Flat turns: per session, the client also keeps a *continuation* (the text
of its last recorded turn, the hash states and token ids at its nodes); a
prompt that extends it is checked by comparison and only its new text is
hashed, and the prefix's ids come back as :class:`TokenIds` views of one
growing buffer, so the client's work per turn is O(new text + new tokens)
too.

The package is split by job: :mod:`~tracestore.traces.types` (value types),
:mod:`~tracestore.traces.tokens` (TokenIds),
:mod:`~tracestore.traces.index` (digests, the index trie, cache keys),
:mod:`~tracestore.traces.continuation` (the per-session continuation),
:mod:`~tracestore.traces.reads` (lookup, search, export, trace_keys) and
:mod:`~tracestore.traces.write` (record_turn, insert).
"""

from __future__ import annotations

from .answers import KeptAnswer, keep_answer, read_answer
from .index import node_id
from .partial import KeptExperts, Partial, drop_partial, keep_partial, lookup_partial, read_partial
from .reads import (
    export_many,
    export_node,
    export_training_trace,
    key_digest,
    lookup,
    search,
    trace_keys,
)
from .responses import chain, keep_response, read_responses
from .tokens import TokenIds
from .types import Node, PrefixMatch, Segment, Trace, Turn
from .write import insert, record_turn

__all__ = [
    "KeptAnswer",
    "KeptExperts",
    "Node",
    "Partial",
    "PrefixMatch",
    "Segment",
    "TokenIds",
    "Trace",
    "Turn",
    "chain",
    "export_many",
    "export_node",
    "drop_partial",
    "export_training_trace",
    "insert",
    "keep_answer",
    "keep_partial",
    "keep_response",
    "key_digest",
    "lookup",
    "lookup_partial",
    "node_id",
    "read_answer",
    "read_partial",
    "read_responses",
    "record_turn",
    "search",
    "trace_keys",
]
