"""Prefix traces of multi-turn sessions: the data plane (DESIGN sections 3 and 4).

A session's trace is a trie of immutable *nodes*. A node's key is the full
rendered text from the start of the conversation to the node's end; its id
is ``blake2b-128(key UTF-8)`` (hex); its value is the segment between its
parent's end and its own end (token ids, logprobs, a labels flag, the weight
version, an optional expert key). Per session, in the slot ``{R/sid}``:

* ``idx``: digest -> ``"parent,end,ntok,flags,version,expert_key"`` (``end``
  in characters of the key), plus ``#e`` (the data's epoch) and ``#v`` (the
  index version, bumped by every write that adds nodes);
* ``tok``: digest -> packed payload (:mod:`tracestore.codec`);
* ``txt``: digest -> the segment's text (``StoreConfig.store_text``).

Cost model: the prompt text never goes to Redis. A client keeps the index of
each session it touches and the payloads of nodes it has read or written in
a bounded cache (:mod:`tracestore.nodecache`); nodes are immutable so cached
payloads never go stale, and each read checks the index version on the
server in the same round trip that fetches what the cache lacks. The client
hashes its prompt incrementally at the stored node ends and takes the
longest stored key that prefixes it. Redis CPU and bytes on the wire per turn
are O(new tokens + number of nodes), independent of the context length.

Semantics follow XTuner's trace store (see PRIOR_ART.md): a lookup returns
the longest stored key that prefixes the text and the nodes on its path;
insert hangs a new node under that longest prefix. Unlike XTuner, nodes are
never overwritten (equal rewrite = no-op, else :class:`NodeConflict`) and
reads never create a session.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import codec
from .context import Context
from .errors import InvalidInput, PromptMismatch, ScriptError, SessionReleased
from .keys import validate_id
from .nodecache import NodeCache, node_cache
from .scripts import Cmd, Eval, Op, script

_EPOCH = "#e"
_VERSION = "#v"
_MAX_EXPERT_KEY = 512
_WINDOW = 40


# -- public value types --------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One stored node of a session trie (its index record, not its tokens).

    ``id``: blake2b-128 hex digest of the node's key text; ``parent``: the
    parent's id (None at the root); ``end``: length of the key in characters;
    ``ntok``: tokens in the segment; ``flags``: :mod:`codec` label flags;
    ``version``: weight version that produced the segment; ``expert_key``:
    routed-experts reference key or None.
    """

    id: str
    parent: str | None
    end: int
    ntok: int
    flags: int
    version: int
    expert_key: str | None

    @property
    def generated(self) -> bool:
        """True when the segment's labels are its token ids (model output)."""
        return bool(self.flags & codec.GENERATED)

    def record(self) -> str:
        """The compact index record stored in ``idx``."""
        return (
            f"{self.parent or ''},{self.end},{self.ntok},{self.flags},"
            f"{self.version},{self.expert_key or ''}"
        )

    @classmethod
    def parse(cls, digest: str, record: str) -> Node:
        """Decode an index record; raise ScriptError on a malformed one."""
        try:
            parent, end, ntok, flags, version, expert_key = record.split(",", 5)
            return cls(
                digest,
                parent or None,
                int(end),
                int(ntok),
                int(flags),
                int(version),
                expert_key or None,
            )
        except ValueError:
            raise ScriptError(
                "read_index", f"malformed index record {record!r} of {digest}"
            ) from None


