"""Per-session continuation state: where this client's last turn ended (pure, no I/O).

A session's next prompt almost always extends the text of its last stored
turn. After :func:`~tracestore.traces.record_turn`, the client keeps, per
session, the texts of that turn (prompt, response) and a *checkpoint* at
each stored node of it: the node, the blake2b state after hashing its key,
and the token ids of its path (a :class:`~tracestore.traces.tokens.TokenIds`
view). :func:`~tracestore.traces.lookup` compares the new prompt with those
texts (memory compares, no hashing), hashes only the bytes after the
deepest checkpoint the prompt extends, and returns the checkpoint's ids
extended by the nodes after it: O(new text + new tokens) of client work per
turn instead of O(context).

A checkpoint is trusted only while it is provably current: it belongs to one
data epoch of the session (a purge and reopen starts another, whose nodes
may have other tokens under the same keys), and its node must be in the
index the server just confirmed. Nodes are immutable within an epoch, so a
checkpoint that passes both checks is exact; anything else falls back to
hashing the whole prompt.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .tokens import TokenIds
from .types import Node


class Checkpoint(NamedTuple):
    """A stored node on the continuation text, with the hash state and token ids at its end.

    (This and :class:`Continuation` are named tuples: immutable, and built per turn
    without a frozen dataclass's ``object.__setattr__`` per field.)
    """

    node: Node
    #: blake2b state after hashing the node's key (copied before any update, never changed).
    state: Any
    #: Token ids of the path from the root to ``node``.
    ids: TokenIds


class Continuation(NamedTuple):
    """The text of a session's last recorded turn and its checkpoints (shallowest first).

    ``pieces`` concatenated are the text every checkpoint's key is a prefix
    of (the prompt and the response, kept as the caller's strings: no copy).
    """

    epoch: str
    pieces: tuple[str, ...]
    checkpoints: tuple[Checkpoint, ...]

    def base_for(self, text: str) -> Checkpoint | None:
        """The deepest checkpoint whose key is a prefix of ``text`` (text compares only; the last
        answer is kept, since a turn asks it twice of one key: its digest, then its lookup)."""
        global _LAST
        last = _LAST
        if last[0] is self and last[1] is text:  # both immutable: the same answer
            return last[2]
        found = None
        for cp in self.checkpoints[::-1]:
            if _starts_with(text, self.pieces, cp.node.end):
                found = cp
                break
        _LAST = (self, text, found)
        return found

    @property
    def nbytes(self) -> int:
        """Approximate memory held (its size in the node cache)."""
        ids = max((len(cp.ids) for cp in self.checkpoints), default=0)
        return 200 * (1 + len(self.checkpoints)) + sum(map(len, self.pieces)) + 4 * ids


#: :meth:`Continuation.base_for`'s last (continuation, text, answer): one tuple, replaced whole.
_LAST: tuple[Any, Any, Checkpoint | None] = (None, None, None)


def _starts_with(text: str, pieces: tuple[str, ...], end: int) -> bool:
    """True when ``text[:end] == "".join(pieces)[:end]``, without building either."""
    if len(text) < end:
        return False
    off = 0
    for p in pieces:
        if off >= end:
            break
        take = min(len(p), end - off)
        if not text.startswith(p if take == len(p) else p[:take], off):
            return False
        off += take
    return off >= end


def cont_key(sid: str) -> tuple[str, str]:
    """Cache key of a session's continuation."""
    return ("cont", sid)


__all__ = ["Checkpoint", "Continuation", "cont_key"]
