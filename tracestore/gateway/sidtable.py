"""A fixed-size table of session ids a gateway process has seen: memory that does not grow with the sessions.

A gateway remembers two things per session to save a round trip: that it has
opened the session (``open_once``) and which engine the session last ran on
(the lease's route hint). Both were LRU dicts of the session ids, ~185 bytes
a session each (the id's string, the dict's entry and the order's link), so a
gateway's memory grew with every session it served, up to their bound of
200,000 sessions (~37 MB per dict).

:class:`SidTable` keeps instead one 64-bit digest of the id per slot of a
direct-mapped table of fixed size (:data:`SLOTS` slots, 2 MB; a value table
beside it when one is kept): a session takes the slot its digest picks, and a
session whose digest picks the same slot later takes it over. Forgetting is
therefore what a full LRU did, at random rather than oldest first; both uses
only lose a round trip by it (an open of an open session is a no-op; a wrong
route hint is only a hint). Two ids share a digest with probability 2^-64
(Python's SipHash of the string, per process): the table then answers for
the other, which neither use can tell from a correct answer.
"""

from __future__ import annotations

from array import array

#: Slots of a table (a power of two): 2 MB of digests.
SLOTS = 1 << 18


class SidTable:
    """Session ids seen by this process, in :data:`SLOTS` slots; ``values``: keep a small int
    (0 to 32,767) per session too (:meth:`get` / :meth:`put`)."""

    __slots__ = ("_digests", "_mask", "_values")

    def __init__(self, slots: int = SLOTS, values: bool = False) -> None:
        if slots <= 0 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, not {slots}")
        self._mask = slots - 1
        self._digests = array("q", bytes(8 * slots))
        self._values = array("h", bytes(2 * slots)) if values else None

    @staticmethod
    def _digest(sid: str) -> int:
        return hash(sid) or 1  # 0 marks an empty slot

    def __contains__(self, sid: object) -> bool:
        if not isinstance(sid, str):
            return False
        d = self._digest(sid)
        return self._digests[d & self._mask] == d

    def add(self, sid: str) -> None:
        """Remember ``sid`` (it may take over the slot of another session)."""
        d = self._digest(sid)
        self._digests[d & self._mask] = d

    def put(self, sid: str, value: int) -> None:
        """Remember ``sid`` with ``value`` (a table made with ``values=True``)."""
        if self._values is None:
            raise TypeError("this SidTable keeps no values (made without values=True)")
        d = self._digest(sid)
        at = d & self._mask
        self._digests[at] = d
        self._values[at] = value

    def get(self, sid: str) -> int | None:
        """The value kept with ``sid``, None when the table does not know it."""
        if self._values is None:
            raise TypeError("this SidTable keeps no values (made without values=True)")
        d = self._digest(sid)
        at = d & self._mask
        return self._values[at] if self._digests[at] == d else None

    def discard(self, sid: str) -> None:
        """Forget ``sid`` (nothing when the table does not know it)."""
        d = self._digest(sid)
        at = d & self._mask
        if self._digests[at] == d:
            self._digests[at] = 0

    @property
    def nbytes(self) -> int:
        """The table's memory in bytes (fixed at construction)."""
        n = self._digests.itemsize * len(self._digests)
        return n + (self._values.itemsize * len(self._values) if self._values is not None else 0)


__all__ = ["SLOTS", "SidTable"]
