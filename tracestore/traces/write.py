"""Writing traces: record_turn and insert (DESIGN section 4).

``record_turn`` reads as its four steps: validate the turn (before any I/O),
build its nodes (one pass of hashing), one ``record_turn`` script call, then
keep the client's cached index current. Nodes are immutable: an equal
rewrite is a no-op and a different one raises NodeConflict, so both writes
are safe to retry.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

from .. import codec, validate
from ..context import Context, mutating
from ..errors import InvalidInput, ScriptError
from ..nodecache import node_cache
from ..replies import Reply
from ..scripts import Eval, Op, script
from ..validate import validate_id
from .answers import KeptAnswer
from .continuation import Checkpoint, Continuation, cont_key
from .index import SessionIndex, cache_payload, hasher, hex_id, idx_key, node_id, utf8
from .reads import WINDOW, read_path
from .tokens import TokenIds
from .types import HashedPrefix, Node, PrefixMatch, Segment, Turn

#: Longest expert key (characters); keys go into the one-line index record.
MAX_EXPERT_KEY = 512
#: Attempts of an insert while other writers keep changing the index.
INSERT_ATTEMPTS = 64


class _NewNode(NamedTuple):
    """A node to write: its index record, packed payload and segment text.

    ``parent_wid``: the write id the parent was read with ('' for a node
    written before write ids), when the parent is a stored node: the script
    refuses the write if it is stored with another one now (the store rolled
    back, or the session was purged and reopened, and the tokens read under
    it are gone). None when the parent is written by the same call.
    """

    node: Node
    payload: bytes
    text: str
    parent_wid: str | None = None

    def args(self, store_text: bool) -> tuple[Any, ...]:
        """The node's script arguments: id, parent id[.wid], fields, payload, text (lua/_lib/nodes.lua)."""
        n = self.node
        parent = n.parent or ""
        if n.parent and self.parent_wid is not None:
            parent = f"{n.parent}.{self.parent_wid}"
        return (n.id, parent, n.fields(), self.payload, self.text if store_text else "")

    def stored(self, wid: str) -> _NewNode:
        """This node as stored by write ``wid``."""
        n = self.node
        node = Node(n.id, n.parent, n.end, n.ntok, n.flags, n.version, n.expert_key, wid)
        return _NewNode(node, self.payload, self.text, self.parent_wid)


def new_wid() -> str:
    """A fresh write id: 8 random hex characters (lua/_lib/nodes.lua, Write ids)."""
    return os.urandom(4).hex()


# -- validation (before any I/O) -------------------------------------------------------------


