"""Reading traces: lookup, search, export_training_trace (DESIGN section 4).

Every read goes through :func:`read_path`: it checks the cached index
snapshot against the server's index version in the same round trip that
fetches the payloads the cache lacks, so a warm read is one round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import codec, replies
from ..context import Context
from ..errors import CorruptData, InvalidInput, PromptMismatch, SessionReleased
from ..nodecache import node_cache
from ..replies import Reply
from ..scripts import Batch, Cmd, Eval, Op, gather, script
from ..validate import validate_id
from .continuation import Checkpoint, Continuation, cont_key
from .index import (
    ID_HEX,
    SessionIndex,
    as_bytes,
    cache_payload,
    hasher,
    idx_key,
    node_id,
    tok_key,
    utf8,
)
from .tokens import TokenIds
from .types import HashedPrefix, Node, PrefixMatch, Segment, Trace

#: Characters of context shown on each side of a PromptMismatch.
WINDOW = 40


@dataclass
class Rider:
    """One field of another hash of the session's slot, read in the same round trip as the index
    (:func:`read_path`'s ``rider``); ``value`` is set by the read (None: no such field)."""

    key: str
    field: str
    value: bytes | None = None


def read_path(
    ctx: Context,
    sid: str,
    pick: Callable[[SessionIndex], Node | None],
    skip: Callable[[list[Node]], int] = lambda path: 0,
    rider: Rider | None = None,
) -> Op[tuple[SessionIndex, list[Node], dict[str, bytes]]]:
    """Resolve ``pick(index) -> node | None`` and fetch the payloads of its path.

    ``skip(path)``: how many leading nodes of the path the caller needs no
    payload of (it has their tokens already); the returned payloads are
    those of the other nodes. Warm (cached index still current, payloads
    cached): one round trip, the version check. Cold or changed index: the
    same round trip returns the index; a second fetches the payloads the
    cache lacks. ``rider``: a field read in the first round trip too.
    """
    k = ctx.keys
    cache = node_cache(ctx)
    snap: SessionIndex | None = cache.get(idx_key(sid))
    want: list[Node] = []
    guess: list[Node] = []
    if snap is not None:
        guess = snap.path(pick(snap))
        want = [n for n in guess[skip(guess) :] if cache.get(tok_key(sid, snap.epoch, n)) is None]
    keys: tuple[str, ...] = (k.idx(sid), k.tok(sid), k.dead(sid))
    head: tuple[Any, ...] = (snap.epoch if snap else "", snap.version if snap else -1, snap.chain if snap else "")
    if rider is not None:
        keys, head = (*keys, rider.key), (*head, rider.field)
    reply = yield Eval(script("read_index"), keys, (*head, *(snap.nums[n.id] for n in want if snap)))
    r = Reply(reply, "read_index")
    dead, epoch, version, chain, changed = r.flag(), r.text(), r.int(), r.text(), r.flag()
    index_pairs = r.take(r.int())
    fetched_first = list(r.rest())
    if rider is not None:
        last = fetched_first.pop()
        rider.value = as_bytes(last) if last != b"" else None
    if dead:
        cache.discard(idx_key(sid))
        cache.discard(cont_key(sid))
        raise SessionReleased(sid, "its trace data was purged")
    if version < 0:
        raise CorruptData(k.idx(sid), "the index version is not a number", "#v")
    old = snap
    if changed:
        snap = SessionIndex.from_pairs(epoch, version, index_pairs, k.idx(sid), chain)
        cache.put(idx_key(sid), snap, snap.nbytes)
    assert snap is not None
    got: dict[str, bytes] = {}
    for n, data in zip(want, fetched_first, strict=True):
        # asked by the number the cached index gave: it counts only when the index read gives
        # that node the same number and write id (after a rollback, a number can name another node)
        assert old is not None
        if data != b"" and (
            not changed
            or (snap.epoch == old.epoch and n.same_write(snap.nodes.get(n.id)) and snap.nums[n.id] == old.nums[n.id])
        ):
            got[n.id] = as_bytes(data)
            cache_payload(cache, sid, epoch, n, got[n.id])  # came over the wire: cache it
    path = snap.path(pick(snap)) if changed else guess  # unchanged index: same pick
    missing: list[Node] = []
    for n in path[skip(path) :]:
        if n.id in got:
            continue
        if n.ntok == 0:  # an empty payload (read_index answers '' for a missing one too)
            got[n.id] = b""
            continue
        data = cache.get(tok_key(sid, epoch, n))  # (a hit is now most recently used)
        if data is None:
            missing.append(n)
        else:
            got[n.id] = data
    if missing:
        # by node number, for the index just read (read_index checks it in the same call)
        again = yield Eval(
            script("read_index"),
            (k.idx(sid), k.tok(sid), k.dead(sid)),
            (epoch, version, snap.chain, *(snap.nums[n.id] for n in missing)),
        )
        r2 = Reply(again, "read_index")
        dead2, epoch2, version2, chain2, changed2 = r2.flag(), r2.text(), r2.int(), r2.text(), r2.flag()
        pairs2 = r2.take(r2.int())
        fetched = list(r2.rest())
        if changed2 and not dead2 and epoch2 == epoch:
            # others wrote meanwhile: the numbers asked by still name these nodes, unless the
            # store rolled back (then the index read now gives one of them another write id)
            now = SessionIndex.from_pairs(epoch2, version2, pairs2, k.idx(sid), chain2)
            if any(not n.same_write(now.nodes.get(n.id)) or now.nums.get(n.id) != snap.nums[n.id] for n in missing):
                cache.discard(idx_key(sid))
                cache.discard(cont_key(sid))
                return (yield from read_path(ctx, sid, pick, skip, rider))
        for n, data in zip(missing, fetched, strict=True):
            if dead2 or epoch2 != epoch or data == b"":  # purged (or purged and reopened) meanwhile
                cache.discard(idx_key(sid))
                cache.discard(cont_key(sid))
                raise SessionReleased(sid, "its trace data was purged during the read")
            got[n.id] = as_bytes(data)
            cache_payload(cache, sid, epoch, n, got[n.id])
    # a payload of another size would decode to wrong tokens (the skipped nodes' were
    # checked when their tokens were read, or written by this client)
    for n in path[skip(path) :]:
        if n.flags & ~codec.KNOWN_FLAGS or len(got[n.id]) != codec.payload_size(n.ntok, n.flags):
            cache.discard(idx_key(sid))
            cache.discard(cont_key(sid))
            raise CorruptData(
                k.tok(sid), f"{len(got[n.id])} bytes do not hold {n.ntok} tokens with flags {n.flags}", n.id
            )
    return snap, path, got


def _ids_of(path: Sequence[Node], payloads: dict[str, bytes]) -> TokenIds:
    """The token ids of ``path``'s segments, concatenated (memory copies, no Python ints)."""
    return TokenIds.frombytes(b"".join(payloads[n.id][: 4 * n.ntok] for n in path))


def lookup(ctx: Context, sid: str, prompt_text: str) -> Op[PrefixMatch]:
    """The longest stored prefix of ``prompt_text`` in session ``sid``, with its token ids.

    Call it before sending a request to the engine: send ``token_ids`` plus
    the tokens of ``prompt_text[text_len:]``, then pass the match to
    :func:`record_turn`. The prompt text is hashed locally and never sent.
    Reading never creates a session; an unknown session matches nothing.

    When the prompt extends this client's last turn of the session (its
    continuation, kept by ``record_turn``), that part is checked by
    comparison and only the new text is encoded and hashed; the token ids
    share the continuation's buffer (:class:`TokenIds`, no copy). Client
    work is then O(new text + new tokens), whatever the context length.

    Raises InvalidId (sid), InvalidInput (text not valid UTF-8) before I/O;
    SessionReleased when the session's data was purged.

    Round trips: 1 with a warm cache (index version check; payloads the
    cache lacks come in the same reply), 2 when the index changed or is not
    cached (index, then the payloads the cache lacks).
    """
    return (yield from lookup_riding(ctx, sid, prompt_text, None))


def key_digest(ctx: Context, sid: str, key_text: str) -> str:
    """The blake2b-128 digest of ``key_text``'s UTF-8 as 32 hex characters: its first 16 are
    :func:`~tracestore.traces.index.node_id` of ``key_text``. No I/O.

    O(the text after the session's cached continuation): the hash resumes from the
    state kept at the deepest cached checkpoint that prefixes ``key_text`` (a hash of
    that text, whatever the checkpoint's epoch), so a warm turn hashes only its new
    messages, never the whole history. Raises InvalidInput on text that is not UTF-8.
    """
    if not isinstance(key_text, str):
        utf8("key_text", key_text)  # raises InvalidInput
    cont: Continuation | None = node_cache(ctx).get(cont_key(sid))
    base = cont.base_for(key_text) if cont is not None else None
    if base is None:
        h = hasher()
        h.update(utf8("key_text", key_text))
    else:
        h = base.state.copy()
        h.update(utf8("key_text", key_text[base.node.end :]))
    return str(h.hexdigest())


def lookup_riding(ctx: Context, sid: str, prompt_text: str, rider: Rider | None) -> Op[PrefixMatch]:
    """:func:`lookup`, with ``rider`` read in its first round trip (:func:`read_path`)."""
    validate_id("session id", sid)
    if not isinstance(prompt_text, str):
        utf8("prompt_text", prompt_text)  # raises InvalidInput
    cont: Continuation | None = node_cache(ctx).get(cont_key(sid))
    base = cont.base_for(prompt_text) if cont is not None else None
    # Only the text after the base is new: the base's key was valid UTF-8 when recorded.
    encoded = utf8("prompt_text", prompt_text[base.node.end :] if base else prompt_text)
    used: list[Any] = [None, None]  # [the base, if the index confirmed it; hash state at the match]

    def pick(ix: SessionIndex) -> Node | None:
        start = None
        used[0] = None
        if base is not None and cont is not None and ix.epoch == cont.epoch:
            if base.node.same_write(ix.nodes.get(base.node.id)):
                start, used[0] = (base.node, base.state), base
        if start is None and base is not None:  # not current: hash it all (it cannot fail)
            node, used[1] = ix.match(prompt_text, "prompt_text")
        else:
            node, used[1] = ix.match(prompt_text, "prompt_text", encoded=encoded, start=start)
        return node

    def skip(path: list[Node]) -> int:
        b: Checkpoint | None = used[0]
        if b is not None:
            for i in range(len(path) - 1, -1, -1):
                if path[i].id == b.node.id:
                    return i + 1
        return 0

    snap, path, payloads = yield from read_path(ctx, sid, pick, skip, rider)
    node = path[-1] if path else None
    b = used[0]
    k = skip(path)
    if b is not None and k:
        ids = b.ids if k == len(path) else b.ids.extended(_ids_of(path[k:], payloads))
    else:
        ids = _ids_of(path, payloads)
    hashed = (
        HashedPrefix(prompt_text, node.end, used[1], ids, snap.epoch) if node is not None else None
    )
    return PrefixMatch(node.end if node else 0, ids, node, tuple(path), extended=snap.has_child(node), _hashed=hashed)


def search(ctx: Context, sid: str, text: str) -> Op[PrefixMatch]:
    """XTuner-style search: the longest stored key prefixing ``text`` and the nodes on its path.

    Like :func:`lookup`, and also fills ``PrefixMatch.segments`` (one
    :class:`Segment` per node, with its text cut from ``text``). Raises and
    costs as :func:`lookup` (1 round trip warm, 2 cold).
    """
    validate_id("session id", sid)
    utf8("text", text)
    snap, path, payloads = yield from read_path(ctx, sid, lambda ix: ix.longest(text, "text"))
    node = path[-1] if path else None
    segments = []
    start = 0
    for n in path:
        p = codec.unpack(payloads[n.id], n.ntok, n.flags)
        segments.append(
            Segment(
                list(p.token_ids),
                list(p.logprobs),
                list(p.labels),
                n.version,
                n.expert_key,
                text[start : n.end],
            )
        )
        start = n.end
    return PrefixMatch(
        node.end if node else 0, _ids_of(path, payloads), node, tuple(path), tuple(segments)
    )


def export_training_trace(ctx: Context, sid: str, prompt_text: str) -> Op[Trace]:
    """The training trace of the node whose key is exactly ``prompt_text``.

    Concatenates the segments from the root: ``input_ids``, ``labels`` (-100
    on prompt tokens, the id on generated ones), ``logprobs``, ``versions``
    (per token) and ``expert_keys`` (per node, or None when no node has one).

    Raises InvalidId/InvalidInput before I/O; PromptMismatch (matched length,
    nearest stored ends, a text window around the first difference when node
    text is stored) when no key equals the prompt; InvalidInput('expert_keys')
    when some nodes have an expert key and others not; SessionReleased when
    the data was purged.

    Round trips: 1 warm, 2 cold; a mismatch costs one more (the text window).
    """
    validate_id("session id", sid)
    want_id = node_id(prompt_text)
    snap, path, payloads = yield from read_path(ctx, sid, lambda ix: ix.nodes.get(want_id))
    if not path:
        raise (yield from _mismatch(ctx, sid, snap, prompt_text))
    return _trace_of(sid, path, payloads)


def export_node(ctx: Context, sid: str, node: str) -> Op[Trace]:
    """The training trace of the node whose id is ``node`` (a recorded :class:`Turn`'s
    ``response.id``): what :func:`export_training_trace` gives for that node's key, found
    without the key's text, so a caller that exports a session's latest turn later keeps
    16 characters for it instead of the whole conversation.

    Raises InvalidId/InvalidInput('node': not a node id) before I/O; InvalidInput('node') when
    the session has no such node; InvalidInput('expert_keys') and SessionReleased as
    :func:`export_training_trace`. Round trips: 1 warm, 2 cold.
    """
    validate_id("session id", sid)
    if not isinstance(node, str) or len(node) != ID_HEX or node.strip("0123456789abcdef"):
        raise InvalidInput("node", f"expected a node id ({ID_HEX} lowercase hex characters), got {node!r}")
    snap, path, payloads = yield from read_path(ctx, sid, lambda ix: ix.nodes.get(node))
    if not path:
        raise InvalidInput("node", f"session {sid!r} has no node {node!r}")
    return _trace_of(sid, path, payloads)


def _trace_of(sid: str, path: Sequence[Node], payloads: dict[str, Any]) -> Trace:
    ids: list[int] = []
    labels: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    for n in path:
        p = codec.unpack(payloads[n.id], n.ntok, n.flags)
        ids.extend(p.token_ids)
        labels.extend(p.labels)
        lps.extend(p.logprobs)
        versions.extend(p.versions if p.versions is not None else [n.version] * n.ntok)
    keys = [n.expert_key for n in path]
    if all(x is None for x in keys):
        expert_keys = None
    elif any(x is None for x in keys):
        missing = sum(x is None for x in keys)
        raise InvalidInput(
            "expert_keys",
            f"session {sid!r}: {missing} of {len(keys)} nodes on the path have no expert key "
            "(a session has routed experts on every node or on none)",
        )
    else:
        expert_keys = [str(x) for x in keys]
    return Trace(ids, labels, lps, versions, expert_keys, tuple(path))


def export_many(ctx: Context, items: Sequence[tuple[str, str]]) -> Op[list[Trace]]:
    """:func:`export_training_trace` of each ``(sid, prompt_text)``, pipelined: the traces, in order.

    One round trip warm, two cold, for the whole list (the sessions' index
    checks share one pipeline, then their missing payloads another). Raises
    InvalidId/InvalidInput before any I/O; otherwise the first error of any
    export (PromptMismatch, SessionReleased...) once all have run.
    """
    return (yield from gather([export_training_trace(ctx, sid, key) for sid, key in items]))


def trace_keys(ctx: Context, sid: str) -> Op[list[str]]:
    """Every stored key of session ``sid``'s trie (XTuner's ``Trie.keys``), shortest first.

    A node's key is the full text from the start of the conversation to its
    end: the texts of the nodes on its path, joined. Needs the node texts
    (``StoreConfig.store_text``, on by default). An unknown session has no
    keys (reads never create one).

    Raises InvalidId before I/O; SessionReleased when the data was purged;
    InvalidInput('store_text') when a node's text was not stored. One round
    trip (index and texts of the session's slot, pipelined).
    """
    validate_id("session id", sid)
    k = ctx.keys
    dead, idx, txt = yield Batch(
        (
            Cmd(("EXISTS", k.dead(sid)), key=k.dead(sid)),
            Cmd(("HGETALL", k.idx(sid)), key=k.idx(sid)),
            Cmd(("HGETALL", k.txt(sid)), key=k.txt(sid)),
        )
    )
    if int(dead):
        raise SessionReleased(sid, "its trace data was purged")
    ix = SessionIndex.from_pairs("", 0, idx, k.idx(sid))
    texts = replies.field_map(txt)
    keys: dict[str, str] = {}

    def key_of(node: Node) -> str:
        if node.id not in keys:
            seg = texts.get(str(ix.nums[node.id]))
            if seg is None:
                raise InvalidInput(
                    "store_text",
                    f"session {sid!r}: node {node.id} has no stored text (written with "
                    "store_text=False); its keys cannot be listed",
                )
            parent = ix.nodes.get(node.parent) if node.parent else None
            keys[node.id] = (key_of(parent) if parent is not None else "") + replies.text(seg)
        return keys[node.id]

    return sorted((key_of(n) for n in ix.nodes.values()), key=lambda t: (len(t), t))


def _mismatch(ctx: Context, sid: str, snap: SessionIndex, prompt: str) -> Op[PromptMismatch]:
    best = snap.longest(prompt, "prompt_text")
    m = best.end if best else 0
    n = len(prompt)
    nearest = sorted(snap.ends, key=lambda e: (abs(e - n), e))[:8]
    children = [x for x in snap.nodes.values() if x.parent == (best.id if best else None)]
    window: str | None = None
    if children:
        texts = yield Cmd(
            ("HMGET", ctx.keys.txt(sid), *[snap.nums[c.id] for c in children]), key=ctx.keys.txt(sid)
        )
        rest = prompt[m:]
        top: tuple[int, str] | None = None
        for t in texts:
            if t is None:
                continue
            try:
                seg = replies.text(t)
            except UnicodeDecodeError:
                raise CorruptData(ctx.keys.txt(sid), "node text is not UTF-8") from None
            lcp = 0
            for a, b in zip(seg, rest, strict=False):
                if a != b:
                    break
                lcp += 1
            if top is None or lcp > top[0]:
                top = (lcp, seg)
        if top is not None:
            lcp, seg = top
            pos = m + lcp
            lo = max(0, pos - WINDOW)
            window = (
                f"at char {pos}: prompt {prompt[lo : pos + WINDOW]!r} vs stored "
                f"{prompt[lo:pos] + seg[lcp : lcp + WINDOW]!r}"
            )
    elif best is not None and ctx.config.store_text:
        window = f"at char {m}: the longest stored key ends here; prompt continues {prompt[m : m + WINDOW]!r}"
    return PromptMismatch(sid, m, n, nearest, window)


__all__ = ["Rider", "export_many", "export_training_trace", "key_digest", "lookup", "lookup_riding", "read_path", "search", "trace_keys"]
