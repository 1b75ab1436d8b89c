"""The Responses API, ``previous_response_id``, ``count_tokens``, refused options: the official
``openai``, ``openai-agents`` and ``anthropic`` SDKs against real ``tracestore gateway`` processes
in front of a real ``tracestore engine`` (the reference policy) and a real Redis/Valkey.

One engine serves the module; per backend two gateways share one run (a stateful client
goes to either). Every test uses fresh session ids and asserts, for each conversation, one
trie path (every answer labelled, nothing else; the trace's length is the last turn's
prompt + answer) and exact usage.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from tests._engine_script import Script
from tests._families import FamilyDirs, family_dirs  # noqa: F401  (fixture)
from tests._gateway import CliServer, http
from tests._scripted_engine import Server, _http
from tracestore import TraceStore
from tracestore.gateway.config import GatewayConfig
from tracestore.gateway.serve import BackgroundServer
from tracestore.gateway.server import start_gateway
from tracestore.trainer.http_agents import CALC_TOOLS

MODEL = "tracestore-reference"
SYSTEM = "use add sub mul with one digit then done"
TOOLS = [{"type": "function", **t["function"]} for t in CALC_TOOLS]  # the Responses shape
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def engine() -> Iterator[CliServer]:
    e = CliServer("engine", "--port", "0", "--max-len", "2048", "--warmup-steps", "40", "--seed", "0").start()
    yield e
    e.stop()


@dataclass
class Pair:
    """Two gateways on one run, and a store of that run."""

    a: CliServer
    b: CliServer
    run: str
    store: TraceStore

    def oai(self, gw: CliServer | None = None, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=(gw or self.a).url + "/v1", api_key="unused", max_retries=0, **kw)

    def trace(self, s: str, gw: CliServer | None = None) -> dict[str, Any]:
        r = (gw or self.a).get(f"/v1/sessions/{s}/trace")
        assert r.status == 200, r.text
        return r.json()  # type: ignore[no-any-return]


_RUNNING: dict[str, tuple[CliServer, CliServer, str]] = {}


@pytest.fixture(scope="module")
def _stop_all() -> Iterator[None]:
    yield
    for a, b, _ in _RUNNING.values():
        a.stop()
        b.stop()
    _RUNNING.clear()


def _pair(engine: CliServer, url: str) -> Iterator[Pair]:
    if url not in _RUNNING:
        run = f"rs-{uuid.uuid4().hex[:10]}"
        args = ["gateway", "--engine", engine.url, "--url", url, "--run", run, "--port", "0", "--on-weight-update", "abort"]
        _RUNNING[url] = (CliServer(*args).start(), CliServer(*args).start(), run)
    a, b, run = _RUNNING[url]
    st = TraceStore.connect(url, run=run)
    yield Pair(a, b, run, st)
    st.close()


@pytest.fixture
def gws(engine: CliServer, url: str, _stop_all: None) -> Iterator[Pair]:
    """The pair of this backend (for what the store does: records, kept responses, release)."""
    yield from _pair(engine, url)


@pytest.fixture
def gw1(engine: CliServer, standalone_url: str, _stop_all: None) -> Iterator[Pair]:
    """The pair on the standalone server (for what does not depend on the backend: wire shapes)."""
    yield from _pair(engine, standalone_url)


def sid() -> str:
    return f"r-{uuid.uuid4().hex[:12]}"


def labelled(tr: dict[str, Any]) -> int:
    return sum(1 for x in tr["labels"] if x != -100)


def one_path(tr: dict[str, Any], usages: list[tuple[int, int]]) -> None:
    """The conversation of ``usages`` ((input, output) per turn) is one trie path, usage exact."""
    assert labelled(tr) == sum(o for _, o in usages)
    assert len(tr["input_ids"]) == usages[-1][0] + usages[-1][1]
    assert all(i2 >= i1 + o1 for (i1, o1), (i2, _) in zip(usages, usages[1:], strict=False))


def _usage(r: Any) -> tuple[int, int]:
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens
    return u.input_tokens, u.output_tokens


def _items(r: Any) -> list[dict[str, Any]]:
    return [x.model_dump(exclude_none=True) for x in r.output]


# -- responses.create ------------------------------------------------------------------------------


def test_responses_plain_streamed_and_echoed_output_stay_on_one_path(gws: Pair) -> None:
    s = sid()
    client = gws.oai(default_headers={"X-Session-Id": s})
    history: list[dict[str, Any]] = [{"role": "user", "content": "reach 7 from 3"}]
    usages = []
    r = client.responses.create(model=MODEL, instructions=SYSTEM, input=history, max_output_tokens=12)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.endswith("_" + s)
    usages.append(_usage(r))
    history += [*_items(r), {"role": "user", "content": [{"type": "input_text", "text": "more"}]}]
    # streamed: every event type in order, numbered, the final response equal to the deltas
    # (200 tokens: the engine's chunks arrive over many reads even on a loaded machine, where the
    # gateway may read several at once and send them as one delta; with 20, two deltas were seen)
    events = list(client.responses.create(model=MODEL, instructions=SYSTEM, input=history, max_output_tokens=200,
                                          stream=True, extra_body=LONG))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.count("response.output_text.delta") > 3  # token by token
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and final.usage.output_tokens == 200
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    usages.append(_usage(final))
    history += [*_items(final), {"role": "user", "content": "then"}]
    r = client.responses.create(model=MODEL, instructions=SYSTEM, input=history, max_output_tokens=12)
    usages.append(_usage(r))
    one_path(gws.trace(s), usages)


def test_responses_function_tool_loop(gw1: Pair) -> None:
    s = sid()
    client = gw1.oai(default_headers={"X-Session-Id": s})
    history: list[dict[str, Any]] = [{"role": "user", "content": "reach 7 from 3"}]
    usages, calls = [], 0
    for _ in range(3):
        r = client.responses.create(model=MODEL, instructions=SYSTEM, input=history, tools=TOOLS, temperature=0,
                                    max_output_tokens=12)
        usages.append(_usage(r))
        history += _items(r)
        fcs = [x for x in r.output if x.type == "function_call"]
        if not fcs:
            break
        calls += 1
        assert fcs[0].name in {"add", "sub", "mul"} and fcs[0].call_id
        history += [{"type": "function_call_output", "call_id": c.call_id, "output": "5"} for c in fcs]
    assert calls >= 1  # the warm-started policy calls a tool first
    one_path(gw1.trace(s), usages)


def test_previous_response_id_chain_across_two_gateways(gws: Pair) -> None:
    s = sid()
    usages = []
    r1 = gws.oai(default_headers={"X-Session-Id": s}).responses.create(
        model=MODEL, instructions=SYSTEM, input="reach 7 from 3", tools=TOOLS, temperature=0, max_output_tokens=12
    )
    usages.append(_usage(r1))
    follow = [{"type": "function_call_output", "call_id": x.call_id, "output": "5"} for x in r1.output if x.type == "function_call"]
    # no session header: the id names the session; the other gateway resolves it from the store
    r2 = gws.oai(gws.b).responses.create(
        model=MODEL, instructions=SYSTEM, input=follow or "more", previous_response_id=r1.id, tools=TOOLS,
        temperature=0, max_output_tokens=12,
    )
    usages.append(_usage(r2))
    assert r2.previous_response_id == r1.id and r2.id.endswith("_" + s)
    r3 = gws.oai().responses.create(
        model=MODEL, instructions=SYSTEM, input="then", previous_response_id=r2.id, tools=TOOLS, max_output_tokens=12,
        stream=False,
    )
    usages.append(_usage(r3))
    one_path(gws.trace(s), usages)  # (gateway a recorded the last turn)
    # store: false keeps nothing; an unknown id, another session's id: typed errors in OpenAI's shape
    r4 = gws.oai().responses.create(model=MODEL, input="x", previous_response_id=r3.id, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as nf:
        gws.oai().responses.create(model=MODEL, input="y", previous_response_id=r4.id, max_output_tokens=2)
    assert nf.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        gws.oai().responses.create(model=MODEL, input="y", previous_response_id=f"resp_{'0' * 24}_{s}", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        gws.oai(default_headers={"X-Session-Id": sid()}).responses.create(
            model=MODEL, input="y", previous_response_id=r3.id, max_output_tokens=2
        )
    with pytest.raises(openai.BadRequestError):
        gws.oai().responses.create(model=MODEL, input="y", previous_response_id="nope", max_output_tokens=2)
    # the kept items live with the session: released, they are gone (and the id with them)
    key = gws.store.keys.resp(s)
    assert gws.store.redis.hlen(key) == 3
    owner = gws.store.owner_of(s)
    assert owner is not None and gws.store.release([s], owner) == [s]
    assert not gws.store.redis.exists(key)
    with pytest.raises(openai.NotFoundError):
        gws.oai(gws.b).responses.create(model=MODEL, input="y", previous_response_id=r3.id, max_output_tokens=2)


# -- the OpenAI Agents SDK, its default model (the Responses API) ---------------------------------


def test_agents_sdk_default_model_run_and_run_streamed(gw1: Pair) -> None:
    """``Runner.run``, ``Runner.run_streamed`` (the whole conversation sent each turn) and
    ``Runner.run(previous_response_id=...)`` (the conversation kept by the gateway), 3 user turns each."""
    import agents

    def calc(op: str) -> Any:
        def f(n: int) -> str:
            return "5"

        f.__name__ = op
        f.__doc__ = f"{op} a one-digit number to the current value"
        return agents.function_tool(f)

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")

    async def conversation(mode: str) -> tuple[str, list[tuple[int, int]]]:
        s = sid()
        client = openai.AsyncOpenAI(base_url=gw1.a.url + "/v1", api_key="unused", max_retries=0,
                                    default_headers={"X-Session-Id": s})
        agents.set_default_openai_client(client, use_for_tracing=False)
        agent = agents.Agent(
            name="calc", instructions=SYSTEM, model=MODEL, tools=[calc(op) for op in ("add", "sub", "mul")],
            model_settings=agents.ModelSettings(temperature=0, max_tokens=12),
        )
        items: list[Any] = []
        usages: list[tuple[int, int]] = []
        calls, last = 0, None
        for text in ("reach 7 from 3", "then 2", "then 4"):
            items.append({"role": "user", "content": text})
            if mode == "run_streamed":
                res: Any = agents.Runner.run_streamed(agent, items)
                async for _ in res.stream_events():
                    pass
            elif mode == "run":
                res = await agents.Runner.run(agent, items)
            else:  # server-side state: only the new user turn, after the last response (from the store)
                res = await agents.Runner.run(agent, text, previous_response_id=last)
                last = res.last_response_id
            usages += [(u.input_tokens, u.output_tokens) for u in res.context_wrapper.usage.request_usage_entries]
            new = res.to_input_list()
            calls += sum(1 for x in new if x.get("type") == "function_call_output")
            items = new if mode != "previous_response_id" else []
        await client.close()
        assert calls > 0  # the tool loop ran (function_call -> function_call_output -> the next call)
        return s, usages

    for mode in ("run", "run_streamed", "previous_response_id"):
        s, usages = asyncio.run(conversation(mode))
        assert len(usages) >= 3 and all(o > 0 for _, o in usages)
        one_path(gw1.trace(s), usages)


# -- count_tokens ------------------------------------------------------------------------------------


def test_count_tokens_equals_the_next_turns_prompt(gw1: Pair) -> None:
    claude = anthropic.Anthropic(base_url=gw1.a.url, api_key="unused", max_retries=0)
    s = sid()
    msgs: list[Any] = [{"role": "user", "content": "reach 7 from 3"}]
    n0 = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs).input_tokens
    r = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=msgs, extra_headers={"X-Session-Id": s})
    assert n0 == r.usage.input_tokens
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
             {"role": "user", "content": "then 3"}]
    n1 = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs, extra_headers={"X-Session-Id": s})
    r2 = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=msgs, extra_headers={"X-Session-Id": s})
    assert n1.input_tokens == r2.usage.input_tokens > n0
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])


# -- refused options -----------------------------------------------------------------------------------

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_MSGS = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_RESP = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
_IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [_IMAGE_URL]}]}, "messages[0].content"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ("/v1/messages", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "disable_parallel_tool_use"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ("/v1/responses", {"background": True}, "background"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/responses", {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ("/v1/responses", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
    ("/v1/responses", {"include": ["reasoning.encrypted_content"]}, "include"),
    ("/v1/responses", {"truncation": "auto"}, "truncation"),
]


def test_unimplemented_options_are_400_naming_them(gw1: Pair) -> None:
    base = {"/v1/chat/completions": _CHAT, "/v1/messages": _MSGS, "/v1/responses": _RESP}
    for path, patch, name in REFUSED:
        r = gw1.a.post(path, {**base[path], **patch}, headers={"X-Session-Id": sid()})
        assert r.status == 400, (path, patch, r.text)
        body = r.json()
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert name in body["error"]["message"], (patch, body)
        else:
            err = body["error"] if path == "/v1/responses" else body
            assert name in (err["param"] or "") + err["message"], (patch, body)
    # what the SDKs send by default is not refused (the defaults spelled out)
    for path, patch in [
        ("/v1/chat/completions", {"response_format": {"type": "text"}, "n": 1, "logit_bias": {}, "parallel_tool_calls": True,
                                  "presence_penalty": 0, "frequency_penalty": 0}),
        ("/v1/responses", {"text": {"format": {"type": "text"}}, "parallel_tool_calls": True, "truncation": "disabled",
                           "include": [], "store": True, "background": False}),
    ]:
        r = gw1.a.post(path, {**base[path], **patch})
        assert r.status == 200, (path, r.text)


# -- metrics: a stream that ended in an error --------------------------------------------------------


def test_a_stream_ending_in_an_error_event_is_counted_under_its_status(gw1: Pair, engine: CliServer) -> None:
    """A weight update (``--on-weight-update abort``) ends open streams with an error event: 503."""
    def count(route: str, status: str) -> float:
        return gw1.a.metric("tracestore_gateway_requests_total", route=route, status=status)

    before = {r: (count(r, "503"), count(r, "200")) for r in ("responses", "chat_completions")}
    got: dict[str, Any] = {}
    opened = threading.Barrier(3, timeout=60)

    def responses_stream() -> None:
        stream = gw1.oai().responses.create(model=MODEL, input="reach 3 from 1", max_output_tokens=1500, stream=True,
                                            extra_headers={"X-Session-Id": sid()}, extra_body=LONG)
        kinds = []
        for e in stream:
            kinds.append(e.type)
            if e.type == "response.output_text.delta" and kinds.count(e.type) == 1:
                opened.wait()
        got["responses"] = kinds

    def chat_stream() -> None:
        stream = gw1.oai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "reach 3 from 1"}],
                                                   max_tokens=1500, stream=True, extra_headers={"X-Session-Id": sid()},
                                                   extra_body=LONG)
        try:
            for i, _ in enumerate(stream):
                if i == 1:
                    opened.wait()
        except openai.APIError as exc:
            got["chat_completions"] = exc

    threads = [threading.Thread(target=f) for f in (responses_stream, chat_stream)]
    for t in threads:
        t.start()
    opened.wait()
    version = gw1.store.gate.status().version + 1
    with gw1.store.gate.weight_update(version, drain_timeout_s=30) as drained:
        assert drained.drained
        assert engine.post("/update_weight_version", {"new_version": version}).status == 200
    for t in threads:
        t.join(60)
    assert got["responses"][-2:] == ["error", "response.failed"], got["responses"][-5:]
    assert isinstance(got["chat_completions"], openai.APIError)
    deadline = time.monotonic() + 10
    while any(count(r, "503") - b[0] < 1 for r, b in before.items()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for r, (b503, b200) in before.items():
        assert count(r, "503") - b503 == 1 and count(r, "200") == b200, r


def test_stateless_response_and_bad_input(gw1: Pair) -> None:
    """No session: a plain proxy turn, nothing kept; malformed input is a 400 in OpenAI's shape."""
    r = gw1.oai().responses.create(model=MODEL, input="reach 4 from 2", max_output_tokens=4)
    assert r.usage is not None and r.usage.input_tokens > 0 and r.id.count("_") == 1
    with pytest.raises(openai.NotFoundError):
        gw1.oai().responses.create(model=MODEL, input="more", previous_response_id=r.id, max_output_tokens=2)
    for bad in ({"input": 3}, {"input": [{"type": "item_reference", "id": "x"}]}, {"input": []}, {"tools": [{"type": "function"}]}):
        reply = http("POST", gw1.a.url + "/v1/responses", __import__("orjson").dumps({**_RESP, **bad}))
        assert reply.status == 400 and "error" in reply.json(), (bad, reply.text)


