"""Generations survive weight updates (``--on-weight-update continue``, the default; DESIGN 15).

Agents with the SDKs' DEFAULT retries, streamed and not, OpenAI and Anthropic
wire formats, through a real gateway in front of a real ``tracestore engine``
(both adapters), across three weight updates that land mid-generation: no
agent sees an error, every answer has its full length (nothing regenerated),
every turn is recorded once with exactly the tokens the agent received, and
each token carries the version that generated it. A gateway killed while it
holds a turn loses nothing: the client's retry on a second gateway resumes
from the kept tokens.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests._gateway import CliServer, http, lease_outcomes
from tests.test_gateway import MODEL
from tracestore import TraceStore
from tracestore.conversation import conversation_key
from tracestore.gateway.tokenizer import BuiltinTokenizer

APIS = ("sglang", "vllm")
N = 900  # tokens per answer: long enough for several updates to land in it
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module", params=APIS)
def api(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(api: str) -> Iterator[CliServer]:
    e = CliServer("engine", "--api", api, "--port", "0", "--max-len", "4096").start()
    yield e
    e.stop()


def _gateway(engine: CliServer, api: str, url: str, run: str, *extra: str) -> CliServer:
    return CliServer(
        "gateway", "--engine", engine.url, "--engine-api", api, "--url", url, "--run", run, "--port", "0", *extra
    ).start()


def _generated(engine: CliServer) -> int:
    return int(engine.get("/get_model_info").json()["generated_tokens"])


def _labelled(tr: dict[str, Any]) -> list[int]:
    return [t for t, lab in zip(tr["input_ids"], tr["labels"], strict=True) if lab != -100]


def test_agents_with_default_retries_ride_through_three_weight_updates(
    engine: CliServer, api: str, standalone_url: str
) -> None:
    run = f"cont-{uuid.uuid4().hex[:8]}"
    gw = _gateway(engine, api, standalone_url, run)
    st = TraceStore.connect(standalone_url, run=run)
    tok = BuiltinTokenizer()
    results: dict[str, Any] = {}
    kinds = ["oai", "oai-stream", "oai", "oai-stream", "claude", "claude-stream", "oai", "oai-stream"]
    sids = {f"s{i}-{uuid.uuid4().hex[:6]}": kind for i, kind in enumerate(kinds)}

    def agent(sid: str, kind: str) -> None:
        msgs = [{"role": "user", "content": "reach 3 from 1"}]
        try:
            if kind.startswith("oai"):
                client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")  # default retries
                if kind.endswith("stream"):
                    chunks = list(
                        client.chat.completions.create(
                            model=MODEL, messages=msgs, max_tokens=N, stream=True, extra_body=LONG,
                            extra_headers={"X-Session-Id": sid}, stream_options={"include_usage": True},
                        )
                    )
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    results[sid] = (text, chunks[-1].usage.completion_tokens, None)
                else:
                    raw = client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=msgs, max_tokens=N, extra_body=LONG, extra_headers={"X-Session-Id": sid}
                    )
                    r = raw.parse()
                    results[sid] = (r.choices[0].message.content, r.usage.completion_tokens, raw.headers.get("x-tracestore-versions"))
            else:
                c = anthropic.Anthropic(base_url=gw.url, api_key="unused")
                kw: dict[str, Any] = dict(model=MODEL, max_tokens=N, messages=msgs, extra_body=LONG, extra_headers={"X-Session-Id": sid})
                if kind.endswith("stream"):
                    with c.messages.stream(**kw) as s:
                        m = s.get_final_message()
                else:
                    m = c.messages.create(**kw)
                results[sid] = ("".join(b.text for b in m.content if b.type == "text"), m.usage.output_tokens, None)
        except Exception as exc:  # reported below: no agent may see one
            results[sid] = exc

    try:
        threads = [threading.Thread(target=agent, args=(s, k)) for s, k in sids.items()]
        for t in threads:
            t.start()
        version = st.gate.status().version
        for _ in range(3):
            before = _generated(engine)
            deadline = time.monotonic() + 60
            while _generated(engine) < before + 150 and len(results) < len(sids):  # mid-generation
                assert time.monotonic() < deadline, "the engine stopped generating"
                time.sleep(0.01)
            version += 1
            t0 = time.perf_counter()
            with st.gate.weight_update(version, drain_timeout_s=30) as drained:
                assert drained.drained and drained.poisoned == 0
                assert engine.post("/update_weight_version", {"new_version": version}).status == 200
            assert time.perf_counter() - t0 < 15  # held requests do not hold the drain
        for t in threads:
            t.join(180)
        errors = {s: r for s, r in results.items() if isinstance(r, Exception)}
        assert not errors and len(results) == len(sids), errors
        spanning = 0
        for sid, (text, n, header) in results.items():
            assert n == N, (sid, n)  # the full length: nothing regenerated, nothing lost
            tr = gw.get(f"/v1/sessions/{sid}/trace").json()
            ids = _labelled(tr)
            assert len(ids) == N and tok.decode(ids) == text, sid  # recorded once, exactly what the agent got
            versions = [v for v, lab in zip(tr["versions"], tr["labels"], strict=True) if lab != -100]
            assert versions == sorted(versions) and versions[-1] <= version
            if len(set(versions)) > 1:
                spanning += 1
                if header is not None:  # non-streamed OpenAI answers say which versions wrote them
                    assert header == ",".join(str(v) for v in dict.fromkeys(versions))
            key = conversation_key([{"role": "user", "content": "reach 3 from 1"}, {"role": "assistant", "content": text}])
            assert st.export_training_trace(sid, key).versions[-N:] == versions
            assert lease_outcomes(st, sid)[-1] == "completed"
        assert spanning >= 3  # the updates landed mid-generation
        st_ = st.gate.status()
        assert st_.live == 0 and st_.poisoned == 0
        assert gw.metric("tracestore_gateway_tokens_total", kind="discarded") == 0
        assert gw.metric("tracestore_gateway_held_total", event="continued") >= spanning
        assert gw.metric("tracestore_gateway_requests_total", route="chat_completions", status="503") == 0
    finally:
        gw.stop()
        st.close()


def test_a_turn_held_by_a_gateway_that_died_resumes_on_another(engine: CliServer, api: str, standalone_url: str) -> None:
    run = f"cont-{uuid.uuid4().hex[:8]}"
    a = _gateway(engine, api, standalone_url, run)
    b = _gateway(engine, api, standalone_url, run)
    st = TraceStore.connect(standalone_url, run=run)
    sid = f"s-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "reach 4 from 2"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": N, "ignore_eos": True}
    try:
        first: dict[str, Any] = {}
        t = threading.Thread(target=_post, args=(first, a.url, body, sid))
        t.start()
        before = _generated(engine)
        deadline = time.monotonic() + 60
        while _generated(engine) < before + 100:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        v0 = st.gate.status().version
        st.gate.seal()
        assert st.gate.drain(30).drained  # the held turn's lease is settled: the drain is not held
        key = conversation_key(messages)
        deadline = time.monotonic() + 30
        while (kept := st.read_partial(sid, key)) is None:
            assert time.monotonic() < deadline, "the held turn's tokens were not kept"
            time.sleep(0.02)
        assert 0 < len(kept.ids) < N and set(kept.versions) == {v0}
        a.kill()  # the gateway dies holding the turn
        t.join(30)
        st.gate.install(v0 + 1)
        st.gate.reopen()
        generated = _generated(engine)
        r = b.post("/v1/chat/completions", body, {"X-Session-Id": sid})  # the client's retry, elsewhere
        assert r.status == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == N
        assert _generated(engine) - generated <= N - len(kept.ids) + 2  # resumed, not regenerated
        tr = b.get(f"/v1/sessions/{sid}/trace").json()
        versions = [v for v, lab in zip(tr["versions"], tr["labels"], strict=True) if lab != -100]
        assert versions[: len(kept.ids)] == [v0] * len(kept.ids) and set(versions[len(kept.ids) :]) == {v0 + 1}
        assert _labelled(tr)[: len(kept.ids)] == list(kept.ids)
        assert st.read_partial(sid, key) is None or _wait_dropped(st, sid, key)  # dropped once recorded
        s_ = st.gate.status()
        assert s_.live == 0 and s_.poisoned == 0
    finally:
        a.stop()
        b.stop()
        st.close()


def test_abort_mode_discards_and_a_hold_past_its_timeout_is_answered_as_abort(
    engine: CliServer, api: str, standalone_url: str
) -> None:
    run = f"cont-{uuid.uuid4().hex[:8]}"
    gw = _gateway(engine, api, standalone_url, run, "--hold-timeout", "1")
    st = TraceStore.connect(standalone_url, run=run)
    sid = f"s-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": N, "ignore_eos": True}
    try:
        t = threading.Thread(target=_post, args=(out, gw.url, body, sid))
        t.start()
        before = _generated(engine)
        while _generated(engine) < before + 50:
            time.sleep(0.01)
        st.gate.seal()  # and left sealed past the hold timeout
        t.join(60)
        r = out["r"]
        assert r.status == 503 and r.json()["code"] == "aborted"
        assert gw.metric("tracestore_gateway_held_total", event="timed_out") == 1
        assert gw.metric("tracestore_gateway_tokens_total", kind="discarded") > 0
        st.gate.reopen()
    finally:
        gw.stop()
        st.close()


def _post(out: dict[str, Any], url: str, body: dict[str, Any], sid: str) -> None:
    """POST a chat completion from a thread; the reply, or the error (a gateway killed mid-request)."""
    try:
        out["r"] = http("POST", url + "/v1/chat/completions", orjson.dumps(body), {"X-Session-Id": sid})
    except OSError as exc:
        out["r"] = exc


def _wait_dropped(st: TraceStore, sid: str, key: str) -> bool:
    deadline = time.monotonic() + 10
    while st.read_partial(sid, key) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
