"""Value types of the data plane: nodes, segments, matches, turns, traces (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import codec, validate
from .tokens import TokenIds


@dataclass(frozen=True)
class Node:
    """One stored node of a session trie (its index record, not its tokens).

    ``id``: the node id, 16 hex characters: the first 64 bits of the
    blake2b-128 digest of the node's key text; ``parent``: the
    parent's id (None at the root); ``end``: length of the key in characters;
    ``ntok``: tokens in the segment; ``flags``: :mod:`codec` label flags;
    ``version``: weight version that produced the segment; ``expert_key``:
    routed-experts reference key or None; ``wid``: the write id of the call
    that stored it (8 hex characters; '' before it is stored, and in records
    written before write ids; not compared by ``==``, see :meth:`same_write`).
    A store that rolls back (failover to a lagging replica, a restored
    checkpoint) may store a node of the same id again with other tokens,
    never under the same write id (docs/traces.md).
    """

    id: str
    parent: str | None
    end: int
    ntok: int
    flags: int
    version: int
    expert_key: str | None
    wid: str = field(default="", compare=False)

    def same_write(self, other: Node | None) -> bool:
        """True when ``other`` is this node as stored by the same write (equal and the same ``wid``).

        ``==`` compares what a node is (its record), not which write stored it:
        two stores of the same turn give equal nodes. A cached payload or
        checkpoint of a node is valid only for the same write.
        """
        return other is not None and other == self and other.wid == self.wid

    @property
    def generated(self) -> bool:
        """True when the segment's labels are its token ids (model output)."""
        return bool(self.flags & codec.GENERATED)

    @property
    def fork(self) -> str | None:
        """Why this node starts a branch (``client_edit``, ``template``), None when it does not."""
        return codec.fork_reason(self.flags)

    def fields(self) -> str:
        """The record fields after the node numbers: ``end,ntok,flags,version,expert_key``.

        The stored index record is ``num.wid,parent_num,`` followed by these;
        the numbers are given by the write script (docs/traces.md, Keys).
        """
        return f"{self.end},{self.ntok},{self.flags},{self.version},{self.expert_key or ''}"

    @classmethod
    def parse(cls, digest: str, parent: str | None, fields: str, wid: str = "") -> Node:
        """Decode :meth:`fields` of node ``digest`` under ``parent``, stored by write ``wid``; ValueError on malformed ones."""
        end, ntok, flags, version, expert_key = fields.split(",", 4)
        node = cls(digest, parent, int(end), int(ntok), int(flags), int(version), expert_key or None, wid)
        if node.end < 0 or node.ntok < 0 or node.version < 0:
            raise ValueError("negative end, token count or version")
        return node


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


class HashedPrefix:
    """What :func:`~tracestore.traces.lookup` knew at a match's end; never updated in place.

    ``source[:end]`` is the matched prefix (``source`` is the looked-up
    prompt itself: no copy), ``state`` the blake2b state after hashing it,
    ``ids`` the prefix's token ids as lookup read them in data epoch
    ``epoch``. :func:`~tracestore.traces.record_turn` continues the hash
    instead of hashing the prefix again, and extends ``ids`` into the
    session's continuation (a caller cannot forge them: ``PrefixMatch.token_ids``
    is not trusted for that). Pickled or copied without it (hashlib objects
    are neither): record_turn then hashes the prefix again.
    """

    __slots__ = ("source", "end", "state", "ids", "epoch")

    def __init__(
        self, source: str, end: int, state: Any = None, ids: TokenIds | None = None, epoch: str = ""
    ) -> None:
        self.source = source
        self.end = end
        self.state = state
        self.ids = ids
        self.epoch = epoch

    def __reduce__(self) -> tuple[Any, ...]:
        return (HashedPrefix, ("", -1))

    def continues(self, text_len: int, prompt_text: object) -> bool:
        """True when this state hashed exactly ``prompt_text[:text_len]`` and can be continued."""
        if self.state is None or self.end != text_len or not isinstance(prompt_text, str):
            return False
        if prompt_text is self.source:
            return True
        src = self.source
        return prompt_text.startswith(src if len(src) == self.end else src[: self.end])


@dataclass(frozen=True)
class PrefixMatch:
    """The longest stored key that prefixes a text.

    ``text_len``: characters matched (0 = nothing); ``token_ids``: the token
    ids of the whole matched prefix (a :class:`~tracestore.traces.TokenIds`:
    list-like, read-only, no copy; ``.tolist()`` for a list; any sequence
    given here is converted); ``node``: the matched node (None when
    nothing matched); ``path``: nodes from the root to ``node``;
    ``segments``: one per node of ``path`` (filled by :func:`search` only);
    ``extended``: a stored node continues the match (``node`` has a child;
    with nothing matched, the session has nodes), so a turn recorded on it
    starts a new branch (filled by :func:`lookup` only).
    Pass it back as ``record_turn(..., prefix=match)``.
    """

    text_len: int
    token_ids: TokenIds
    node: Node | None
    path: tuple[Node, ...] = ()
    segments: tuple[Segment, ...] = ()
    extended: bool = False
    # Set by lookup(): the hash state at the matched end, so that record_turn
    # need not hash the prefix again.
    _hashed: HashedPrefix | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, TokenIds):
            object.__setattr__(self, "token_ids", TokenIds(self.token_ids))


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

    def stale_mask(self, current_version: int, max_staleness: int) -> list[bool]:
        """Per token: True where a trained token is stale, for a decoupled (AReaL-style) objective.

        A token is stale when it is trained on (label != -100) and was
        generated by weights older than ``current_version - max_staleness``
        (``current_version - version > max_staleness``); prompt tokens are
        never stale. A learner that trains on a partly stale trace drops
        those tokens from its loss (``loss_mask & ~stale``) or weights them
        with its behaviour-policy correction. Raises InvalidInput on a
        version or bound that is not an integer in 0..2**53-1.
        """
        cutoff = validate.version("current_version", current_version) - validate.version(
            "max_staleness", max_staleness
        )
        return [
            label != codec.IGNORE_LABEL and v < cutoff
            for label, v in zip(self.labels, self.versions, strict=True)
        ]


__all__ = ["HashedPrefix", "Node", "PrefixMatch", "Segment", "Trace", "Turn"]