# -- reasoning items (a real reasoning family: Qwen3's vocabulary and template, a scripted engine) -------------


def test_reasoning_and_function_call_items_round_trip(family_dirs: FamilyDirs, standalone_url: str) -> None:  # noqa: F811
    """Qwen3 (``--reasoning-parser qwen3``, hermes tool calls): the streamed answer is a reasoning item,
    then a function call; echoed back with the call's output, the next turn extends the same path.
    (The scripted engine and the gateway run in this process: no second interpreter to start.)"""
    qwen3 = family_dirs["qwen3"]
    call = '<tool_call>\n{"name": "add", "arguments": {"n": 3}}\n</tool_call>'
    script = Server(Script(str(qwen3), "sglang", None))

    async def make() -> Any:
        return script.app()

    eng = BackgroundServer(make)
    eng.start()
    gw = None
    try:
        _http("POST", eng.url + "/script", {"answers": [
            {"text": "<think>\nthree more</think>\n\n" + call, "stop": True}, {"text": "<think>\nok</think>\n\ndone", "stop": True},
        ]})
        gw = start_gateway(GatewayConfig(engines=(eng.url,), url=standalone_url, run=f"rq-{uuid.uuid4().hex[:8]}",
                                         tokenizer=str(qwen3), tool_parser="hermes", reasoning_parser="qwen3"))
        s = sid()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, default_headers={"X-Session-Id": s})
        history: list[Any] = [{"role": "user", "content": "reach 7 from 4"}]
        events = list(client.responses.create(model=qwen3.name, instructions=SYSTEM, input=history, tools=TOOLS, stream=True))
        kinds = [e.type for e in events]
        assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
        r1 = events[-1].response
        assert [x.type for x in r1.output] == ["reasoning", "function_call"]
        assert r1.output[0].content[0].text == "three more" and r1.output[1].name == "add"
        history += [*_items(r1), {"type": "function_call_output", "call_id": r1.output[1].call_id, "output": "7"}]
        r2 = client.responses.create(model=qwen3.name, instructions=SYSTEM, input=history, tools=TOOLS)
        assert r2.output_text == "done" and [x.type for x in r2.output] == ["reasoning", "message"]
        log = _http("GET", eng.url + "/log")["requests"]
        in1, in2, out1 = log[0]["input_ids"], log[1]["input_ids"], log[0]["output_ids"]
        assert in2[: len(in1) + len(out1)] == in1 + out1  # token-exact continuation
        one_path(http("GET", f"{gw.url}/v1/sessions/{s}/trace").json(), [_usage(r1), _usage(r2)])
        client.close()  # (no idle keep-alive connection for the server's shutdown to wait on)
    finally:
        if gw is not None:
            gw.stop()
        eng.stop()
