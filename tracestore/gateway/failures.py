"""One table from what went wrong in a turn to (HTTP error, lease outcome, metric).

Every failure of a turn, wherever it happens (admission, the engine call,
the record), goes through :func:`classify`: the HTTP error the client gets
(in its wire format's shape), the outcome its gate lease is settled with,
and the metric that counts it. The outcome follows what is *known* about the
request (DESIGN section 6): ``failed`` when the engine provably did not
generate for it or nothing was recorded, ``aborted`` when the gateway or a
weight update stopped it, ``unknown`` when the engine may have run it and we
cannot tell (the gate is then poisoned until someone resolves the lease). A
lost engine connection is ``unknown`` in the table; the turn first asks the
engine (``Engine.stopped``) and settles ``aborted`` when the request provably
runs no more (:mod:`.turn`, :mod:`.holds`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import (
    GateSealed,
    InvalidInput,
    NodeConflict,
    PrefixChanged,
    SessionReleased,
    SessionRetired,
    TracestoreError,
)
from ..gate import DEFAULT_RETRY_AFTER_MS
from .chat import ApiError, invalid
from .engines import EngineLost, EngineRefused, EngineRejected


class TurnAborted(Exception):
    """The turn was stopped by the gateway (``reason``: ``weight_update``, ``engine_abort``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the request was aborted ({reason})")
        self.reason = reason


class Unrecordable(Exception):
    """The answer cannot be recorded as a turn (the store refused it as invalid input)."""


@dataclass(frozen=True)
class Failure:
    """What a failed turn answers and settles: ``error`` (the HTTP error), ``outcome`` (the
    lease's), ``metric`` (``(counter, label)`` of :class:`~.metrics.Metrics`, or None)."""

    error: ApiError
    outcome: str
    metric: tuple[str, str] | None = None


def _engine_rejected(e: Any) -> ApiError:
    if 400 <= e.status < 500:
        return invalid(f"the engine refused the request: {e.detail}")
    return ApiError("bad_gateway", str(e), code="engine_error")


def _aborted(e: Any) -> ApiError:
    return ApiError(
        "unavailable",
        "the request was aborted for a weight update; retry",
        retry_after_s=DEFAULT_RETRY_AFTER_MS / 1000,
        code="aborted",
    )


def _sealed(e: Any) -> ApiError:
    return ApiError(
        "unavailable",
        f"weights are being updated (gate sealed at version {e.version}); retry",
        retry_after_s=e.retry_after_ms / 1000,
        code="gate_sealed",
    )


def _gone(kind: str) -> Callable[[Any], ApiError]:
    def make(e: Any) -> ApiError:
        return ApiError("gone", f"session {getattr(e, 'sid', '?')!r} was {kind}: start a new session", code=f"session_{kind}")

    return make


def _code(kind: str, code: str, message: str) -> Callable[[Any], ApiError]:
    return lambda e: ApiError(kind, message.format(e=e), code=code)


@dataclass(frozen=True)
class Row:
    """One line of :data:`TABLE`: exceptions of ``kind`` settle ``outcome``, count ``metric``
    and answer ``error(exc)``."""

    kind: type[BaseException]
    outcome: str
    error: Callable[[Any], ApiError]
    metric: tuple[str, str] | None = None


#: First match wins, so order matters (PrefixChanged is an InvalidInput; every store error is a
#: TracestoreError). docs/gateway.md's error table is this table.
TABLE: tuple[Row, ...] = (
    Row(ApiError, "failed", lambda e: e),
    Row(TurnAborted, "aborted", _aborted),
    Row(EngineRefused, "failed", _code("bad_gateway", "engine_unreachable", "{e}"), ("engine_errors", "refused")),
    Row(EngineLost, "unknown", _code("bad_gateway", "engine_lost", "{e}"), ("engine_errors", "lost")),
    Row(EngineRejected, "failed", _engine_rejected, ("engine_errors", "rejected")),
    Row(NodeConflict, "failed", _code("conflict", "node_conflict", "this turn is already recorded with other tokens ({e}); retry")),
    Row(
        PrefixChanged,
        "failed",
        _code("conflict", "prefix_changed", "the conversation's stored prefix changed while this turn ran ({e}); retry"),
    ),
    Row(
        Unrecordable,
        "failed",
        _code(
            "internal",
            "unrecordable_turn",
            "the turn cannot be recorded: {e} (does the chat template re-render earlier turns "
            "differently once an answer is added? see docs/gateway.md)",
        ),
    ),
    Row(SessionRetired, "aborted", _gone("retired"), ("gone", "retired")),
    Row(SessionReleased, "aborted", _gone("released"), ("gone", "released")),
    Row(GateSealed, "aborted", _sealed, ("sealed", "gate_sealed")),
    Row(InvalidInput, "failed", lambda e: invalid(str(e), getattr(e, "field", None))),
    Row(
        TracestoreError,
        "failed",
        lambda e: ApiError(
            "unavailable",
            # an outcome-unknown error's own text is Python-API advice (op ids): say what an HTTP client does
            f"the trace store did not answer ({type(e).__name__}: {getattr(e, 'reason', e)}); retry the request",
            retry_after_s=1.0,
        ),
    ),
)


def classify(exc: BaseException) -> Failure | None:
    """The :class:`Failure` of ``exc``, or None when it is not a turn failure (a bug: re-raise it)."""
    for row in TABLE:
        if isinstance(exc, row.kind):
            return Failure(row.error(exc), row.outcome, row.metric)
    return None


#: Which of several concurrent failures of one admission phase the client is told about.
PRIORITY = (ApiError, SessionRetired, SessionReleased, GateSealed, InvalidInput)


def first(errors: list[BaseException]) -> BaseException:
    """The failure to report of an admission phase where several calls failed at once."""
    for kind in PRIORITY:
        for e in errors:
            if isinstance(e, kind):
                return e
    return errors[0]


__all__ = ["PRIORITY", "TABLE", "Failure", "Row", "TurnAborted", "Unrecordable", "classify", "first"]
