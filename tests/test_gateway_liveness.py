"""Operating the gateway when things go wrong (issue 31): a store that lost the run, an engine that is
gone, an owner tag nothing heart-beats. A real gateway, a real engine, a real server of the test's own
(it is flushed), and the official SDK with its default retries."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests._gateway import CliServer, lease_outcomes
from tests.test_gateway import MODEL
from tracestore import TraceStore
from tracestore.servers import EmbeddedServer


@pytest.fixture
def own_server() -> Iterator[EmbeddedServer]:
    s = EmbeddedServer().start()
    yield s
    s.stop()


def _wait(pred, timeout_s: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_a_gateway_whose_store_lost_the_run_records_nothing_and_says_so(own_server: EmbeddedServer) -> None:
    engine = CliServer("engine", "--port", "0").start()
    run = f"live-{uuid.uuid4().hex[:8]}"
    gw = CliServer("gateway", "--engine", engine.url, "--url", own_server.url, "--run", run, "--port", "0").start()
    st = TraceStore.connect(own_server.url, run=run)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")  # default retries
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Session-Id": "a-1"})
        assert gw.get("/health").status == 200 and gw.get("/ready").status == 200
        st.redis.flushall()  # type: ignore[union-attr]  # the server restarted without its data
        assert _wait(lambda: gw.get("/health").status == 503)
        h = gw.get("/health").json()
        assert h["status"] == "unhealthy" and any("lost run" in p for p in h["problems"]) and gw.get("/ready").status == 503
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as ei:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Session-Id": "a-2"})
        assert ei.value.status_code == 503 and ei.value.body["code"] == "run_lost"  # type: ignore[index]
        assert ei.value.response.headers["x-should-retry"] == "false" and time.monotonic() - t0 < 5  # no retry storm
        assert list(st.redis.scan_iter(match=f"ts:{{{run}*")) == []  # type: ignore[union-attr]  # no orphan keys
    finally:
        gw.stop()
        engine.stop()
        st.close()


def test_a_dead_engine_makes_the_gateway_unhealthy_and_sdk_calls_fail_fast(standalone_url: str) -> None:
    engine = CliServer("engine", "--port", "0").start()
    run = f"live-{uuid.uuid4().hex[:8]}"
    gw = CliServer(
        "gateway", "--engine", engine.url, "--url", standalone_url, "--run", run, "--port", "0", "--engine-wait", "1",
    ).start()
    try:
        assert gw.get("/health").json()["checks"]["engines"] == {engine.url: True}
        engine.kill()
        assert _wait(lambda: gw.get("/health").status == 503)
        assert gw.get("/health").json()["checks"]["engines"] == {engine.url: False}
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")  # default retries (2)
        before = gw.metric("tracestore_gateway_requests_total", route="chat_completions", status="502")
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as ei:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Session-Id": "b-1"})
        assert ei.value.status_code == 502 and ei.value.body["code"] == "engine_unreachable"  # type: ignore[index]
        assert time.monotonic() - t0 < 1 + 5  # the 1 s --engine-wait, then no retry
        assert gw.metric("tracestore_gateway_requests_total", route="chat_completions", status="502") - before == 1  # not retried
    finally:
        gw.stop()
        engine.stop()


def test_the_gateways_default_owner_is_heart_beaten_and_released_by_gc_once_it_is_gone(standalone_url: str) -> None:
    engine = CliServer("engine", "--port", "0").start()
    run = f"live-{uuid.uuid4().hex[:8]}"
    gw = CliServer(
        "gateway", "--engine", engine.url, "--url", standalone_url, "--run", run, "--port", "0", "--owner-ttl", "3",
    ).start()
    st = TraceStore.connect(standalone_url, run=run)
    try:
        openai.OpenAI(base_url=gw.url + "/v1", api_key="unused").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Session-Id": "c-1"}
        )
        owner = st.owner_of("c-1")
        assert owner is not None and owner.startswith("gateway:")
        assert _wait(lambda: {o.owner: o.deadline_ms for o in st.owners()}.get(owner) is not None)
        gw.kill()  # gone: nothing heart-beats its tag any more
        assert st.gate.drain(10).drained
        released: list[str] = []
        # the tag's heartbeat deadline (--owner-ttl 3 s) passes, then gc releases what it owned
        assert _wait(lambda: bool(released.extend(st.gc(scan_data=False).sessions_released) or released), timeout_s=60)
        assert "c-1" in released and st.owner_of("c-1") is None
    finally:
        gw.stop()
        engine.stop()
        st.close()


def test_a_killed_gateways_lease_is_resolved_by_a_live_one_and_the_next_update_succeeds(standalone_url: str) -> None:
    """Gateway A is killed mid-generation; B (same run) stops A's engine request and settles its lease
    ``aborted`` once A's holder heartbeat is overdue (10 s, checked every 5 s): no operator, the gate ends
    with 0 live and 0 poisoned leases, the next weight update drains at once, and nothing is recorded
    for the request the agent saw fail."""
    engine = CliServer("engine", "--port", "0", "--max-len", "8192").start()
    run = f"live-{uuid.uuid4().hex[:8]}"
    args = ("--engine", engine.url, "--url", standalone_url, "--run", run, "--port", "0")
    a = CliServer("gateway", *args).start()
    b = CliServer("gateway", *args).start()
    st = TraceStore.connect(standalone_url, run=run)
    generated = lambda: int(engine.get("/get_model_info").json()["generated_tokens"])  # noqa: E731
    failed: list[BaseException] = []

    def agent() -> None:
        try:
            openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=6000,
                extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": "k-1"},
            )
        except openai.APIError as exc:
            failed.append(exc)

    t = threading.Thread(target=agent)
    try:
        t.start()
        assert _wait(lambda: generated() > 50 and st.gate.status().live == 1)
        a.kill()  # the gateway dies holding a live lease and an engine request
        killed = time.monotonic()
        t.join(30)
        assert failed, "the agent saw its call fail"
        assert _wait(lambda: lease_outcomes(st, "k-1") == ["aborted"], timeout_s=30), lease_outcomes(st, "k-1")
        resolved_s = time.monotonic() - killed
        print(f"dead gateway lease resolved in {resolved_s:.1f} s")
        assert resolved_s < 25, resolved_s  # 10 s heartbeat deadline + one 5 s healing pass, + slack for a loaded machine
        n = generated()
        time.sleep(0.5)
        assert generated() == n  # the engine request was stopped, not left to run to 6000 tokens
        s = st.gate.status()
        assert s.live == 0 and s.poisoned == 0
        t0 = time.monotonic()
        st.gate.seal()
        assert st.gate.drain(15).drained and time.monotonic() - t0 < 15
        st.gate.install(s.version + 1)
        st.gate.reopen()
        assert "k-1" not in st.sessions()  # the failed turn recorded nothing (a session opens at its first record)
        r = b.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, {"X-Session-Id": "k-2"})
        assert r.status == 200, r.text  # the run goes on through the live gateway
    finally:
        t.join(5)
        a.stop()
        b.stop()
        engine.stop()
        st.close()


def test_two_gateways_on_one_port_carry_an_agent_through_the_death_of_one(standalone_url: str) -> None:
    """``--reuse-port``: two gateway processes of a run serve one port. The one serving an agent's
    call is killed mid-generation; the SDK's default retry connects to the other, which answers
    it: the agent sees no error, the turn is recorded once, and the dead one's lease is resolved."""
    from tracestore.servers.ports import free_port

    engine = CliServer("engine", "--port", "0", "--max-len", "8192").start()
    run = f"pair-{uuid.uuid4().hex[:8]}"
    port = str(free_port())
    args = ("--engine", engine.url, "--url", standalone_url, "--run", run, "--port", port, "--reuse-port")
    pair = [CliServer("gateway", *args).start(), CliServer("gateway", *args).start()]
    st = TraceStore.connect(standalone_url, run=run)
    out: dict[str, object] = {}

    def agent() -> None:
        out["reply"] = openai.OpenAI(base_url=pair[0].url + "/v1", api_key="unused").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=3000,
            extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": "p-1"},
        )

    t = threading.Thread(target=agent)
    try:
        assert pair[0].url == pair[1].url  # one address
        t.start()
        assert _wait(lambda: st.gate.status().live == 1)
        # the lease names its holder, gateway-<host>-<pid> (a metric scrape on the shared port may
        # reach either process)
        r: Any = st.redis
        holders = [
            h.get(b"holder", b"").decode() for name in r.scan_iter(match=st.keys.control_pattern, count=1000)
            if b":gate:l:" in name and (h := r.hgetall(name)).get(b"sid") == b"p-1"
        ]
        serving = next(g for g in pair if any(h.endswith(f"-{g.proc.pid}") for h in holders))
        serving.kill()  # dies holding the call, its lease and its engine request
        t.join(120)
        reply = out["reply"]
        assert isinstance(reply, openai.types.chat.ChatCompletion) and reply.usage is not None
        assert reply.usage.completion_tokens == 3000
        assert len(st.trace_keys("p-1")) == 2  # one turn: its prompt node and its answer node
        assert _wait(lambda: st.gate.status().live == 0 and st.gate.status().poisoned == 0, timeout_s=30)
        outcomes = lease_outcomes(st, "p-1")
        assert outcomes.count("completed") == 1 and set(outcomes) <= {"completed", "aborted"}, outcomes
    finally:
        for g in pair:
            g.stop()
        engine.stop()
        st.close()
