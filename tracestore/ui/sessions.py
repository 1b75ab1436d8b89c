"""The viewer's data layer for one session: its tree of nodes, and a path's tokens.

A session's index (``ts:{R/sid}:idx``, tens of bytes per node) is read with
the ``read_index`` script, as every trace read is (docs/traces.md): the
viewer keeps the snapshots it read in an :class:`IndexCache` (bounded by the
nodes it holds) with their tree shape, and sends the cached version with
each read, so a page of a session that did not change costs one small round
trip however many nodes it has, and one that changed is read once. Node
payloads (token ids, logprobs, labels) are fetched only for the nodes a page
shows: the window of tokens of a path, never the whole session. Read-only,
with the commands of the ``observer`` role.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import codec
from ..context import Context
from ..errors import CorruptData, SessionReleased
from ..replies import Reply, text
from ..scripts import Batch, Cmd, Eval, Op, script
from ..traces.index import SessionIndex
from ..traces.types import Node
from ..validate import int_in, validate_id
from .views import BranchRow, NodeRow, NotFound, PathView, SessionView, TokenRow, TurnBar

#: Characters of a node's text shown in the tree.
TEXT_CHARS = 160
#: Characters of a node's text shown on a path page.
PATH_TEXT_CHARS = 4000
#: Branch points listed on a session page.
BRANCHES_SHOWN = 100
#: Leaves (path ends) listed on a session page.
LEAVES_SHOWN = 200
#: Buckets of a path's staleness histogram (the last one: that many versions behind or more).
STALENESS_BUCKETS = 8
#: Path layouts kept per index snapshot.
PATHS_KEPT = 32
#: Attempts at reading payloads consistent with the index while writers change it.
READ_ATTEMPTS = 4


def labels_of(node: Node) -> str:
    """``prompt``, ``generated`` or ``explicit`` (labels stored with the tokens)."""
    if node.flags & codec.EXPLICIT_LABELS:
        return "explicit"
    return "generated" if node.flags & codec.GENERATED else "prompt"


def fork_of(node: Node) -> str | None:
    """The node's fork reason, where the trace records one (``Node.fork``, DESIGN section 14), else None."""
    reason = getattr(node, "fork", None)
    return str(reason) if reason else None


@dataclass(frozen=True)
class PathShape:
    """The path from the root to one node, laid out once per index snapshot (O(depth)).

    ``starts[i]``: position of the first token of ``nodes[i]`` on the path;
    ``trained``: trained tokens per weight version (the staleness histogram
    against any gate version).
    """

    nodes: tuple[Node, ...]
    starts: tuple[int, ...]
    tokens: int
    turns: tuple[TurnBar, ...]
    trained: dict[int, int]
    #: Node id -> its depth (position on the path).
    depth: dict[str, int]

    @classmethod
    def of(cls, path: list[Node]) -> PathShape:
        """The layout of ``path`` (root first)."""
        starts: list[int] = []
        pos = 0
        trained: dict[int, int] = {}
        for n in path:
            starts.append(pos)
            pos += n.ntok
            if n.flags & (codec.GENERATED | codec.EXPLICIT_LABELS):
                trained[n.version] = trained.get(n.version, 0) + n.ntok
        return cls(tuple(path), tuple(starts), pos, _turns(path), trained, {n.id: d for d, n in enumerate(path)})

    def window(self, offset: int, count: int) -> list[tuple[Node, int]]:
        """The nodes holding tokens ``offset .. offset + count - 1``, each with its first token's position."""
        i = max(0, bisect_right(self.starts, offset) - 1)
        out = []
        while i < len(self.nodes) and self.starts[i] < offset + count:
            n, start = self.nodes[i], self.starts[i]
            if start + n.ntok > offset:
                out.append((n, start))
            i += 1
        return out


