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

Without it every call here is a no-op costing one attribute check: the
library emits nothing unless asked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import ConfigError


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

    def turn(self, headers: Mapping[str, str], attributes: dict[str, Any]) -> Any:
        """Start the turn's span (a child of the client's ``traceparent``, when it sends one); None when off."""
        if self._tracer is None:
            return None
        parent = self._propagator.extract(carrier=dict(headers))
        return self._tracer.start_span("tracestore.turn", context=parent, attributes=attributes)

    @contextlib.contextmanager
    def child(self, turn: Any, name: str, **attributes: Any) -> Iterator[Any]:
        """A child span of ``turn`` around a block (``admit``, ``engine``, ``record``, ``settle``)."""
        if turn is None or self._tracer is None:
            yield None
            return
        # started and ended here, never made the current span: nothing inside creates spans, and
        # attaching a context per child cost more than the span itself
        span = self._tracer.start_span(name, context=self._context(turn), attributes=_clean(attributes))
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(self._status_error(str(exc) or type(exc).__name__))
            raise
        finally:
            span.end()

    def _context(self, turn: Any) -> Any:
        """The context whose current span is ``turn`` (made once per turn)."""
        ctx = getattr(turn, "_tracestore_context", None)
        if ctx is None:
            from opentelemetry import trace

            ctx = trace.set_span_in_context(turn)
            try:
                turn._tracestore_context = ctx
            except AttributeError:  # a span type without a __dict__: make it each time
                pass
        return ctx

    @staticmethod
    def _status_error(description: str) -> Any:
        from opentelemetry.trace import Status, StatusCode

        return Status(StatusCode.ERROR, description)

    @staticmethod
    def set(span: Any, **attributes: Any) -> None:
        """Set attributes on a span (None values left out; no-op without a span)."""
        if span is not None:
            span.set_attributes(_clean(attributes))

    @staticmethod
    def end(span: Any, status: int | None = None) -> None:
        """End the turn's span with its HTTP status (an error status for 5xx)."""
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR))
        span.end()


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
