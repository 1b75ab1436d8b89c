"""Checks of caller input, run before any I/O (pure core): one rule and one bound per kind.

Every public operation validates its arguments with these functions first,
so bad input raises :class:`~tracestore.errors.InvalidId` or
:class:`~tracestore.errors.InvalidInput` (naming the field) and nothing is
sent, written or half-written.

The bounds, each in one place:

* **ids** — run ids ``[A-Za-z0-9._-]{1,64}``; key prefixes
  ``[A-Za-z0-9._-]{1,32}``; session ids, owner tags, group ids, task names,
  lease ids, holders, entrypoints, reasons: 1..200 printable ASCII
  characters without ``{``, ``}`` or whitespace (DESIGN section 3); a
  caller's op ids the same without ``#``, at most 128;
* **weight versions** — integers in ``0..MAX_VERSION`` (``2**53 - 1``):
  versions travel to Lua as numbers (doubles), are stored in zset scores
  and compared there, and ``2**53 - 1`` is the largest integer a double
  holds exactly, so nothing above it could be compared correctly. (The
  replay buffer packs ``min_version`` with a sequence number into one
  score and so allows a smaller range, :data:`tracestore.replay.MAX_VERSION`);
* **durations** — a number of seconds (int or float, finite), turned into
  whole milliseconds, at least 1 ms (or 0 where zero is meaningful) and at
  most :data:`MAX_DURATION_S` (366 days);
* **integer ranges** and **choices** — :func:`int_in` and :func:`one_of`
  with the bounds the caller states.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from .errors import InvalidId, InvalidInput

_RUN_RE = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]{1,32}\Z")
# Printable ASCII (0x21..0x7e) without braces: no whitespace, no hash-tag breakers.
_ID_RE = re.compile(r"[\x21-\x7a\x7c\x7e]{1,200}\Z")
# Many ids at once: joined by newlines (never part of an id), matched in one pass.
_IDS_RE = re.compile(r"(?:[\x21-\x7a\x7c\x7e]{1,200}\n)*\Z")
# An op id: as an id, without '#' (which joins an op id to its parts' names), at most 128.
_OP_ID_RE = re.compile(r"[\x21\x22\x24-\x7a\x7c\x7e]{1,128}\Z")
# A base URL of an HTTP service (an engine): the scheme, then printable ASCII without whitespace.
_URL_RE = re.compile(r"https?://[\x21-\x7e]+\Z")

#: Largest weight version: the largest integer a Lua number (double) holds exactly.
MAX_VERSION = 2**53 - 1
#: Longest duration any operation accepts (lease ttl, heartbeat ttl, retention, timeout).
MAX_DURATION_S = 366 * 86400

S = TypeVar("S", bound=str)


def is_run_id(value: object) -> bool:
    """True when ``value`` is a valid run id (``[A-Za-z0-9._-]{1,64}``)."""
    return isinstance(value, str) and bool(_RUN_RE.match(value))


def validate_run(run: str) -> str:
    """Return ``run`` if it is a valid run id (``[A-Za-z0-9._-]{1,64}``); else raise InvalidId."""
    if not is_run_id(run):
        raise InvalidId("run id", run, "must match [A-Za-z0-9._-]{1,64}")
    return run


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid key prefix (``[A-Za-z0-9._-]{1,32}``); else raise InvalidId."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise InvalidId("key prefix", prefix, "must match [A-Za-z0-9._-]{1,32}")
    return prefix


def validate_id(kind: str, value: str) -> str:
    """Validate a session id, owner tag, group id, task name or lease id; raise InvalidId.

    Rule: 1..200 bytes of printable ASCII without ``{``, ``}`` or whitespace.
    """
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidId(
            kind, value, "must be 1..200 printable ASCII characters without '{', '}' or whitespace"
        )
    return value


def validate_op_id(value: str) -> str:
    """Validate a caller's idempotency key (``op_id=``); raise InvalidId.

    Rule: 1..128 printable ASCII characters without ``{``, ``}``, ``#`` or
    whitespace (``#`` is reserved: it names the parts of a chunked call).
    A UUID, a ULID or ``"step-12/release"`` all qualify.
    """
    if not isinstance(value, str) or not _OP_ID_RE.match(value):
        raise InvalidId(
            "op id", value, "must be 1..128 printable ASCII characters without '{', '}', '#' or whitespace"
        )
    return value


def http_url(field: str, value: object, most: int) -> str:
    """``value`` if it is an ``http://`` or ``https://`` URL of at most ``most`` printable ASCII
    characters without whitespace (an engine's base URL); else InvalidInput naming ``field``."""
    if not isinstance(value, str) or len(value) > most or not _URL_RE.match(value):
        raise InvalidInput(
            field, f"must be an http:// or https:// URL of at most {most} printable characters, got {_short(value)}"
        )
    return value


def validate_ids(kind: str, values: Iterable[str]) -> list[str]:
    """Validate every id of ``values`` (a list, tuple or other iterable of ids); raise InvalidId.

    A str, bytes or mapping is refused, not iterated; so is anything that is
    not iterable (``None``, a number).
    """
    if isinstance(values, (str, bytes, bytearray)):
        raise InvalidId(kind, values, f"expected a list of {kind}s, got a single string")
    if isinstance(values, Mapping) or not isinstance(values, Iterable):
        raise InvalidId(kind, values, f"expected a list of {kind}s, got {type(values).__name__}")
    out = list(values)
    try:  # the common case, all valid, in one regex pass (a release of 10k ids is on a hot path)
        joined = "\n".join(out)
        # an id holding a newline would pass as two: the count of separators rules it out
        if joined.count("\n") == len(out) - 1 and _IDS_RE.match(joined + "\n" if out else ""):
            return out
    except TypeError:  # not all str: the loop below names the first bad one
        pass
    return [validate_id(kind, v) for v in out]


def int_in(field: str, value: object, lo: int, hi: int) -> int:
    """``value`` if it is an int (not a bool) in ``lo..hi``; else raise InvalidInput naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidInput(field, f"must be an integer in {lo}..{hi}, got {_short(value)}")
    return value


def version(field: str, value: object) -> int:
    """A weight version: an int in ``0..MAX_VERSION`` (see the module docstring); else InvalidInput."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VERSION:
        raise InvalidInput(
            field, f"weight version must be an integer in 0..2**53-1, got {_short(value)}"
        )
    return value


def duration_ms(field: str, seconds: object, *, allow_zero: bool = False) -> int:
    """``seconds`` as whole milliseconds: at least 1 ms (0 with ``allow_zero``), at most 366 days.

    Raises InvalidInput naming ``field`` for anything else (negative, NaN,
    infinite, a bool, not a number, below 1 ms once rounded, above the bound).
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidInput(field, f"must be a number of seconds, got {_short(seconds)}")
    if (isinstance(seconds, float) and not math.isfinite(seconds)) or seconds < 0 or (
        seconds == 0 and not allow_zero
    ):
        raise InvalidInput(
            field, f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {_short(seconds)}"
        )
    if seconds > MAX_DURATION_S:  # (before the product: an int too large for a float overflows)
        raise InvalidInput(field, f"must be at most 366 days, got {_short(seconds)} s")
    ms = round(seconds * 1000)
    if ms < 1 and not allow_zero:
        raise InvalidInput(field, f"must be at least 1 ms, got {seconds!r} s")
    return ms


def _short(value: object) -> str:
    """``repr(value)``, cut to 40 characters (a 400-digit int stays readable)."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def one_of(field: str, value: S, allowed: Sequence[str]) -> S:
    """``value`` if it is one of ``allowed``; else raise InvalidInput listing them."""
    if not isinstance(value, str) or value not in allowed:
        raise InvalidInput(field, f"must be one of {', '.join(allowed)}; got {_short(value)}")
    return value


__all__ = [
    "MAX_DURATION_S",
    "MAX_VERSION",
    "duration_ms",
    "http_url",
    "int_in",
    "is_run_id",
    "one_of",
    "validate_id",
    "validate_ids",
    "validate_op_id",
    "validate_prefix",
    "validate_run",
    "version",
]
