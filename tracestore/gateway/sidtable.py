"""A fixed-size table of session ids a gateway process has seen: memory that does not grow with the sessions.

A gateway remembers two things per session to save a round trip: that it has
opened the session (``open_once``) and which engine the session last ran on
(the lease's route hint). Both were LRU dicts of the session ids, ~185 bytes
a session each (the id's string, the dict's entry and the order's link), so a
gateway's memory grew with every session it served, up to their bound of
200,000 sessions (~37 MB per dict).

:class:`SidTable` keeps instead one 64-bit digest of the id per slot of a
table of fixed size (:data:`SLOTS` slots, 2 MB; a value table beside it when
one is kept), in sets of :data:`WAYS` slots: a session's digest picks its set,
and a session new to a full set takes the slot of the set's oldest. So a
session is forgotten only when :data:`WAYS` newer ones arrived in its set:
sessions in use at once keep their slots until they are many (10,000 in
65,536 sets: about 1 set in 1.6 million has more than 4; 50,000: ~1 in 900),
and past that the table forgets at random as a full LRU forgot its oldest
(direct-mapped, one slot per digest, two sessions in use in one slot forgot
each other every turn: ~4% of 10,000 sessions shared a slot). Both uses
only lose a round trip by it (an open of an open session is a no-op; an
unknown route is only a missing hint: the lease then names no engine, as on
a session's first turn). Two ids share a digest with probability 2^-64
(Python's SipHash of the string, keyed per process): the table then answers
for the other.
"""

from __future__ import annotations

from array import array

#: Slots of a table (a power of two): 2 MB of digests.
SLOTS = 1 << 18
#: Slots of a set (the sessions a set remembers at once).
WAYS = 4


class SidTable:
    """Session ids seen by this process, in :data:`SLOTS` slots (sets of :data:`WAYS`); ``values``:
    keep a small int (0 to 32,767) per session too (:meth:`get` / :meth:`put`)."""

    __slots__ = ("_digests", "_mask", "_values")

    def __init__(self, slots: int = SLOTS, values: bool = False) -> None:
        if slots < WAYS or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two of at least {WAYS}, not {slots}")
        self._mask = slots // WAYS - 1
        self._digests = array("q", bytes(8 * slots))
        self._values = array("h", bytes(2 * slots)) if values else None

    @staticmethod
    def _digest(sid: str) -> int:
        return hash(sid) or 1  # 0 marks an empty slot

    def _find(self, d: int) -> int:
        """The slot holding digest ``d``, or -1."""
        b = (d & self._mask) * WAYS
        ds = self._digests
        for at in range(b, b + WAYS):
            if ds[at] == d:
                return at
        return -1

    def _take(self, d: int) -> int:
        """The slot of ``d``: its own, else the first of its set (the others move down one, the
        oldest leaves)."""
        at = self._find(d)
        if at >= 0:
            return at
        b = (d & self._mask) * WAYS
        ds = self._digests
        ds[b + 1 : b + WAYS] = ds[b : b + WAYS - 1]
        if self._values is not None:
            self._values[b + 1 : b + WAYS] = self._values[b : b + WAYS - 1]
        ds[b] = d
        return b

    def __contains__(self, sid: object) -> bool:
        return isinstance(sid, str) and self._find(self._digest(sid)) >= 0

    def add(self, sid: str) -> None:
        """Remember ``sid`` (a set's oldest session may be forgotten for it)."""
        self._take(self._digest(sid))

    def put(self, sid: str, value: int) -> None:
        """Remember ``sid`` with ``value`` (a table made with ``values=True``)."""
        if self._values is None:
            raise TypeError("this SidTable keeps no values (made without values=True)")
        self._values[self._take(self._digest(sid))] = value

    def get(self, sid: str) -> int | None:
        """The value kept with ``sid``, None when the table does not know it."""
        if self._values is None:
            raise TypeError("this SidTable keeps no values (made without values=True)")
        at = self._find(self._digest(sid))
        return self._values[at] if at >= 0 else None

    def discard(self, sid: str) -> None:
        """Forget ``sid`` (nothing when the table does not know it)."""
        at = self._find(self._digest(sid))
        if at >= 0:
            self._digests[at] = 0

    @property
    def nbytes(self) -> int:
        """The table's memory in bytes (fixed at construction)."""
        n = self._digests.itemsize * len(self._digests)
        return n + (self._values.itemsize * len(self._values) if self._values is not None else 0)


__all__ = ["SLOTS", "WAYS", "SidTable"]
