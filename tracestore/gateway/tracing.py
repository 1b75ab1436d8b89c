"""OpenTelemetry spans of the gateway's turns (DESIGN section 16), emitted only when asked.

With ``tracestore gateway --otel``, or ``OTEL_EXPORTER_OTLP_ENDPOINT`` set,
each turn is one span ``tracestore.turn`` with children ``admit``, ``engine``
(one per engine call: a generation continued across a weight update has
several), ``record`` and ``settle``. Attributes: ``tracestore.run``,
``tracestore.session``, ``tracestore.lease``, ``tracestore.version``,
``tracestore.tokens.prompt`` / ``.new`` / ``.completion``,
``tracestore.fork``, ``tracestore.engine``, ``http.response.status_code``.
The trace context comes from the client's ``traceparent`` header when it
sends one, so an agent framework's own trace continues through the gateway.
Spans go to the OTLP/HTTP exporter (the ``otel`` extra: ``opentelemetry-sdk``
and ``opentelemetry-exporter-otlp-proto-http``), configured by the standard
``OTEL_*`` variables.

The spans cost the request nothing of the SDK on its path: a turn notes its
start, its children's times and attributes as it goes, and its spans are
made when it ends, after its answer went out, with those times (a child that
ends later, a settlement, is made when it ends).

Without it every call here is a no-op costing one attribute check: the
library emits nothing unless asked.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

#: The context of a child span when spans are off (reentrant, shared).
_NO_SPAN = contextlib.nullcontext()


class Spans:
    """The gateway's tracer, or nothing (``provider`` None and no ``--otel``: every method no-ops)."""

    def __init__(self, provider: Any = None, *, owned: bool = False) -> None:
        self._tracer: Any = None
        self._propagator: Any = None
        self._provider = provider if owned else None  # flushed and shut down by :meth:`close`
        if provider is None:
            return
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = provider.get_tracer("tracestore.gateway")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def configured(cls, enabled: bool) -> Spans:
        """Spans to the OTLP exporter when ``enabled`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, else none.

        Raises ConfigError when asked for without the ``otel`` extra installed.
        """
        if not enabled and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            return cls()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(f"--otel needs the extra tracestore[otel] (opentelemetry-sdk and its OTLP exporter): {exc}") from None
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tracestore-gateway")})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider, owned=True)

    def close(self) -> None:
        """Export what is still buffered and stop the exporter (spans this object configured)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None

    @property
    def enabled(self) -> bool:
        """True when spans are emitted."""
        return self._tracer is not None

    def turn(self, headers: Mapping[str, str], attributes: dict[str, Any]) -> _Turn | None:
        """Begin the turn's span (a child of the client's ``traceparent``, when it sends one); None when off.

        Nothing of the SDK runs yet: the turn's start, its children's times and attributes are
        noted, and the spans are made when the turn ends (:meth:`end`), after its answer went
        out, with those times: the same spans, off the request's path.
        """
        if self._tracer is None:
            return None
        parent = headers.get("traceparent")
        carrier = {"traceparent": parent, "tracestate": headers.get("tracestate", "")} if parent else None
        return _Turn(time.time_ns(), carrier, _clean(attributes))

    def child(self, turn: _Turn | None, name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
        """A child span of ``turn`` around a block (``admit``, ``engine``, ``record``, ``settle``): its
        times noted, the span made with the turn's (at once when the turn has ended already).
        Without spans, one shared no-op context (four per turn: no generator made)."""
        if turn is None or self._tracer is None:
            return _NO_SPAN
        return self._child(turn, name, attributes)

    @contextlib.contextmanager
    def _child(self, turn: _Turn, name: str, attributes: dict[str, Any]) -> Iterator[None]:
        t0 = time.time_ns()
        error: BaseException | None = None
        try:
            yield None
        except BaseException as exc:
            error = exc
            raise
        finally:
            child = _Child(name, t0, time.time_ns(), _clean(attributes), error)
            if turn.span is None:
                turn.children.append(child)
            else:  # after the turn's answer (a settlement): made now
                self._emit(turn, child)

    def _emit(self, turn: _Turn, child: _Child) -> None:
        span = self._tracer.start_span(child.name, context=turn.context, attributes=child.attributes, start_time=child.start)
        if child.error is not None:
            span.record_exception(child.error, timestamp=child.end)
            span.set_status(self._status_error(str(child.error) or type(child.error).__name__))
        span.end(end_time=child.end)

    @staticmethod
    def _status_error(description: str) -> Any:
        from opentelemetry.trace import Status, StatusCode

        return Status(StatusCode.ERROR, description)

    @staticmethod
    def set(turn: _Turn | None, **attributes: Any) -> None:
        """Set attributes on the turn's span (None values left out; no-op without one)."""
        if turn is not None:
            turn.attributes.update(_clean(attributes))

    def end(self, turn: _Turn | None, status: int | None = None) -> None:
        """End the turn: make its span (with its HTTP status; an error status for 5xx) and its children's."""
        if turn is None or self._tracer is None or turn.span is not None:
            return
        from opentelemetry import trace

        parent = self._propagator.extract(carrier=turn.carrier) if turn.carrier is not None else None
        attrs = turn.attributes
        if status is not None:
            attrs["http.response.status_code"] = status
        span = self._tracer.start_span("tracestore.turn", context=parent, attributes=attrs, start_time=turn.start)
        turn.span = span
        turn.context = trace.set_span_in_context(span)
        for child in turn.children:
            self._emit(turn, child)
        turn.children.clear()
        if status is not None and status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR))
        span.end()


@dataclass
class _Child:
    """A child span's name, times (ns since the epoch), attributes and the exception it ended with."""

    name: str
    start: int
    end: int
    attributes: dict[str, Any]
    error: BaseException | None


@dataclass
class _Turn:
    """A turn being traced: its start, the client's trace context, attributes and children so far;
    ``span`` once it ended (:meth:`Spans.end`)."""

    start: int
    carrier: dict[str, str] | None
    attributes: dict[str, Any]
    children: list[_Child] = field(default_factory=list)
    span: Any = None
    context: Any = None


def turn_attributes(flight: Any, prep: Any, gen: Any) -> dict[str, Any]:
    """The turn span's attributes from its flight (lease), prepared prompt and generation."""
    lease = flight.lease if flight is not None else None
    return {
        "tracestore.lease": lease.id if lease is not None else None,
        "tracestore.version": lease.version if lease is not None else None,
        "tracestore.tokens.prompt": gen.prompt or None,
        "tracestore.tokens.new": prep.new_tokens if prep is not None else None,
        "tracestore.tokens.completion": len(gen.ids),
        "tracestore.fork": prep.fork if prep is not None else None,
        "tracestore.versions": ",".join(map(str, gen.distinct_versions)) or None,
    }


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


__all__ = ["Spans", "turn_attributes"]