def _expert_key(field_name: str, v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_EXPERT_KEY or any(c in v for c in "\r\n"):
        raise InvalidInput(
            field_name,
            f"expert key must be a non-empty one-line str of at most {MAX_EXPERT_KEY} chars",
        )
    utf8(field_name, v)
    return v


#: Why a turn's expert keys must agree with each other and with the stored path.
_ALL_OR_NONE = (
    "every node on a session's path carries an expert key or none does "
    "(export_training_trace refuses a mix, and stored nodes cannot change)"
)


def _check_expert_keys(
    parent: Node | None, first: str | None, last: str | None, field_name: str = "response_expert_key"
) -> None:
    """Refuse new nodes whose expert keys would make the path unexportable (a mix of keyed and unkeyed).

    ``first``/``last``: the expert keys of the first and last new node (the
    delta and the response of a turn, or one node twice); ``parent``: the
    stored node they hang under (its path is all-or-none already);
    ``field_name`` names the last node's key in the error.
    """
    if (first is None) != (last is None):
        missing = "delta_expert_key" if first is None else "response_expert_key"
        raise InvalidInput(missing, f"missing while the other node of the turn has one; {_ALL_OR_NONE}")
    if parent is not None and (parent.expert_key is None) != (last is None):
        has = "has" if parent.expert_key is not None else "has no"
        raise InvalidInput(
            field_name,
            f"{'missing' if last is None else 'given'} but the stored prefix node {parent.id} {has} "
            f"expert key; {_ALL_OR_NONE}",
        )


def _check_size(ctx: Context, field_name: str, payload: bytes) -> None:
    if len(payload) > ctx.config.max_payload_bytes:
        raise InvalidInput(
            field_name,
            f"node payload of {len(payload)} bytes exceeds max_payload_bytes={ctx.config.max_payload_bytes}",
        )


class _CheckedTurn(NamedTuple):
    """A validated turn, and the hash state at the end of its matched prefix.

    (Named tuples, this and the other records of one turn: immutable like frozen
    dataclasses, built without a ``object.__setattr__`` call per field.)
    """

    sid: str
    prompt_text: str
    response_text: str
    start: int  # chars of the prompt covered by the prefix node
    parent: Node | None  # the prefix node
    prefix_hash: Any  # blake2b state after prompt_text[:start] (a copy: ours to update)
    hashed: HashedPrefix | None  # what lookup knew at the prefix (its ids extend the continuation)
    rest: memoryview  # UTF-8 of prompt_text[start:]
    response: bytes  # UTF-8 of response_text
    version: int
    delta_ids: array  # type: ignore[type-arg]
    response_ids: array  # type: ignore[type-arg]
    response_logprobs: array  # type: ignore[type-arg]
    delta_key: str | None
    response_key: str | None
    fork_flags: int = 0
    response_versions: array | None = None  # type: ignore[type-arg]  # per token, when they differ


def _check_turn(
    sid: str, prompt_text: str, response_text: str, prefix: PrefixMatch, v: int,
    ids: tuple[Sequence[int], Sequence[int], Sequence[float]], keys: tuple[str | None, str | None],
    fork_flags: int = 0,
    response_versions: Sequence[int] | None = None,
) -> _CheckedTurn:
    """Every check of :func:`record_turn`; each text is encoded once, the prefix hashed once.

    ``ids``: delta token ids, response token ids, response logprobs;
    ``keys``: delta and response expert keys.
    """
    delta_token_ids, response_token_ids, response_logprobs = ids
    delta_expert_key, response_expert_key = keys
    validate_id("session id", sid)
    if not isinstance(prefix, PrefixMatch):
        raise InvalidInput("prefix", "expected the PrefixMatch returned by lookup()")
    # When lookup() hashed exactly the matched prefix of this prompt, its state
    # is continued and only the rest of the prompt is encoded (the prefix was
    # checked as UTF-8 by that lookup).
    hashed = prefix._hashed
    if not (isinstance(hashed, HashedPrefix) and hashed.continues(prefix.text_len, prompt_text)):
        hashed = None
    p_bytes = utf8("prompt_text", prompt_text[hashed.end :] if hashed else prompt_text)
    r_bytes = utf8("response_text", response_text)
    if not response_text:
        raise InvalidInput(
            "response_text", "must be non-empty (the response node's key must extend the prompt)"
        )
    validate.version("version", v)
    dkey = _expert_key("delta_expert_key", delta_expert_key)
    rkey = _expert_key("response_expert_key", response_expert_key)
    d_ids = codec.int32_array("delta_token_ids", delta_token_ids, non_negative=True)
    r_ids = codec.int32_array("response_token_ids", response_token_ids, non_negative=True)
    r_lps = codec.float32_logprobs("response_logprobs", response_logprobs)
    if len(r_lps) != len(r_ids):
        raise InvalidInput(
            "response_logprobs", f"{len(r_lps)} logprobs for {len(r_ids)} response token ids"
        )
    r_versions = None
    if response_versions is not None:
        r_versions = array("i", (validate.version("response_versions", x) for x in response_versions))
        if len(r_versions) != len(r_ids):
            raise InvalidInput(
                "response_versions", f"{len(r_versions)} versions for {len(r_ids)} response token ids"
            )
        if max(r_versions, default=v) > v:
            raise InvalidInput("response_versions", f"a token's version is newer than the turn's version {v}")
        if all(x == v for x in r_versions):
            r_versions = None  # one version: the node's
    start = prefix.text_len
    if not isinstance(start, int) or not 0 <= start <= len(prompt_text):
        raise InvalidInput(
            "prefix", f"text_len {start!r} is outside the prompt (0..{len(prompt_text)})"
        )
    if (prefix.node is None) != (start == 0) or (
        prefix.node is not None and prefix.node.end != start
    ):
        raise InvalidInput("prefix", "node and text_len disagree")
    if dkey is not None and not d_ids:
        raise InvalidInput("delta_expert_key", "given for an empty delta")
    _check_expert_keys(prefix.node, dkey if d_ids else rkey, rkey)
    if d_ids and start == len(prompt_text):
        raise InvalidInput(
            "delta_token_ids", "non-empty, but the prompt adds no text after the prefix"
        )
    if hashed is not None:
        h = hashed.state.copy()  # (copied: the match may be passed again, on a retry)
        rest = memoryview(p_bytes)  # prompt_text[start:]
    else:
        h = hasher()
        head = prompt_text[:start].encode()
        h.update(head)
        rest = memoryview(p_bytes)[len(head) :]
    if prefix.node is not None and hex_id(h) != prefix.node.id:
        raise InvalidInput(
            "prefix",
            "the matched prefix is not a prefix of prompt_text (lookup a different prompt?)",
        )
    return _CheckedTurn(
        sid, prompt_text, response_text, start, prefix.node, h, hashed, rest,
        r_bytes, v, d_ids, r_ids, r_lps, dkey, rkey, fork_flags, r_versions,
    )


# -- building nodes ----------------------------------------------------------------------------


class _TurnNodes(NamedTuple):
    """A turn's new nodes and the hash states at the response's parent end and at its end."""

    delta: _NewNode | None
    response: _NewNode
    parent_state: Any  # after the key of the response's parent (None: no parent)
    response_state: Any


def _turn_nodes(ctx: Context, t: _CheckedTurn) -> _TurnNodes:
    """The delta node (None for an empty delta) and the response node; one pass of hashing."""
    h = t.prefix_hash
    at_prefix = h.copy() if not t.delta_ids and t.parent is not None else None
    h.update(t.rest)
    prompt_id = hex_id(h)
    at_prompt = h.copy() if t.delta_ids else None
    h.update(t.response)
    response_id = hex_id(h)
    parent, start, prompt = t.parent.id if t.parent else None, t.start, t.prompt_text
    parent_wid: str | None = t.parent.wid if t.parent else None
    delta: _NewNode | None = None
    if t.delta_ids:
        d_lps = array("f", bytes(4 * len(t.delta_ids)))
        payload = codec.pack(t.delta_ids, d_lps, None, 0)
        _check_size(ctx, "delta_token_ids", payload)
        node = Node(prompt_id, parent, len(prompt), len(t.delta_ids), t.fork_flags, t.version, t.delta_key)
        delta = _NewNode(node, payload, prompt[start:], parent_wid)
        parent, start, parent_wid = prompt_id, len(prompt), None
    flags = codec.GENERATED | (0 if t.delta_ids else t.fork_flags)
    version = t.version
    if t.response_versions is not None:
        flags |= codec.VERSIONS
        version = min(t.response_versions)  # the node's version is its oldest token's (staleness)
    r_payload = codec.pack(t.response_ids, t.response_logprobs, None, flags, t.response_versions)
    _check_size(ctx, "response_token_ids", r_payload)
    end = len(prompt) + len(t.response_text)
    node = Node(response_id, parent, end, len(t.response_ids), flags, version, t.response_key)
    response = _NewNode(node, r_payload, prompt[start:] + t.response_text, parent_wid)
    return _TurnNodes(delta, response, at_prompt if t.delta_ids else at_prefix, h)


# -- the client's cache after a write --------------------------------------------------------


def _after_write(
    ctx: Context, sid: str, epoch: str, versions: tuple[int, int], chains: tuple[str, str],
    new: Sequence[_NewNode], nums: Sequence[int],
) -> None:
    """Keep the cached index current after our own write, or drop it if others wrote too.

    ``versions``/``chains``: the index's version and chain of write ids before and after
    the call; ``new``: the nodes as stored (with their write ids); ``nums``:
    the node numbers the script gave (or found) for them.
    """
    (before, after), (chain_before, chain_after) = versions, chains
    cache = node_cache(ctx)
    snap: SessionIndex | None = cache.get(idx_key(sid))
    pairs = [(x.node, n) for x, n in zip(new, nums, strict=True)]
    if snap is not None and snap.epoch == epoch and snap.version == before and snap.chain == chain_before:
        snap = snap.with_nodes(epoch, after, pairs, chain_after)
        cache.put(idx_key(sid), snap, snap.nbytes)
    elif before == 0 and after > 0:  # we wrote the first nodes: we know the whole index
        snap = SessionIndex(epoch, 0, {}, {}, ctx.keys.idx(sid)).with_nodes(epoch, after, pairs, chain_after)
        cache.put(idx_key(sid), snap, snap.nbytes)
    elif snap is not None and (snap.epoch != epoch or snap.version != after or snap.chain != chain_after):
        cache.discard(idx_key(sid))
    for x in new:
        cache_payload(cache, sid, epoch, x.node, x.payload)


def _continue(ctx: Context, t: _CheckedTurn, nodes: _TurnNodes, epoch: str) -> None:
    """Keep this turn as the session's continuation (what the next lookup extends).

    Only with token ids this client read itself in this epoch (lookup's, on
    the match), so the continuation's ids are exact; otherwise the old one
    stays if still of this epoch (nodes are immutable within it).
    """
    cache = node_cache(ctx)
    key = cont_key(t.sid)
    hashed = t.hashed
    if t.parent is None:
        ids: TokenIds | None = TokenIds()
    elif hashed is not None and hashed.ids is not None and hashed.epoch == epoch:
        ids = hashed.ids
    else:
        ids = None
    if ids is None:
        old: Continuation | None = cache.get(key)
        if old is not None and old.epoch != epoch:
            cache.discard(key)
        return
    points: list[Checkpoint] = []
    if nodes.delta is not None:
        ids = ids.extended(t.delta_ids)
        points.append(Checkpoint(nodes.delta.node, nodes.parent_state, ids))
    elif t.parent is not None:
        points.append(Checkpoint(t.parent, nodes.parent_state, ids))
    ids = ids.extended(t.response_ids)
    points.append(Checkpoint(nodes.response.node, nodes.response_state, ids))
    cont = Continuation(epoch, (t.prompt_text, t.response_text), tuple(points))
    cache.put(key, cont, cont.nbytes)


# -- operations --------------------------------------------------------------------------------


@mutating
def record_turn(
    ctx: Context,
    sid: str,
    prompt_text: str,
    response_text: str,
    *,
    prefix: PrefixMatch,
    delta_token_ids: Sequence[int],
    response_token_ids: Sequence[int],
    response_logprobs: Sequence[float],
    version: int,
    delta_expert_key: str | None = None,
    response_expert_key: str | None = None,
    fork: str | None = None,
    response_versions: Sequence[int] | None = None,
    answer: KeptAnswer | None = None,
    op_id: str | None = None,
) -> Op[Turn]:
    """Record one turn atomically: the delta node and the response node.

    ``prefix`` is the :class:`PrefixMatch` that :func:`lookup` returned for
    ``prompt_text``; ``delta_token_ids`` are the tokens of
    ``prompt_text[prefix.text_len:]`` sent to the engine. The delta node
    (key = ``prompt_text``, labels -100, logprobs 0.0) is written only when
    ``delta_token_ids`` is non-empty; the response node (key = ``prompt_text
    + response_text``, labels = its ids) hangs under it, else under the
    prefix node. Both carry ``version``. ``fork`` (``client_edit`` or
    ``template``) says why this turn leaves the stored path it matched: the
    first new node records it (:attr:`Node.fork`). ``response_versions``:
    the weight version of each response token when they differ (a
    generation continued across a weight update; none newer than
    ``version``): the export's ``versions`` then carry them, and the response
    node's version is the oldest. ``answer``: an answer record kept with
    the turn, in the same write, for its retries (the gateway's; read back
    with :func:`~tracestore.traces.answers.read_answer`). Re-recording an equal
    turn is a no-op (safe to retry); nothing is written when anything is
    invalid.

    Raises, before any I/O: InvalidId (sid); InvalidInput naming the field
    (ids not int32 or negative, logprobs length or NaN/+inf, text not valid
    UTF-8, payload over ``max_payload_bytes``, a prefix that does not match
    the prompt, an empty response text, a version outside 0..2**53-1). From
    the script, with nothing written: SessionReleased (data purged),
    InvalidInput('prefix') (prefix node not stored), PrefixChanged (the
    prefix node stored again by another write since lookup read it: look the
    prompt up again), NodeConflict (a node exists with another payload);
    OutcomeUnknown when the reply was lost.
    Recording the same turn again is always safe (nodes are immutable);
    with a caller's ``op_id`` the first reply is also recorded (in the
    session's slot, for ``op_ttl_s``), so a call again with it returns the
    first :class:`Turn` (its ``written`` count) even after a release.

    Round trips: 1. Only the new tokens and new text travel; the prompt does not.
    """
    turn = _check_turn(
        sid, prompt_text, response_text, prefix, version,
        (delta_token_ids, response_token_ids, response_logprobs),
        (delta_expert_key, response_expert_key), codec.fork_flag(fork), response_versions,
    )
    kept: tuple[str, int, bytes] | tuple[str, int, str] = ("", 0, "") if answer is None else answer.args()
    nodes = _turn_nodes(ctx, turn)
    new = [nodes.response] if nodes.delta is None else [nodes.delta, nodes.response]
    k = ctx.keys
    wid = new_wid()  # drawn once: a retry of the request carries the same
    args: list[Any] = [sid, 1 if ctx.config.store_text else 0, len(new)]
    for x in new:
        args.extend(x.args(ctx.config.store_text))
    args.append(wid)
    args.extend(kept)
    keys: tuple[str, ...] = (k.idx(sid), k.tok(sid), k.txt(sid), k.dead(sid), k.turn_shard(sid), k.ans(sid))
    op = ctx.op(op_id, "turn")
    if op.given:  # a caller's op id: record the reply (without one, content replays suffice)
        keys += (k.data_op(sid, op.id),)
        args.append(ctx.op_ttl_ms)
    reply = yield Eval(script("record_turn"), keys, tuple(args), op_id=op.id)
    r = Reply(reply, "record_turn")
    epoch, before, after = r.text(), r.int(), r.int()
    written = sum(r.int() for _ in new)
    nums = [r.int() for _ in new]
    chain_before, chain_after = r.text(), r.text()
    new = [x.stored(r.text()) for x in new]
    _after_write(ctx, sid, epoch, (before, after), (chain_before, chain_after), new, nums)
    nodes = nodes._replace(delta=new[0] if nodes.delta else None, response=new[-1])
    _continue(ctx, turn, nodes, epoch)
    return Turn(nodes.delta.node if nodes.delta else None, nodes.response.node, written)


def _segment_payload(segment: Segment) -> tuple[array, int, bytes]:  # type: ignore[type-arg]
    """Validate a segment's arrays: ``(token ids, label flags, packed payload)``."""
    ids = codec.int32_array("segment.token_ids", segment.token_ids, non_negative=True)
    lps = (
        codec.float32_logprobs("segment.logprobs", segment.logprobs)
        if segment.logprobs is not None
        else array("f", bytes(4 * len(ids)))
    )
    if len(lps) != len(ids):
        raise InvalidInput("segment.logprobs", f"{len(lps)} logprobs for {len(ids)} token ids")
    labels = (
        None if segment.labels is None else codec.labels_array("segment.labels", segment.labels)
    )
    if labels is not None and len(labels) != len(ids):
        raise InvalidInput("segment.labels", f"{len(labels)} labels for {len(ids)} token ids")
    flags = codec.derive_flags(ids, labels, generated=False)
    return ids, flags, codec.pack(ids, lps, labels, flags)


def insert(ctx: Context, sid: str, key_text: str, segment: Segment) -> Op[Node]:
    """XTuner-style insert: store ``segment`` as the node whose key is ``key_text``.

    The node hangs under the longest stored key that is a proper prefix of
    ``key_text`` (its segment is the text after that key). Inserting an
    existing key with an equal segment is a no-op; with a different one it
    raises NodeConflict and writes nothing. Labels given equal to the ids are
    stored as the generated flag, all -100 as none; other labels explicitly.

    Raises InvalidId/InvalidInput (as :func:`record_turn`; ``segment.text``
    must equal the part of the key after the parent) before I/O;
    SessionReleased, NodeConflict from the script.

    Round trips: 1 with a warm cache (the write is conditional on the cached
    index version); 2 cold or after a concurrent write (read the index, then
    write), more only while other writers keep changing the index.
    """
    validate_id("session id", sid)
    if not isinstance(segment, Segment):
        raise InvalidInput("segment", "expected a Segment")
    utf8("key_text", key_text)
    if not key_text:
        raise InvalidInput("key_text", "must be non-empty")
    ids, flags, payload = _segment_payload(segment)
    _check_size(ctx, "segment.token_ids", payload)
    v = validate.version("segment.version", segment.version)
    ekey = _expert_key("segment.expert_key", segment.expert_key)
    if segment.text is not None:
        utf8("segment.text", segment.text)
    digest = node_id(key_text)

    k = ctx.keys
    keys = (k.idx(sid), k.tok(sid), k.txt(sid), k.dead(sid))
    snap: SessionIndex | None = node_cache(ctx).get(idx_key(sid))
    wid = new_wid()
    for _ in range(INSERT_ATTEMPTS):
        read = snap is None  # checked against the server's index in this call, not a cached copy
        if snap is None:
            snap, _, _ = yield from read_path(ctx, sid, lambda ix: None)
        existing = snap.nodes.get(digest)
        if existing is not None:  # equal rewrite (no-op) or conflict, under its stored parent
            parent_id = existing.parent
            start = snap.nodes[parent_id].end if parent_id in snap.nodes else 0
        else:
            parent = snap.longest(key_text, "key_text", limit=len(key_text) - 1)
            parent_id = parent.id if parent else None
            start = parent.end if parent else 0
        text = key_text[start:]
        try:
            if segment.text is not None and segment.text != text:
                raise InvalidInput(
                    "segment.text",
                    f"must equal the key after its parent's end (char {start}): {text[:WINDOW]!r}...",
                )
            if existing is None:
                parent_node = snap.nodes.get(parent_id) if parent_id else None
                _check_expert_keys(parent_node, ekey, ekey, "segment.expert_key")
        except InvalidInput:
            if read:
                raise
            # judged on a cached index, which may be stale (the session purged and reopened,
            # other writers): judge it again on the server's
            node_cache(ctx).discard(idx_key(sid))
            snap = None
            continue
        parent_wid = snap.nodes[parent_id].wid if parent_id in snap.nodes else None
        new = _NewNode(
            Node(digest, parent_id, len(key_text), len(ids), flags, v, ekey), payload, text, parent_wid
        )
        store_text = ctx.config.store_text
        reply = yield Eval(
            script("insert_node"),
            keys,
            (sid, 1 if store_text else 0, snap.epoch, snap.version, *new.args(store_text), wid, snap.chain),
        )
        r = Reply(reply, "insert_node")
        stale, epoch, before, after = r.flag(), r.text(), r.int(), r.int()
        r.flag()  # fresh
        num = r.int()
        if stale:  # another writer changed the index: re-read it, choose the parent again
            node_cache(ctx).discard(idx_key(sid))
            snap = None
            continue
        new = new.stored(r.text())
        chain_after = r.text()
        _after_write(ctx, sid, epoch, (before, after), (snap.chain, chain_after), [new], [num])
        return new.node
    raise ScriptError(
        "insert_node",
        f"session {sid!r}: the index kept changing; gave up after {INSERT_ATTEMPTS} attempts",
    )


__all__ = ["MAX_EXPERT_KEY", "insert", "record_turn"]