@dataclass(frozen=True)
class Segment:
    """The value of a node, as in XTuner's ``TokenizedSegment``.

    As an input to :func:`insert`: ``token_ids`` is required; ``logprobs``
    defaults to 0.0 each; ``labels`` to -100 each; ``text``, when given, must
    equal the part of the key after the parent's end. As an output of
    :func:`search`, every field is filled (``text`` from the searched text).
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None = None
    labels: Sequence[int] | None = None
    version: int = 0
    expert_key: str | None = None
    text: str | None = None


class _HashedPrefix:
    """The blake2b state after hashing ``text`` (a match's prefix); never updated in place.

    Pickled or copied without it (hashlib objects are neither): record_turn
    then hashes the prefix again.
    """

    __slots__ = ("text", "state")

    def __init__(self, text: str, state: Any = None) -> None:
        self.text = text
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        return (_HashedPrefix, ("",))


@dataclass(frozen=True)
class PrefixMatch:
    """The longest stored key that prefixes a text.

    ``text_len``: characters matched (0 = nothing); ``token_ids``: the token
    ids of the whole matched prefix; ``node``: the matched node (None when
    nothing matched); ``path``: nodes from the root to ``node``;
    ``segments``: one per node of ``path`` (filled by :func:`search` only).
    Pass it back as ``record_turn(..., prefix=match)``.
    """

    text_len: int
    token_ids: list[int]
    node: Node | None
    path: tuple[Node, ...] = ()
    segments: tuple[Segment, ...] = ()
    # Set by lookup(): the hash state at the matched end, so that record_turn
    # need not hash the prefix again.
    _hashed: _HashedPrefix | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Turn:
    """What :func:`record_turn` stored: the delta node (None when the turn
    added no prompt tokens), the response node, and how many nodes were new
    (0 on a replayed call)."""

    delta: Node | None
    response: Node
    written: int


@dataclass(frozen=True)
class Trace:
    """A training trace: per-token ``input_ids``, ``labels`` (-100 on prompt
    tokens), ``logprobs``, ``versions``; ``expert_keys`` per node of ``nodes``
    (None when no node has one)."""

    input_ids: list[int]
    labels: list[int]
    logprobs: list[float]
    versions: list[int]
    expert_keys: list[str] | None
    nodes: tuple[Node, ...] = field(default=())

    @property
    def min_version(self) -> int | None:
        """Oldest weight version of any token (None for an empty trace)."""
        return min(self.versions) if self.versions else None


# -- digests ---------------------------------------------------------------------------------


def _utf8(field_name: str, text: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidInput(field_name, f"expected str, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            field_name, f"not valid UTF-8 text ({exc.reason} at {exc.start})"
        ) from None


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


def node_id(key_text: str) -> str:
    """The id of the node whose key is ``key_text``: blake2b-128 of its UTF-8, hex."""
    h = _hasher()
    h.update(_utf8("key_text", key_text))
    return str(h.hexdigest())


class _Index:
    """Immutable snapshot of a session index at one version (cached per session)."""

    __slots__ = ("epoch", "version", "nodes", "ends")

    def __init__(self, epoch: str, version: int, nodes: dict[str, Node]) -> None:
        self.epoch = epoch
        self.version = version
        self.nodes = nodes
        self.ends = sorted({n.end for n in nodes.values()})

    @classmethod
    def from_pairs(cls, epoch: str, version: int, flat: Sequence[Any]) -> _Index:
        nodes: dict[str, Node] = {}
        for i in range(0, len(flat), 2):
            k = _s(flat[i])
            if not k.startswith("#"):
                nodes[k] = Node.parse(k, _s(flat[i + 1]))
        return cls(epoch, version, nodes)

    def with_nodes(self, epoch: str, version: int, new: Sequence[Node]) -> _Index:
        nodes = dict(self.nodes)
        nodes.update((n.id, n) for n in new)
        return _Index(epoch, version, nodes)

    @property
    def nbytes(self) -> int:
        return 200 + 250 * len(self.nodes)

    def longest(self, text: str, field_name: str, *, limit: int | None = None) -> Node | None:
        """The node with the longest key that prefixes ``text`` (and ends <= ``limit``)."""
        return self.match(text, field_name, limit=limit)[0]

    def match(
        self, text: str, field_name: str, *, limit: int | None = None, encoded: bytes = b""
    ) -> tuple[Node | None, Any]:
        """:meth:`longest`, and the hash state at its end (None when nothing matched).

        One pass over ``text``: the hash state is advanced from end to end and
        copied at each stored end (no text is hashed twice). ``encoded``, when
        the caller has it, is ``text`` in UTF-8: an ASCII text (as many bytes
        as characters) is then hashed from it, without encoding it again.
        """
        n = len(text) if limit is None else min(limit, len(text))
        raw = memoryview(encoded) if encoded and len(encoded) == len(text) else None
        h = _hasher()
        pos = 0
        best: Node | None = None
        best_h: Any = None
        for end in self.ends:
            if end > n:
                break
            h.update(raw[pos:end] if raw is not None else _utf8(field_name, text[pos:end]))
            pos = end
            at = h.copy()
            node = self.nodes.get(at.hexdigest())
            if node is not None and node.end == end:
                best, best_h = node, at
        return best, best_h

    def path(self, node: Node | None) -> list[Node]:
        out: list[Node] = []
        while node is not None:
            out.append(node)
            node = self.nodes.get(node.parent) if node.parent else None
            if len(out) > len(self.nodes):
                raise ScriptError("read_index", "cycle in a session index")
        out.reverse()
        return out


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _b(x: Any) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


# -- cache keys --------------------------------------------------------------------------------


def _idx_key(sid: str) -> tuple[str, str]:
    return ("idx", sid)


def _tok_key(sid: str, epoch: str, digest: str) -> tuple[str, str, str, str]:
    return ("tok", sid, epoch, digest)


def _cache_payload(cache: NodeCache, sid: str, epoch: str, digest: str, data: bytes) -> None:
    cache.put(_tok_key(sid, epoch, digest), data, len(data) + 120)


# -- reading: index + payloads --------------------------------------------------------------


def _read(ctx: Context, sid: str, pick: Any) -> Op[tuple[_Index, list[Node], dict[str, bytes]]]:
    """Resolve ``pick(index) -> node | None`` and fetch the payloads of its path.

    Warm (cached index still current, payloads cached): one round trip, the
    version check. Cold or changed index: the same round trip returns the
    index; a second fetches the payloads the cache lacks.
    """
    k = ctx.keys
    cache = node_cache(ctx)
    snap: _Index | None = cache.get(_idx_key(sid))
    want: list[str] = []
    guess: list[Node] = []
    if snap is not None:
        guess = snap.path(pick(snap))
        want = [n.id for n in guess if cache.get(_tok_key(sid, snap.epoch, n.id)) is None]
    reply = yield Eval(
        script("read_index"),
        (k.idx(sid), k.tok(sid), k.dead(sid)),
        (snap.epoch if snap else "", snap.version if snap else -1, *want),
    )
    dead, epoch, version, changed, npairs = (
        int(reply[0]),
        _s(reply[1]),
        int(reply[2]),
        int(reply[3]),
        int(reply[4]),
    )
    if dead:
        cache.discard(_idx_key(sid))
        raise SessionReleased(sid, "its trace data was purged")
    got: dict[str, bytes] = {}
    payloads = reply[5 + npairs :]
    for digest, data in zip(want, payloads, strict=True):
        if snap is not None and snap.epoch == epoch and data != b"":
            got[digest] = _b(data)
    if changed:
        snap = _Index.from_pairs(epoch, version, reply[5 : 5 + npairs])
        cache.put(_idx_key(sid), snap, snap.nbytes)
    assert snap is not None
    for digest, data in got.items():  # came over the wire: cache them
        _cache_payload(cache, sid, epoch, digest, data)
    path = snap.path(pick(snap)) if changed else guess  # unchanged index: same pick
    missing = []
    for n in path:
        if n.id in got:
            continue
        data = cache.get(_tok_key(sid, epoch, n.id))  # (a hit is now most recently used)
        if data is None:
            missing.append(n.id)
        else:
            got[n.id] = data
    if missing:
        fetched = yield Cmd(("HMGET", k.tok(sid), *missing), key=k.tok(sid))
        for digest, data in zip(missing, fetched, strict=True):
            if data is None:  # purged between the two round trips
                cache.discard(_idx_key(sid))
                raise SessionReleased(sid, "its trace data was purged during the read")
            got[digest] = _b(data)
            _cache_payload(cache, sid, epoch, digest, got[digest])
    return snap, path, got


def _ids_of(path: Sequence[Node], payloads: dict[str, bytes]) -> list[int]:
    parts = [payloads[n.id][: 4 * n.ntok] for n in path]
    a = array("i")
    a.frombytes(b"".join(parts))
    if codec._BIG_ENDIAN:
        a.byteswap()
    return a.tolist()


def lookup(ctx: Context, sid: str, prompt_text: str) -> Op[PrefixMatch]:
    """The longest stored prefix of ``prompt_text`` in session ``sid``, with its token ids.

    Call it before sending a request to the engine: send ``token_ids`` plus
    the tokens of ``prompt_text[text_len:]``, then pass the match to
    :func:`record_turn`. The prompt text is hashed locally and never sent.
    Reading never creates a session; an unknown session matches nothing.

    Raises InvalidId (sid), InvalidInput (text not valid UTF-8) before I/O;
    SessionReleased when the session's data was purged.

    Round trips: 1 with a warm cache (index version check; payloads the
    cache lacks come in the same reply), 2 when the index changed or is not
    cached (index, then the payloads the cache lacks).
    """
    validate_id("session id", sid)
    encoded = _utf8("prompt_text", prompt_text)
    state: list[Any] = [None]

    def pick(ix: _Index) -> Node | None:
        node, state[0] = ix.match(prompt_text, "prompt_text", encoded=encoded)
        return node

    snap, path, payloads = yield from _read(ctx, sid, pick)
    node = path[-1] if path else None
    hashed = _HashedPrefix(prompt_text[: node.end], state[0]) if node is not None else None
    return PrefixMatch(
        node.end if node else 0, _ids_of(path, payloads), node, tuple(path), _hashed=hashed
    )


def search(ctx: Context, sid: str, text: str) -> Op[PrefixMatch]:
    """XTuner-style search: the longest stored key prefixing ``text`` and the nodes on its path.

    Like :func:`lookup`, and also fills ``PrefixMatch.segments`` (one
    :class:`Segment` per node, with its text cut from ``text``). Raises and
    costs as :func:`lookup` (1 round trip warm, 2 cold).
    """
    validate_id("session id", sid)
    _utf8("text", text)
    snap, path, payloads = yield from _read(ctx, sid, lambda ix: ix.longest(text, "text"))
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
    snap, path, payloads = yield from _read(ctx, sid, lambda ix: ix.nodes.get(want_id))
    if not path:
        raise (yield from _mismatch(ctx, sid, snap, prompt_text))
    ids: list[int] = []
    labels: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    for n in path:
        p = codec.unpack(payloads[n.id], n.ntok, n.flags)
        ids.extend(p.token_ids)
        labels.extend(p.labels)
        lps.extend(p.logprobs)
        versions.extend([n.version] * n.ntok)
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


def _mismatch(ctx: Context, sid: str, snap: _Index, prompt: str) -> Op[PromptMismatch]:
    best = snap.longest(prompt, "prompt_text")
    m = best.end if best else 0
    n = len(prompt)
    nearest = sorted(snap.ends, key=lambda e: (abs(e - n), e))[:8]
    children = [x for x in snap.nodes.values() if x.parent == (best.id if best else None)]
    window: str | None = None
    if children:
        texts = yield Cmd(
            ("HMGET", ctx.keys.txt(sid), *[c.id for c in children]), key=ctx.keys.txt(sid)
        )
        rest = prompt[m:]
        top: tuple[int, str] | None = None
        for t in texts:
            if t is None:
                continue
            seg = _s(t)
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
            lo = max(0, pos - _WINDOW)
            window = (
                f"at char {pos}: prompt {prompt[lo : pos + _WINDOW]!r} vs stored "
                f"{prompt[lo:pos] + seg[lcp : lcp + _WINDOW]!r}"
            )
    elif best is not None and ctx.config.store_text:
        window = f"at char {m}: the longest stored key ends here; prompt continues {prompt[m : m + _WINDOW]!r}"
    return PromptMismatch(sid, m, n, nearest, window)


# -- writing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NewNode:
    node: Node
    payload: bytes
    text: str

    def args(self, store_text: bool) -> tuple[Any, ...]:
        return (self.node.id, self.node.record(), self.payload, self.text if store_text else "")


def _version(field_name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**53:
        raise InvalidInput(field_name, f"weight version must be a non-negative int, got {v!r}")
    return v


def _expert_key(field_name: str, v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > _MAX_EXPERT_KEY or any(c in v for c in "\r\n"):
        raise InvalidInput(
            field_name,
            f"expert key must be a non-empty one-line str of at most {_MAX_EXPERT_KEY} chars",
        )
    _utf8(field_name, v)
    return v


def _check_size(ctx: Context, field_name: str, payload: bytes) -> None:
    if len(payload) > ctx.config.max_payload_bytes:
        raise InvalidInput(
            field_name,
            f"node payload of {len(payload)} bytes exceeds max_payload_bytes={ctx.config.max_payload_bytes}",
        )


def _after_write(
    ctx: Context, sid: str, epoch: str, before: int, after: int, new: Sequence[_NewNode]
) -> None:
    """Keep the cached index current after our own write, or drop it if others wrote too."""
    cache = node_cache(ctx)
    snap: _Index | None = cache.get(_idx_key(sid))
    if snap is not None and snap.epoch == epoch and snap.version == before:
        snap = snap.with_nodes(epoch, after, [x.node for x in new])
        cache.put(_idx_key(sid), snap, snap.nbytes)
    elif before == 0 and after > 0:  # we wrote the first nodes: we know the whole index
        snap = _Index(epoch, after, {x.node.id: x.node for x in new})
        cache.put(_idx_key(sid), snap, snap.nbytes)
    elif snap is not None and (snap.epoch != epoch or snap.version != after):
        cache.discard(_idx_key(sid))
    for x in new:
        _cache_payload(cache, sid, epoch, x.node.id, x.payload)


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
) -> Op[Turn]:
    """Record one turn atomically: the delta node and the response node.

    ``prefix`` is the :class:`PrefixMatch` that :func:`lookup` returned for
    ``prompt_text``; ``delta_token_ids`` are the tokens of
    ``prompt_text[prefix.text_len:]`` sent to the engine. The delta node
    (key = ``prompt_text``, labels -100, logprobs 0.0) is written only when
    ``delta_token_ids`` is non-empty; the response node (key = ``prompt_text
    + response_text``, labels = its ids) hangs under it, else under the
    prefix node. Both carry ``version``. Re-recording an equal turn is a
    no-op (safe to retry); nothing is written when anything is invalid.

    Raises, before any I/O: InvalidId (sid); InvalidInput naming the field
    (ids not int32 or negative, logprobs length or NaN/+inf, text not valid
    UTF-8, payload over ``max_payload_bytes``, a prefix that does not match
    the prompt, an empty response text). From the script, with nothing
    written: SessionReleased (data purged), InvalidInput('prefix') (prefix
    node not stored), NodeConflict (a node exists with another payload).

    Round trips: 1. Only the new tokens and new text travel; the prompt does not.
    """
    validate_id("session id", sid)
    if not isinstance(prefix, PrefixMatch):
        raise InvalidInput("prefix", "expected the PrefixMatch returned by lookup()")
    # Each text is encoded once (checked as UTF-8, then hashed below). When
    # lookup() hashed exactly the matched prefix of this prompt, its state is
    # continued and only the rest of the prompt is encoded (the prefix was
    # checked by that lookup).
    hashed = prefix._hashed
    if not (
        isinstance(hashed, _HashedPrefix)
        and hashed.state is not None
        and len(hashed.text) == prefix.text_len
        and isinstance(prompt_text, str)
        and prompt_text.startswith(hashed.text)
    ):
        hashed = None
    p_bytes = _utf8("prompt_text", prompt_text[len(hashed.text) :] if hashed else prompt_text)
    r_bytes = _utf8("response_text", response_text)
    if not response_text:
        raise InvalidInput(
            "response_text", "must be non-empty (the response node's key must extend the prompt)"
        )
    v = _version("version", version)
    dkey = _expert_key("delta_expert_key", delta_expert_key)
    rkey = _expert_key("response_expert_key", response_expert_key)
    d_ids = codec.int32_array("delta_token_ids", delta_token_ids, non_negative=True)
    r_ids = codec.int32_array("response_token_ids", response_token_ids, non_negative=True)
    r_lps = codec.float32_logprobs("response_logprobs", response_logprobs)
    if len(r_lps) != len(r_ids):
        raise InvalidInput(
            "response_logprobs", f"{len(r_lps)} logprobs for {len(r_ids)} response token ids"
        )
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
    if d_ids and start == len(prompt_text):
        raise InvalidInput(
            "delta_token_ids", "non-empty, but the prompt adds no text after the prefix"
        )

    # One pass of hashing: the prefix (checked against the match), the prompt, the
    # response. The prefix is not hashed again when lookup() hashed exactly it.
    if hashed is not None:
        h = hashed.state.copy()  # (copied: the match may be passed again, on a retry)
        rest = memoryview(p_bytes)  # prompt_text[start:]
    else:
        h = _hasher()
        head = prompt_text[:start].encode()
        h.update(head)
        rest = memoryview(p_bytes)[len(head) :]
    if prefix.node is not None and h.hexdigest() != prefix.node.id:
        raise InvalidInput(
            "prefix",
            "the matched prefix is not a prefix of prompt_text (lookup a different prompt?)",
        )
    h.update(rest)
    prompt_id = h.hexdigest()
    h.update(r_bytes)
    response_id = h.hexdigest()

    parent = prefix.node.id if prefix.node else None
    new: list[_NewNode] = []
    delta: Node | None = None
    if d_ids:
        d_lps = array("f", bytes(4 * len(d_ids)))
        payload = codec.pack(d_ids, d_lps, None, 0)
        _check_size(ctx, "delta_token_ids", payload)
        delta = Node(prompt_id, parent, len(prompt_text), len(d_ids), 0, v, dkey)
        new.append(_NewNode(delta, payload, prompt_text[start:]))
        parent, start = prompt_id, len(prompt_text)
    r_payload = codec.pack(r_ids, r_lps, None, codec.GENERATED)
    _check_size(ctx, "response_token_ids", r_payload)
    end = len(prompt_text) + len(response_text)
    response = Node(response_id, parent, end, len(r_ids), codec.GENERATED, v, rkey)
    new.append(_NewNode(response, r_payload, prompt_text[start:] + response_text))

    k = ctx.keys
    args: list[Any] = [sid, 1 if ctx.config.store_text else 0, len(new)]
    for x in new:
        args.extend(x.args(ctx.config.store_text))
    reply = yield Eval(
        script("record_turn"), (k.idx(sid), k.tok(sid), k.txt(sid), k.dead(sid)), tuple(args)
    )
    epoch, before, after = _s(reply[0]), int(reply[1]), int(reply[2])
    _after_write(ctx, sid, epoch, before, after, new)
    return Turn(delta, response, sum(int(x) for x in reply[3:]))


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
    _utf8("key_text", key_text)
    if not key_text:
        raise InvalidInput("key_text", "must be non-empty")
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
    payload = codec.pack(ids, lps, labels, flags)
    _check_size(ctx, "segment.token_ids", payload)
    v = _version("segment.version", segment.version)
    ekey = _expert_key("segment.expert_key", segment.expert_key)
    if segment.text is not None:
        _utf8("segment.text", segment.text)
    digest = node_id(key_text)

    k = ctx.keys
    keys = (k.idx(sid), k.tok(sid), k.txt(sid), k.dead(sid))
    snap: _Index | None = node_cache(ctx).get(_idx_key(sid))
    for _ in range(64):
        if snap is None:
            snap, _, _ = yield from _read(ctx, sid, lambda ix: None)
        existing = snap.nodes.get(digest)
        if existing is not None:  # equal rewrite (no-op) or conflict, under its stored parent
            parent_id = existing.parent
            start = snap.nodes[parent_id].end if parent_id in snap.nodes else 0
        else:
            parent = snap.longest(key_text, "key_text", limit=len(key_text) - 1)
            parent_id = parent.id if parent else None
            start = parent.end if parent else 0
        text = key_text[start:]
        if segment.text is not None and segment.text != text:
            raise InvalidInput(
                "segment.text",
                f"must equal the key after its parent's end (char {start}): {text[:_WINDOW]!r}...",
            )
        node = Node(digest, parent_id, len(key_text), len(ids), flags, v, ekey)
        new = _NewNode(node, payload, text)
        reply = yield Eval(
            script("insert_node"),
            keys,
            (
                sid,
                1 if ctx.config.store_text else 0,
                snap.epoch,
                snap.version,
                *new.args(ctx.config.store_text),
            ),
        )
        stale, epoch, before, after = int(reply[0]), _s(reply[1]), int(reply[2]), int(reply[3])
        if stale:  # another writer changed the index: re-read it, choose the parent again
            node_cache(ctx).discard(_idx_key(sid))
            snap = None
            continue
        _after_write(ctx, sid, epoch, before, after, [new])
        return node
    raise ScriptError(
        "insert_node", f"session {sid!r}: the index kept changing; gave up after 64 attempts"
    )
