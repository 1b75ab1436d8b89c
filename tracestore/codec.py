"""Packed token payloads of trace nodes (pure core, no I/O).

A node payload is ``ntok`` little-endian int32 token ids, then ``ntok``
little-endian float32 logprobs, then, only when the node's labels cannot be
derived from its flags, ``ntok`` little-endian int32 labels. That is 8 bytes
per token (the floor the memory goal is measured against), 12 with explicit
labels. Nothing here pickles: payloads are plain arrays.

Labels are derived from the flags when possible:

* no flag: every label is -100 (prompt tokens, not trained on);
* :data:`GENERATED`: label = token id (tokens the policy produced);
* :data:`EXPLICIT_LABELS`: the labels are stored after the logprobs.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import InvalidInput

#: Flag bit: the node's labels equal its token ids (a generated segment).
GENERATED = 1
#: Flag bit: explicit int32 labels follow the logprobs in the payload.
EXPLICIT_LABELS = 2
#: Flag bits saying why a node starts a branch of its own (token-exact traces, DESIGN section 14):
#: the client changed, dropped or reordered earlier messages (``client_edit``), or, in
#: ``template`` mode, the template rendered the history differently (``template``). A node
#: without them extends its parent's path as every turn does.
FORK_CLIENT_EDIT = 4
FORK_TEMPLATE = 8
#: Fork reasons by flag bit, and the bits of every reason.
FORK_REASONS = {FORK_CLIENT_EDIT: "client_edit", FORK_TEMPLATE: "template"}
FORK_FLAGS = FORK_CLIENT_EDIT | FORK_TEMPLATE
KNOWN_FLAGS = GENERATED | EXPLICIT_LABELS | FORK_FLAGS


def fork_flag(reason: str | None) -> int:
    """The flag bit of fork ``reason`` (0 for None); InvalidInput for an unknown reason."""
    if reason is None:
        return 0
    for bit, name in FORK_REASONS.items():
        if name == reason:
            return bit
    raise InvalidInput("fork", f"unknown fork reason {reason!r}; one of {sorted(FORK_REASONS.values())}")


def fork_reason(flags: int) -> str | None:
    """The fork reason a node's ``flags`` carry (None: no fork)."""
    for bit, name in FORK_REASONS.items():
        if flags & bit:
            return name
    return None

#: The label of a token that is not trained on.
IGNORE_LABEL = -100

_INT32_MAX = 2**31 - 1
_BIG_ENDIAN = sys.byteorder == "big"
_POS_INF = math.inf

assert array("i").itemsize == 4 and array("f").itemsize == 4, "int32/float32 arrays required"


def _le(a: array) -> bytes:  # type: ignore[type-arg]
    if _BIG_ENDIAN:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_le(typecode: str, data: bytes) -> array:  # type: ignore[type-arg]
    a = array(typecode)
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def int32_array(field: str, values: Iterable[int], *, non_negative: bool) -> array:  # type: ignore[type-arg]
    """``values`` as an int32 array; InvalidInput(field) if not int32 (or negative)."""
    if isinstance(values, (str, bytes)):
        raise InvalidInput(field, "expected a sequence of integers, got a string")
    try:
        a = array("i", values)
    except OverflowError:
        raise InvalidInput(field, "every value must fit in int32") from None
    except TypeError as exc:
        raise InvalidInput(field, f"expected integers ({exc})") from None
    if non_negative and a and min(a) < 0:
        raise InvalidInput(field, "token ids must be non-negative")
    return a


def float32_logprobs(field: str, values: Iterable[float]) -> array:  # type: ignore[type-arg]
    """``values`` as a float32 array; InvalidInput(field) on NaN or +inf (-inf is allowed).

    -0.0 is stored as 0.0: equal logprobs must pack to equal bytes, or a node
    rewritten with an equal payload would raise NodeConflict.
    """
    if isinstance(values, (str, bytes)):
        raise InvalidInput(field, "expected a sequence of floats, got a string")
    try:
        a = array("f", values)
    except (TypeError, OverflowError) as exc:
        raise InvalidInput(field, f"expected floats ({exc})") from None
    for i, x in enumerate(a):
        # x != x is NaN; a finite double too large for float32 becomes +inf here.
        if x != x or x == _POS_INF:
            raise InvalidInput(field, f"logprobs must be finite or -inf, got {x}")
        if x == 0.0:
            a[i] = 0.0  # -0.0 == 0.0, and must pack the same
    return a


def labels_array(field: str, values: Iterable[int]) -> array:  # type: ignore[type-arg]
    """Labels as int32: each is -100 or a non-negative token id."""
    a = int32_array(field, values, non_negative=False)
    for x in a:
        if x < 0 and x != IGNORE_LABEL:
            raise InvalidInput(field, f"labels must be -100 or a token id, got {x}")
    return a


def derive_flags(ids: array, labels: array | None, *, generated: bool) -> int:  # type: ignore[type-arg]
    """Flags for a node: GENERATED, none, or EXPLICIT_LABELS when not derivable."""
    if labels is None:
        return GENERATED if generated else 0
    if len(labels) != len(ids):
        raise InvalidInput("labels", f"{len(labels)} labels for {len(ids)} token ids")
    if labels == ids:
        return GENERATED
    if all(x == IGNORE_LABEL for x in labels):
        return 0
    return EXPLICIT_LABELS


def pack(ids: array, logprobs: array, labels: array | None, flags: int) -> bytes:  # type: ignore[type-arg]
    """Pack a payload; ``labels`` is written only with the EXPLICIT_LABELS flag."""
    if len(ids) != len(logprobs):
        raise InvalidInput("logprobs", f"{len(logprobs)} logprobs for {len(ids)} token ids")
    out = _le(ids) + _le(logprobs)
    if flags & EXPLICIT_LABELS:
        if labels is None or len(labels) != len(ids):
            raise InvalidInput("labels", "explicit labels must match the token ids in length")
        out += _le(labels)
    return out


def payload_size(ntok: int, flags: int) -> int:
    """Size in bytes of a payload of ``ntok`` tokens with ``flags``."""
    return ntok * (12 if flags & EXPLICIT_LABELS else 8)


@dataclass(frozen=True)
class Payload:
    """A decoded node payload (immutable: safe to share from the node cache)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    labels: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Approximate memory held (for the cache's byte budget)."""
        return 64 + 3 * (56 + 8 * len(self.token_ids)) + 60 * len(self.token_ids)


def unpack(data: bytes, ntok: int, flags: int) -> Payload:
    """Decode a payload written by :func:`pack`; raise InvalidInput if its size is wrong."""
    if flags & ~KNOWN_FLAGS:
        raise InvalidInput("flags", f"unknown flag bits {flags}")
    want = payload_size(ntok, flags)
    if len(data) != want:
        raise InvalidInput("payload", f"{len(data)} bytes, expected {want} for {ntok} tokens")
    n4 = 4 * ntok
    ids = tuple(_from_le("i", data[:n4]))
    lps = tuple(_from_le("f", data[n4 : 2 * n4]))
    if flags & EXPLICIT_LABELS:
        labels = tuple(_from_le("i", data[2 * n4 :]))
    elif flags & GENERATED:
        labels = ids
    else:
        labels = (IGNORE_LABEL,) * ntok
    return Payload(ids, lps, labels)


def as_labels(values: Sequence[int] | None) -> array | None:  # type: ignore[type-arg]
    """Validated labels array, or None."""
    return None if values is None else labels_array("labels", values)
