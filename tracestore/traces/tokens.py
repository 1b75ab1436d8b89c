"""Token ids of a matched prefix without copying them (pure, no I/O).

A session's prefix grows by a few dozen tokens a turn while it is tens of
thousands long; building a Python list of it every turn made the client's
cost grow with the context. :class:`TokenIds` is an immutable sequence of
int32 ids that views the first ``n`` items of an append-only ``array('i')``:
extending a prefix appends to the array it views when nobody has appended
there yet (or appended the same ids), so a turn costs O(new tokens), and the
prefix of the next turn shares the buffer. A list is built only on demand
(:meth:`TokenIds.tolist`, ``list(ids)``).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, overload

from .. import codec

# Guards the append-only buffers: whoever extends a buffer first owns its tail.
_EXTEND = threading.Lock()
_Array = array  # (inside TokenIds, ``array`` names its method)


def _int32(values: Iterable[int]) -> array:  # type: ignore[type-arg]
    if isinstance(values, TokenIds):
        return values.array()
    if isinstance(values, array) and values.typecode == "i":
        return values
    return array("i", values)


class TokenIds(Sequence[int]):
    """An immutable sequence of token ids (int32), backed by a shared array.

    Behaves like a read-only list: ``len``, indexing, slicing (a
    ``TokenIds``; a prefix slice is a view, no copy), iteration, ``==``
    with any list, tuple or array of ints. ``ids + more`` is a new
    ``TokenIds`` (O(len(more)) when ``ids`` is the longest view of its
    buffer). ``tolist()`` and ``array()`` copy; ``numpy.asarray(ids)``
    makes an int32 array. Raises OverflowError/TypeError (from ``array``)
    when built from values that are not int32.
    """

    __slots__ = ("_buf", "_n")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        buf = ids.array() if isinstance(ids, TokenIds) else array("i", ids)  # never aliases
        self._buf = buf
        self._n = len(buf)

    @classmethod
    def _view(cls, buf: array, n: int) -> TokenIds:  # type: ignore[type-arg]
        out = cls.__new__(cls)
        out._buf = buf
        out._n = n
        return out

    @classmethod
    def frombytes(cls, data: bytes) -> TokenIds:
        """Ids packed as little-endian int32 (a node payload's id part); no per-item work."""
        a = array("i")
        a.frombytes(data)
        if codec._BIG_ENDIAN:
            a.byteswap()
        return cls._view(a, len(a))

    # -- the sequence -----------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> TokenIds: ...

    def __getitem__(self, i: int | slice) -> int | TokenIds:
        n = self._n
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if start == 0 and step == 1:
                return TokenIds._view(self._buf, max(stop, 0))
            # (i.indices clamps to n: a forward slice reads only its items, not a copy of the view)
            part = self._buf[start:stop:step] if step > 0 else self._buf[:n][i]
            return TokenIds._view(part, len(part))
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token id index out of range")
        return int(self._buf[i])

    def __iter__(self) -> Iterator[int]:
        return islice(self._buf, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._n == other._n and (
                self._buf is other._buf or self.array() == other.array()
            )
        if isinstance(other, (list, tuple)):
            return self._n == len(other) and self.tolist() == list(other)
        if isinstance(other, array):
            return self._n == len(other) and self.array() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.array().tobytes())

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenIds.frombytes, (codec._le(self.array()),))

    # -- copies, on demand ------------------------------------------------------------------

    def tolist(self) -> list[int]:
        """The ids as a new list (O(n) Python ints: only when a list is really needed)."""
        return self._buf[: self._n].tolist()

    def array(self) -> array:  # type: ignore[type-arg]
        """The ids as a new ``array('i')`` (one memory copy)."""
        return self._buf[: self._n]

    def shared(self) -> tuple[_Array[int], int]:
        """The buffer this view shares and its length: the ids are ``buffer[:length]``. The buffer
        may hold more ids after them (other views'), and only ever grows at its end: read it,
        never write to it."""
        return self._buf, self._n

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy as np  # only ever called by numpy itself

        out = np.frombuffer(self.array(), dtype=np.int32)
        return out if dtype is None else out.astype(dtype)

    # -- growing --------------------------------------------------------------------------

    def __add__(self, other: object) -> TokenIds:
        if not isinstance(other, (TokenIds, list, tuple, array)):
            return NotImplemented
        return self.extended(other)

    def __radd__(self, other: object) -> list[int]:
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return [*other, *self.tolist()]

    def extended(self, more: Iterable[int]) -> TokenIds:
        """These ids followed by ``more``, sharing this buffer when possible.

        O(len(more)) when no other view has appended different ids to the
        buffer after this one's end; otherwise this prefix is copied once
        into a new buffer (a branch). Views already handed out never change.
        """
        add = _int32(more)
        if not add:
            return self
        k = len(add)
        n = self._n
        with _EXTEND:
            buf = self._buf
            tail = len(buf) - n
            if tail == 0:
                try:
                    buf.extend(add)
                    return TokenIds._view(buf, n + k)
                except BufferError:  # someone holds a memoryview of it: branch off
                    pass
            else:
                same = min(tail, k)
                if buf[n : n + same] == add[:same]:
                    if same == k:  # these very ids are already there
                        return TokenIds._view(buf, n + k)
                    try:
                        buf.extend(add[same:])
                        return TokenIds._view(buf, n + k)
                    except BufferError:
                        pass
            fresh = buf[:n]
            fresh.extend(add)
            return TokenIds._view(fresh, n + k)


def token_ids(ids: Sequence[int]) -> TokenIds:
    """``ids`` as :class:`TokenIds` (itself when it already is one)."""
    return ids if isinstance(ids, TokenIds) else TokenIds(ids)


__all__ = ["TokenIds", "token_ids"]
