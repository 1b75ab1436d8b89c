"""OpenTelemetry spans per turn (DESIGN 16): one ``tracestore.turn`` span with ``admit``, ``engine``,
``record`` and ``settle`` children, the client's ``traceparent`` continued, nothing emitted unless
asked. Checked with the SDK's in-memory exporter (a gateway served in this process) and with the
real OTLP/HTTP exporter of ``tracestore gateway --otel`` posting to a collector on loopback."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests._gateway import CliServer
from tests.test_gateway import MODEL
from tracestore.gateway import GATEWAY, GatewayConfig, start_gateway
from tracestore.gateway.serve import BackgroundServer

#: Gateway processes per test: a standalone server and the cluster (tests/conftest.py, backends).
pytestmark = pytest.mark.backends("valkey", "cluster")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def engine() -> Iterator[CliServer]:
    e = CliServer("engine", "--port", "0", "--max-len", "2048").start()
    yield e
    e.stop()


def _spans(exporter: InMemorySpanExporter, n_turns: int) -> list[Any]:
    deadline = time.monotonic() + 10
    while True:  # the settle span of a completed turn ends after its answer went out
        spans = exporter.get_finished_spans()
        if sum(s.name == "settle" for s in spans) >= n_turns or time.monotonic() > deadline:
            return list(spans)
        time.sleep(0.02)


def test_one_span_per_turn_with_its_four_children_and_the_clients_trace(engine: CliServer, url: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    run = f"otel-{uuid.uuid4().hex[:8]}"
    server = start_gateway(GatewayConfig(engines=(engine.url,), url=url, run=run), tracer_provider=provider)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        sid = f"s-{uuid.uuid4().hex[:8]}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "reach 3 from 1"}]
        for _ in range(2):
            r = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, extra_headers={"X-Session-Id": sid, "traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
            )
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        spans = _spans(exporter, 2)
        turns = [s for s in spans if s.name == "tracestore.turn"]
        assert len(turns) == 2
        for t in turns:
            assert format(t.context.trace_id, "032x") == TRACE_ID  # the agent's trace goes on
            assert t.parent is not None and format(t.parent.span_id, "016x") == PARENT
            a = t.attributes
            assert a["tracestore.run"] == run and a["tracestore.session"] == sid
            assert a["tracestore.lease"] and a["tracestore.version"] == 0
            assert a["tracestore.tokens.completion"] >= 1 and a["tracestore.tokens.prompt"] >= a["tracestore.tokens.new"] >= 1
            assert a["http.response.status_code"] == 200
            children = [s for s in spans if s.parent is not None and s.parent.span_id == t.context.span_id]
            assert sorted(c.name for c in children) == ["admit", "engine", "record", "settle"]
            assert all(c.context.trace_id == t.context.trace_id for c in children)
            # each child spans its own part of the turn, in order, inside the turn (the settlement
            # runs after the answer went out: it starts inside the turn and may end after it)
            by = {c.name: c for c in children}
            assert t.start_time <= by["admit"].start_time < by["admit"].end_time <= by["engine"].start_time
            assert by["engine"].start_time < by["engine"].end_time <= by["record"].start_time < by["record"].end_time
            assert by["record"].end_time <= t.end_time and t.start_time < by["settle"].start_time < by["settle"].end_time
            assert by["engine"].attributes["tracestore.version"] == 0 and by["settle"].attributes["tracestore.outcome"] == "completed"
        # turn 2 had only its new message tokenised: the rest came from the store
        assert turns[1].attributes["tracestore.tokens.new"] < turns[1].attributes["tracestore.tokens.prompt"]
    finally:
        server.stop()


def test_nothing_is_emitted_unless_asked(engine: CliServer, standalone_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    server = start_gateway(GatewayConfig(engines=(engine.url,), url=standalone_url, run=f"otel-{uuid.uuid4().hex[:8]}"))
    try:
        assert server.app is not None and not server.app[GATEWAY].spans.enabled
    finally:
        server.stop()


def test_the_cli_flag_exports_spans_over_otlp_http(engine: CliServer, standalone_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[bytes] = []
    seen = threading.Event()

    async def make() -> web.Application:
        async def traces(request: web.Request) -> web.Response:
            got.append(await request.read())
            seen.set()
            return web.Response(status=200, content_type="application/x-protobuf", body=b"")

        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        return app

    collector = BackgroundServer(make)
    collector.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)  # the gateway process inherits it
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    gw = CliServer("gateway", "--engine", engine.url, "--url", standalone_url, "--run", f"otel-{uuid.uuid4().hex[:8]}", "--port", "0", "--otel")
    try:
        gw.start()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_headers={"X-Session-Id": f"s-{uuid.uuid4().hex[:8]}"}
        )
        assert seen.wait(30), "no OTLP export reached the collector"
        names = (b"tracestore.turn", b"admit", b"engine", b"record", b"tracestore.session")
        deadline = time.monotonic() + 30  # spans come in batches: a child may be exported before its turn
        while not all(name in b"".join(got) for name in names) and time.monotonic() < deadline:
            time.sleep(0.05)
        body = b"".join(got)
        for name in names:
            assert name in body, name
    finally:
        gw.stop()
        collector.stop()