@dataclass(frozen=True)
class Shape:
    """A session tree's layout, derived once per index snapshot (O(nodes)).

    ``order``: (depth, node) depth first, children by end then number;
    ``children``: node id -> child ids in that order; ``leaves`` and
    ``branches`` (nodes with two children or more) in depth-first order.
    """

    order: tuple[tuple[int, Node], ...]
    children: dict[str, tuple[str, ...]]
    by_num: dict[int, Node]
    leaves: tuple[Node, ...]
    branches: tuple[Node, ...]
    tokens: int
    generated: int
    #: Paths laid out so far (node number -> layout), at most :data:`PATHS_KEPT`.
    paths: dict[int, PathShape] = field(default_factory=dict, compare=False, repr=False)

    def path_of(self, ix: SessionIndex, num: int) -> PathShape | None:
        """The layout of the path to node ``num`` of ``ix`` (this shape's index), None when no such node."""
        got = self.paths.get(num)
        if got is None:
            node = self.by_num.get(num)
            if node is None:
                return None
            got = PathShape.of(ix.path(node))
            if len(self.paths) >= PATHS_KEPT:
                self.paths.pop(next(iter(self.paths)))
            self.paths[num] = got
        return got

    @classmethod
    def of(cls, ix: SessionIndex) -> Shape:
        """The shape of ``ix``; CorruptData (naming the node) when a parent is not stored or parents form a cycle."""
        kids: dict[str | None, list[Node]] = {}
        for n in ix.nodes.values():
            if n.parent is not None and n.parent not in ix.nodes:
                raise CorruptData(ix.key or "session index", f"parent {n.parent} is not stored", n.id)
            kids.setdefault(n.parent, []).append(n)
        for group in kids.values():
            group.sort(key=lambda n: (n.end, ix.nums[n.id]))
        order: list[tuple[int, Node]] = []
        stack = [(0, n) for n in reversed(kids.get(None, []))]
        while stack:
            depth, n = stack.pop()
            order.append((depth, n))
            stack.extend((depth + 1, c) for c in reversed(kids.get(n.id, [])))
        if len(order) != len(ix.nodes):  # unreachable from a root: the parents form a cycle
            seen = {n.id for _, n in order}
            bad = next(i for i in ix.nodes if i not in seen)
            raise CorruptData(ix.key or "session index", "the parents form a cycle", bad)
        children = {p: tuple(c.id for c in cs) for p, cs in kids.items() if p is not None}
        return cls(
            order=tuple(order),
            children=children,
            by_num={num: ix.nodes[i] for i, num in ix.nums.items()},
            leaves=tuple(n for _, n in order if n.id not in children),
            branches=tuple(n for _, n in order if len(children.get(n.id, ())) > 1),
            tokens=sum(n.ntok for n in ix.nodes.values()),
            generated=sum(n.ntok for n in ix.nodes.values() if n.flags & codec.GENERATED),
        )


