"""Value types of the data plane: nodes, segments, matches, turns, traces (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import codec


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
        """Decode an index record; raise ValueError on a malformed one."""
        parent, end, ntok, flags, version, expert_key = record.split(",", 5)
        node = cls(digest, parent or None, int(end), int(ntok), int(flags), int(version), expert_key or None)
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
    """The blake2b state after hashing ``text`` (a match's prefix); never updated in place.

    :func:`~tracestore.traces.lookup` leaves it on its :class:`PrefixMatch`
    so that :func:`~tracestore.traces.record_turn` continues the hash instead
    of hashing the prefix again. Pickled or copied without it (hashlib
    objects are neither): record_turn then hashes the prefix again.
    """

    __slots__ = ("text", "state")

    def __init__(self, text: str, state: Any = None) -> None:
        self.text = text
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        return (HashedPrefix, ("",))

    def continues(self, text_len: int, prompt_text: object) -> bool:
        """True when this state hashed exactly ``prompt_text[:text_len]`` and can be continued."""
        return (
            self.state is not None
            and len(self.text) == text_len
            and isinstance(prompt_text, str)
            and prompt_text.startswith(self.text)
        )


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
    _hashed: HashedPrefix | None = field(default=None, compare=False, repr=False)


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


__all__ = ["HashedPrefix", "Node", "PrefixMatch", "Segment", "Trace", "Turn"]
