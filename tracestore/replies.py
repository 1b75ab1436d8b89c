"""Decoding of Redis and script replies (pure core), kept apart from the operations.

Scripts answer flat arrays (``lua/*.lua`` headers give each layout); plain
commands answer what redis-py parses (bytes, lists, sometimes dicts). The
operations read them through these helpers instead of index arithmetic:

* :func:`text` — a reply item as ``str`` (bytes decoded as UTF-8);
* :class:`Reply` — a cursor over a flat script reply: ``r.int()``,
  ``r.text()``, ``r.texts(n)``, ``r.counted()`` (a count, then that many
  items), ``r.rest()``;
* :func:`field_map` and :func:`pairs` — HGETALL, XINFO, ZRANGE WITHSCORES
  replies (a dict, a flat list or a list of pairs) as pairs or a dict;
* :func:`stored` — decode stored values inside it: a value that does not
  decode (bad UTF-8, JSON or number) raises CorruptData naming its key.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .errors import CorruptData, ScriptError, TracestoreError


def text(x: Any) -> str:
    """A reply item as ``str``: bytes are decoded as UTF-8, anything else goes through ``str``."""
    return x.decode() if isinstance(x, bytes) else str(x)


def pairs(reply: Any) -> list[tuple[Any, Any]]:
    """A hash-like reply as ``[(field, value), ...]``: a dict, ``[[f, v], ...]`` or ``[f, v, ...]``."""
    if isinstance(reply, dict):
        return list(reply.items())
    if reply and isinstance(reply[0], (list, tuple)):
        return [(a, b) for a, b in reply]
    return [(reply[i], reply[i + 1]) for i in range(0, len(reply) - 1, 2)]


def field_map(reply: Any) -> dict[str, Any]:
    """A hash-like reply (see :func:`pairs`) as ``{field as str: raw value}``."""
    return {text(f): v for f, v in pairs(reply)}


class Reply:
    """A cursor over a flat reply: each read consumes items from the front.

    ``script`` names the script in the ScriptError raised when the reply is
    shorter than its layout says (a contract mismatch, never user error).
    """

    __slots__ = ("items", "pos", "script")

    def __init__(self, items: Sequence[Any], script: str = "reply") -> None:
        self.items = items
        self.pos = 0
        self.script = script

    def raw(self) -> Any:
        """The next item, undecoded."""
        if self.pos >= len(self.items):
            raise ScriptError(self.script, f"reply too short ({len(self.items)} items)")
        x = self.items[self.pos]
        self.pos += 1
        return x

    def int(self) -> builtins.int:
        """The next item as an int (an integer reply, or a number as text)."""
        return builtins.int(self.raw())

    def score(self) -> builtins.int:
        """The next item as an int from a zset score (``'1712.0'`` -> 1712)."""
        return builtins.int(float(self.raw()))

    def opt_int(self) -> builtins.int | None:
        """The next item as an int, None when negative (scripts send -1 for "none")."""
        v = self.int()
        return None if v < 0 else v

    def text(self) -> str:
        """The next item as str."""
        return text(self.raw())

    def flag(self) -> bool:
        """The next item as a bool (``1`` / ``0``)."""
        return bool(self.int())

    def texts(self, n: builtins.int) -> list[str]:
        """The next ``n`` items as str."""
        return [text(x) for x in self.take(n)]

    def take(self, n: builtins.int) -> list[Any]:
        """The next ``n`` items, undecoded."""
        if n < 0 or self.pos + n > len(self.items):
            raise ScriptError(self.script, f"reply too short for {n} more items")
        out = list(self.items[self.pos : self.pos + n])
        self.pos += n
        return out

    def counted(self) -> list[str]:
        """A count ``n`` then ``n`` items, as str."""
        return self.texts(self.int())

    def rest(self) -> list[Any]:
        """Every remaining item, undecoded."""
        out = list(self.items[self.pos :])
        self.pos = len(self.items)
        return out

    def rest_texts(self) -> list[str]:
        """Every remaining item, as str."""
        return [text(x) for x in self.rest()]

    def __len__(self) -> builtins.int:
        """Items not read yet."""
        return len(self.items) - self.pos


@contextmanager
def stored(key: str, field: str = "") -> Iterator[None]:
    """Decode values read from ``key`` inside this block; raise CorruptData (naming it) when one does not.

    Catches what decoding raises (ValueError, including UnicodeDecodeError and
    orjson's JSONDecodeError; TypeError; KeyError for a missing field); a
    TracestoreError raised inside passes unchanged.
    """
    try:
        yield
    except TracestoreError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptData(key, f"{type(exc).__name__}: {exc}", field) from None


__all__ = ["Reply", "field_map", "pairs", "stored", "text"]