class IndexCache:
    """Index snapshots the viewer read, by (prefix, run, sid), with their shapes; LRU, bounded by nodes held.

    A snapshot is immutable and names its epoch, version and chain: the
    next read sends them and gets the index back only when it changed.
    """

    def __init__(self, max_nodes: int = 1_000_000) -> None:
        self.max_nodes = max_nodes
        self._items: OrderedDict[tuple[str, str, str], tuple[SessionIndex, Shape | None]] = OrderedDict()
        self._nodes = 0

    def __len__(self) -> int:
        """Sessions held."""
        return len(self._items)

    def get(self, key: tuple[str, str, str]) -> SessionIndex | None:
        """The cached snapshot of ``key`` (most recently used now), or None."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: tuple[str, str, str], ix: SessionIndex) -> None:
        """Keep ``ix`` for ``key`` (replacing an older one); evict the least recently used beyond the bound."""
        self.discard(key)
        self._items[key] = (ix, None)
        self._nodes += len(ix.nodes)
        while self._nodes > self.max_nodes and len(self._items) > 1:
            _, (old, _) = self._items.popitem(last=False)
            self._nodes -= len(old.nodes)

    def discard(self, key: tuple[str, str, str]) -> None:
        """Forget ``key``."""
        old = self._items.pop(key, None)
        if old is not None:
            self._nodes -= len(old[0].nodes)

    def shape(self, key: tuple[str, str, str], ix: SessionIndex) -> Shape:
        """The shape of ``ix``, computed once per cached snapshot."""
        item = self._items.get(key)
        if item is not None and item[0] is ix and item[1] is not None:
            return item[1]
        sh = Shape.of(ix)
        if item is not None and item[0] is ix:
            self._items[key] = (ix, sh)
        return sh


def _read_index(ctx: Context, sid: str, snap: SessionIndex | None, nums: list[int]) -> Eval:
    k = ctx.keys
    return Eval(
        script("read_index"),
        (k.idx(sid), k.tok(sid), k.dead(sid)),
        (snap.epoch if snap else "", snap.version if snap else -1, snap.chain if snap else "", *nums),
    )


def _decode(ctx: Context, sid: str, snap: SessionIndex | None, reply: Any) -> tuple[bool, SessionIndex, list[Any] | None]:
    """A read_index reply: (dead, the current snapshot, the payloads asked, or None when the index changed)."""
    r = Reply(reply, "read_index")
    dead, epoch, version, chain, changed = r.flag(), r.text(), r.int(), r.text(), r.flag()
    flat = r.take(r.int())
    if version < 0:
        raise CorruptData(ctx.keys.idx(sid), "the index version is not a number", "#v")
    if changed or snap is None:
        return dead, SessionIndex.from_pairs(epoch, version, flat, ctx.keys.idx(sid), chain), None
    return dead, snap, r.rest()


def _ms(reply: Any) -> int:
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000


def _row(ix: SessionIndex, depth: int, n: Node, sh: Shape, txt: Any, chars: int = TEXT_CHARS) -> NodeRow:
    raw = None if txt is None else text(txt)
    return NodeRow(
        num=ix.nums[n.id],
        id=n.id,
        parent=ix.nums.get(n.parent) if n.parent else None,
        depth=depth,
        end=n.end,
        tokens=n.ntok,
        labels=labels_of(n),
        version=n.version,
        expert_key=n.expert_key,
        write_id=n.wid or None,
        fork=fork_of(n),
        children=len(sh.children.get(n.id, ())),
        text=raw if raw is None or len(raw) <= chars else raw[: chars - 1] + "…",
    )


def session_view(ctx: Context, cache: IndexCache, sid: str, *, page: int = 1, per_page: int = 200) -> Op[SessionView]:
    """The session page: its control record and page ``page`` of its nodes, depth first.

    A session that was released shows its release time (its trace data is
    purged). Raises InvalidId/InvalidInput before I/O, NotFound when the run
    knows nothing of ``sid`` (no record, no tombstone, no trace), CorruptData
    for an index that does not decode. Two round trips (the index check with
    the session's record, route and tombstone; the page's node texts), three
    when the cached index changed.
    """
    validate_id("session id", sid)
    int_in("page", page, 1, 10**9)
    int_in("per_page", per_page, 1, 5000)
    k = ctx.keys
    key = (k.prefix, k.run, sid)
    snap = cache.get(key)
    head = (
        Cmd(("HMGET", k.session(sid), "owner", "state", "born", "opened_ms", "group"), key=k.session(sid)),
        Cmd(("ZSCORE", k.released, sid), key=k.released),
        Cmd(("HGET", k.route, sid), key=k.route),
        Cmd(("TIME",), key=k.meta),
    )
    idx_reply, rec, released, route, now = yield Batch((_read_index(ctx, sid, snap, []), *head))
    dead, ix, _ = _decode(ctx, sid, snap, idx_reply)
    if ix is not snap:
        cache.put(key, ix)
    sh = cache.shape(key, ix)
    owner, state = (text(x) if x is not None else None for x in rec[:2])
    if state is None and released is None and not ix.nodes and not dead:
        raise NotFound("session", f"run {k.run!r} has no session {sid!r} (no record, no tombstone, no trace)")
    pages = max(1, -(-len(sh.order) // per_page))
    shown = sh.order[(page - 1) * per_page : page * per_page]
    texts: list[Any] = [None] * len(shown)
    if shown:
        texts = yield Cmd(("HMGET", k.txt(sid), *(ix.nums[n.id] for _, n in shown)), key=k.txt(sid))
    rows = tuple(_row(ix, d, n, sh, t) for (d, n), t in zip(shown, texts, strict=True))
    branches = tuple(
        BranchRow(ix.nums[b.id], b.end, tuple(ix.nums[c] for c in sh.children[b.id]),
                  tuple(fork_of(ix.nodes[c]) for c in sh.children[b.id]))
        for b in sh.branches[:BRANCHES_SHOWN]
    )
    return SessionView(
        run=k.run, sid=sid, server_ms=_ms(now), owner=owner,
        state=state or ("released" if released is not None else "unknown"),
        born=_int(rec[2]), opened_ms=_int(rec[3]), group=text(rec[4]) if rec[4] else None,
        released_ms=_int(released), route=text(route) if route is not None else None, purged=dead,
        index_version=ix.version, nodes_total=len(ix.nodes), tokens_total=sh.tokens,
        generated_total=sh.generated, leaves=tuple(ix.nums[n.id] for n in sh.leaves[:LEAVES_SHOWN]),
        leaves_total=len(sh.leaves), branches=branches, branches_total=len(sh.branches),
        page=page, pages=pages, nodes=rows,
    )


def _int(x: Any) -> int | None:
    if x is None:
        return None
    try:
        return int(float(text(x)))
    except ValueError:
        return None


def _turns(path: list[Node]) -> tuple[TurnBar, ...]:
    out: list[TurnBar] = []
    prompt = 0
    for n in path:
        if n.flags & (codec.GENERATED | codec.EXPLICIT_LABELS):
            out.append(TurnBar(len(out) + 1, prompt, n.ntok, n.version))
            prompt = 0
        else:
            prompt += n.ntok
    if prompt:
        out.append(TurnBar(len(out) + 1, prompt, 0, path[-1].version))
    return tuple(out)


def path_view(
    ctx: Context,
    cache: IndexCache,
    sid: str,
    num: int,
    *,
    offset: int = 0,
    count: int = 1000,
    decode: Callable[[int], str] | None = None,
    tokenizer: str | None = None,
) -> Op[PathView]:
    """The path from the root to node ``num`` of ``sid``: its nodes, and tokens ``offset .. offset + count - 1``.

    Each token: its id, its text (``decode(id)`` when a tokenizer is given),
    trained or not (label != -100), logprob, the weight version of its node
    and its staleness against the gate's version, the node's expert key:
    exactly what ``export_training_trace`` returns for the node's key.
    Raises InvalidId/InvalidInput before I/O, NotFound for a node the index
    does not hold, SessionReleased when the data is purged, CorruptData for
    a payload that does not decode. One round trip when the cached index is
    current (index check, the window's payloads and the gate's version
    together), two when it changed.
    """
    validate_id("session id", sid)
    int_in("node", num, 1, 2**31)
    int_in("offset", offset, 0, 2**40)
    int_in("count", count, 1, 20_000)
    k = ctx.keys
    key = (k.prefix, k.run, sid)
    snap = cache.get(key)
    for _ in range(READ_ATTEMPTS):
        layout = cache.shape(key, snap).path_of(snap, num) if snap is not None else None
        window = layout.window(offset, count) if layout is not None else []
        nums = [snap.nums[n.id] for n, _ in window] if snap is not None else []
        idx_reply, version, now, texts = yield Batch((
            _read_index(ctx, sid, snap, nums),
            Cmd(("HGET", k.gate, "version"), key=k.gate),
            Cmd(("TIME",), key=k.meta),
            Cmd(("HMGET", k.txt(sid), *nums), key=k.txt(sid)) if nums else Cmd(("EXISTS", k.txt(sid)), key=k.txt(sid)),
        ))
        dead, ix, payloads = _decode(ctx, sid, snap, idx_reply)
        if dead:
            cache.discard(key)
            raise SessionReleased(sid, "its trace data was purged")
        if ix is not snap:
            cache.put(key, ix)
            snap = ix
            continue  # the nodes asked by were numbers of an older index: ask again
        if payloads is not None and all(p != b"" or n.ntok == 0 for (n, _), p in zip(window, payloads, strict=True)):
            break
        cache.discard(key)  # a payload missing for an index that did not change: read it all again
        snap = None
    else:
        raise CorruptData(k.tok(sid), "payloads kept changing under the index; reload the page", str(num))
    if layout is None:
        raise NotFound("node", f"session {sid!r} has no node {num} (it has {len(ix.nodes)})")
    gate_v = _int(version) or 0
    tokens: list[TokenRow] = []
    for (n, start), data in zip(window, payloads, strict=True):
        p = codec.unpack(data if isinstance(data, bytes) else str(data).encode(), n.ntok, n.flags)
        nnum = ix.nums[n.id]
        for j in range(max(0, offset - start), min(n.ntok, offset + count - start)):
            tid, label = p.token_ids[j], p.labels[j]
            tokens.append(TokenRow(start + j, tid, decode(tid) if decode else None, label != codec.IGNORE_LABEL,
                                   label, p.logprobs[j], n.version, gate_v - n.version, n.expert_key, nnum))
    hist = [0] * STALENESS_BUCKETS
    for v, ntok in layout.trained.items():
        hist[min(STALENESS_BUCKETS - 1, max(0, gate_v - v))] += ntok
    sh = cache.shape(key, ix)
    rows = tuple(_row(ix, layout.depth[n.id], n, sh, t, PATH_TEXT_CHARS)
                 for (n, _), t in zip(window, texts if nums else [], strict=True))
    return PathView(
        run=k.run, sid=sid, num=num, server_ms=_ms(now), gate_version=gate_v, nodes=rows,
        path_nodes=len(layout.nodes), tokens_total=layout.tokens, trained_total=sum(layout.trained.values()),
        offset=offset, count=count, tokens=tuple(tokens), turns=layout.turns, staleness=tuple(hist),
        tokenizer=tokenizer,
    )


__all__ = ["IndexCache", "PathShape", "Shape", "fork_of", "labels_of", "path_view", "session_view"]
