"""The session gateway end to end: the official ``openai`` and ``anthropic`` SDKs as agents,
a real ``tracestore gateway`` process in front of a real ``tracestore engine`` process,
and a real Redis/Valkey (standalone and cluster) behind it.

One engine (the reference policy, warm-started so that greedy decoding emits
calculator tool calls) serves the module; gateways are started per backend
and per option set, each on its own run. Every test uses fresh session ids.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests._gateway import CliServer, dump_run, lease_outcomes
from tracestore import TraceStore
from tracestore.gateway.serve import BackgroundServer
from tracestore.gateway.tokenizer import BuiltinTokenizer, HFTokenizer
from tracestore.trainer.http_agents import CALC_TOOLS

#: Gateway processes per test: a standalone server and the cluster (tests/conftest.py, backends).
pytestmark = pytest.mark.backends("valkey", "cluster")

MODEL = "tracestore-reference"
SYSTEM = "use add sub mul with one digit then done"
TOOLS = CALC_TOOLS  # add/sub/mul with one integer n: what the reference policy calls
CLAUDE_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]
LONG = {"ignore_eos": True}  # extra body: generate max_tokens tokens (the request stays in flight)


@pytest.fixture(scope="module")
def engine() -> Iterator[CliServer]:
    """The reference policy, warm-started on the calculator format (greedy: a tool call first)."""
    e = CliServer("engine", "--port", "0", "--max-len", "2048", "--warmup-steps", "40", "--seed", "0").start()
    yield e
    e.stop()


@dataclass
class GW:
    """A running gateway, its run, a store of that run, and SDK clients."""

    server: CliServer
    run: str
    store: TraceStore
    engine_url: str

    @property
    def url(self) -> str:
        return self.server.url

    def oai(self, max_retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=max_retries)

    def claude(self, max_retries: int = 0) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=max_retries)

    def trace(self, sid: str) -> dict[str, Any]:
        r = self.server.get(f"/v1/sessions/{sid}/trace")
        assert r.status == 200, r.text
        return r.json()  # type: ignore[no-any-return]


class _Gateways:
    def __init__(self) -> None:
        self.running: dict[tuple[str, ...], tuple[CliServer, str]] = {}

    def get(self, url: str, engine_url: str, *extra: str) -> tuple[CliServer, str]:
        key = (url, engine_url, *extra)
        if key not in self.running:
            run = f"gw-{uuid.uuid4().hex[:10]}"
            args = ["gateway", "--engine", engine_url, "--url", url, "--run", run, "--port", "0", *extra]
            self.running[key] = (CliServer(*args).start(), run)
        return self.running[key]

    def stop(self) -> None:
        for server, _ in self.running.values():
            server.stop()


@pytest.fixture(scope="module")
def gateways() -> Iterator[_Gateways]:
    g = _Gateways()
    yield g
    g.stop()


def _gw(gateways: _Gateways, url: str, engine_url: str, *extra: str) -> Iterator[GW]:
    server, run = gateways.get(url, engine_url, *extra)
    st = TraceStore.connect(url, run=run)
    yield GW(server, run, st, engine_url)
    st.close()


@pytest.fixture
def gw(gateways: _Gateways, engine: CliServer, url: str) -> Iterator[GW]:
    """The shared gateway of this backend (1 MB body limit for the size test)."""
    yield from _gw(gateways, url, engine.url, "--max-body-mb", "1")


def sid() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def labelled(trace: dict[str, Any]) -> int:
    return sum(1 for x in trace["labels"] if x != -100)


def session_data(st: TraceStore, s: str) -> dict[bytes, Any]:
    """The data-plane keys of one session (with values)."""
    tag = f"{{{st.run_id}/{s}}}".encode()
    return {k: v for k, v in dump_run(st).items() if tag in k}


# -- multi-turn recording --------------------------------------------------------------------------


def test_openai_multi_turn_stays_on_one_path(gw: GW) -> None:
    client, s = gw.oai(), sid()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 7 from 3"}]
    completions, prompts = [], []
    before = gw.server.metric("tracestore_gateway_tokens_total", kind="completion")
    for turn in range(4):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_headers={"X-Session-Id": s})
        completions.append(r.usage.completion_tokens)
        prompts.append(r.usage.prompt_tokens)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"then {turn}"})
    tr = gw.trace(s)
    # every assistant turn is labelled, nothing else: one trie path for the whole conversation
    assert labelled(tr) == sum(completions)
    assert len(tr["input_ids"]) == prompts[-1] + completions[-1]
    assert all(p2 > p1 + c1 for p1, c1, p2 in zip(prompts, completions, prompts[1:], strict=False))
    assert set(tr["versions"]) == {0}
    assert gw.server.metric("tracestore_gateway_tokens_total", kind="completion") - before == sum(completions)
    # the session was opened for the default owner and holds one lease per turn, all completed
    owner = gw.store.owner_of(s)
    assert owner is not None and owner.startswith("gateway:")  # the gateway's own tag, heart-beaten
    assert {o.owner: o.deadline_ms for o in gw.store.owners()}[owner] is not None
    assert gw.store.gate.drain(10).drained
    assert lease_outcomes(gw.store, s) == ["completed"] * 4


def test_anthropic_multi_turn_stays_on_one_path(gw: GW) -> None:
    client, s = gw.claude(), sid()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "reach 7 from 3"}]
    outs, ins = [], []
    for turn in range(3):
        r = client.messages.create(
            model=MODEL, max_tokens=8, system=SYSTEM, messages=msgs, extra_body={"session_id": s},
            extra_headers={"X-Tracestore-Owner": "agents:claude"},
        )
        assert r.type == "message" and r.role == "assistant"
        outs.append(r.usage.output_tokens)
        ins.append(r.usage.input_tokens)
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        msgs.append({"role": "user", "content": [{"type": "text", "text": f"then {turn}"}]})
    tr = gw.trace(s)
    assert labelled(tr) == sum(outs)
    assert len(tr["input_ids"]) == ins[-1] + outs[-1]
    assert gw.store.owner_of(s) == "agents:claude"


def test_both_formats_render_the_same_prompt(gw: GW) -> None:
    a = gw.oai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 4 from 2"}],
        max_tokens=2,
        extra_body={"session_id": sid()},
    )
    b = gw.claude().messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM, messages=[{"role": "user", "content": "reach 4 from 2"}],
        extra_headers={"X-Session-Id": sid()},
    )
    tok = BuiltinTokenizer()
    want = len(tok.encode(tok.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 4 from 2"}], None, True)))
    assert a.usage.prompt_tokens == b.usage.input_tokens == want


# -- streaming --------------------------------------------------------------------------------------


def _content_of(tr: dict[str, Any], n: int) -> str:
    """The text of the last ``n`` labelled ids: the answer of an ``ignore_eos`` turn cut by length."""
    ids = [x for x in tr["labels"] if x != -100][-n:]
    return BuiltinTokenizer().decode(ids)


def test_openai_stream_records_and_reports_usage(gw: GW) -> None:
    client, s = gw.oai(), sid()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 9 from 1"}]
    total = 0
    n = 200  # tokens per answer: the engine's chunks arrive over many reads, even on a loaded machine
    for _ in range(2):
        text, usage, finish, chunks = "", None, None, 0
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=n, stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": s}, extra_body=LONG,
        )
        for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        assert usage is not None and usage.completion_tokens == n and finish == "length"
        assert chunks > 3  # streamed token by token, not in one piece
        total += usage.completion_tokens
        tr = gw.trace(s)
        assert _content_of(tr, n) == text
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    assert labelled(gw.trace(s)) == total


def test_anthropic_stream_records_and_reports_usage(gw: GW) -> None:
    client, s = gw.claude(), sid()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "reach 9 from 1"}]
    total = 0
    for _ in range(2):
        with client.messages.stream(
            model=MODEL, max_tokens=30, system=SYSTEM, messages=msgs, extra_headers={"X-Session-Id": s}, extra_body=LONG
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.usage.output_tokens == 30 and final.stop_reason == "max_tokens"
        assert final.usage.input_tokens > 0
        total += final.usage.output_tokens
        assert _content_of(gw.trace(s), 30) == text
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    assert labelled(gw.trace(s)) == total


# -- tools ------------------------------------------------------------------------------------------


def test_openai_tool_calls_round_trip(gw: GW) -> None:
    client, s = gw.oai(), sid()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 7 from 3"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8, extra_headers={"X-Session-Id": s}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    args = json.loads(call.function.arguments)
    assert call.function.name in {"add", "sub", "mul"} and set(args) == {"n"} and isinstance(args["n"], int)
    assert choice.message.content is None
    messages.append(choice.message.model_dump(exclude_none=True))  # arguments travel back as a JSON string
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "= 9"})
    r2 = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8, extra_headers={"X-Session-Id": s}
    )
    tr = gw.trace(s)
    assert labelled(tr) == r.usage.completion_tokens + r2.usage.completion_tokens
    # the tool call is rendered back exactly as the model wrote it: the first answer is in the prefix
    tok = BuiltinTokenizer()
    first = [x for x in tr["labels"] if x != -100][: r.usage.completion_tokens]
    assert tok.decode(first) == f"{call.function.name} {args['n']}<|im_end|>"


def test_openai_streamed_tool_call(gw: GW) -> None:
    client, s = gw.oai(), sid()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 7 from 3"}]
    calls, finish = [], None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8, stream=True, extra_headers={"X-Session-Id": s}
    ):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in {"add", "sub", "mul"} and "n" in json.loads(calls[0].function.arguments)


def test_anthropic_tool_use_round_trip(gw: GW) -> None:
    client, s = gw.claude(), sid()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "reach 7 from 3"}]
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=8, system=SYSTEM, tools=CLAUDE_TOOLS, extra_headers={"X-Session-Id": s}, extra_body={"temperature": 0})
    r = client.messages.create(messages=msgs, **kw)
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name in {"add", "sub", "mul"} and isinstance(use.input["n"], int)
    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
    msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "= 9"}]})
    r2 = client.messages.create(messages=msgs, **kw)
    assert labelled(gw.trace(s)) == r.usage.output_tokens + r2.usage.output_tokens


def _scripted_engine(answers: list[str]) -> BackgroundServer:
    """SGLang's non-streaming ``/generate`` answering ``answers[k]`` to the k-th assistant turn.

    The model's side of a test, over real HTTP: the gateway, the SDK and the
    store are the real ones; only what the model writes is chosen (a rare
    sample of the reference policy, made certain).
    """
    from aiohttp import web

    from tracestore.trainer.tokenizer import TOKENIZER

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        turn = TOKENIZER.decode(body["input_ids"]).count("<|im_start|>assistant") - 1
        out = [*TOKENIZER.encode(answers[turn]), TOKENIZER.stop_id]
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "stop", "matched": TOKENIZER.stop_id},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(out),
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "weight_version": "0",
        }
        return web.json_response({"output_ids": out, "meta_info": meta})

    async def abort(request: web.Request) -> web.Response:
        return web.json_response({})

    async def make() -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        return app

    return BackgroundServer(make)


@pytest.mark.parametrize(
    ("answers", "finish", "value"),
    [([" mul 7", "add 3", "done"], "done", 17), (["add 3\nsub 2", "done"], "malformed", 2)],
    ids=["space-before-a-call", "two-calls"],
)
def test_http_agent_sends_back_each_answer_as_written(
    gateways: _Gateways, url: str, answers: list[str], finish: str, value: int
) -> None:
    """The HTTP-agent PromptMismatch flake of disaggregated runs, made certain.

    The policy sometimes writes a call with a space before it (`` mul 7``).
    The gateway's tool parser does not read that as a call, so it answers
    content `` mul 7`` and records that text; the task strips it and runs the
    call. The agent used to send it back as a ``tool_calls`` message, which
    the template renders ``mul 7``: the next turn branched off the recorded
    path (the first answer's tokens became prompt), and the learner found no
    stored key for the sample's conversation. Likewise an answer with two
    calls: the agent ran the first and sent only it back (the answer's labels
    silently lost), where a local agent's episode reads it as malformed. Sent
    back as written, every turn extends the recorded path, the episode is the
    local agents' one, and the sample's key exports with every answer labelled.
    """
    from tracestore.trainer.config import TrainConfig
    from tracestore.trainer.http_agents import run_over_http
    from tracestore.trainer.sample import Sample
    from tracestore.trainer.task import Problem

    engine = _scripted_engine(answers)
    engine.start()
    try:
        g = next(_gw(gateways, url, engine.url))
        s = Sample.new(sid(), Problem("p1", start=2, target=9), max_calls=3)
        (out,), seen = run_over_http(g.url, [s], TrainConfig(url=url, run=g.run, http_retries=0), "agents")
        played = [m["content"] for m in out.messages if m["role"] == "assistant"]
        assert (out.status, out.finish, out.value, seen.gave_up) == ("completed", finish, value, 0)
        assert played == answers[: len(played)]
        # the sample's conversation is the recorded path: one branch, every answer generated
        tr = g.store.export_training_trace(out.sid, out.final_key())
        generated = [t for t, label in zip(tr.input_ids, tr.labels, strict=True) if label != -100]
        assert BuiltinTokenizer().decode(generated) == "".join(a + "<|im_end|>" for a in played)
        keys = g.store.trace_keys(out.sid)
        assert len(keys) == 2 * len(played) and all(b.startswith(a) for a, b in zip(keys, keys[1:], strict=False))
        g.store.close()
    finally:
        engine.stop()


# -- concurrency ------------------------------------------------------------------------------------


def test_64_concurrent_sessions(gw: GW) -> None:
    owner = f"agents:{uuid.uuid4().hex[:6]}"
    sids = [sid() for _ in range(64)]

    async def agent(client: openai.AsyncOpenAI, s: str) -> int:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"reach 5 from {len(s) % 9}"}]
        total = 0
        for _ in range(2):
            r = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6,
                extra_headers={"X-Session-Id": s, "X-Tracestore-Owner": owner},
            )
            total += r.usage.completion_tokens
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
        return total

    async def main() -> list[int]:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(agent(client, s) for s in sids))

    totals = asyncio.run(main())
    assert sorted(gw.store.sessions(owner)) == sorted(sids)
    for s, total in zip(sids, totals, strict=True):
        assert labelled(gw.trace(s)) == total
    assert gw.store.gate.drain(10).drained
    assert gw.store.gate.status().poisoned == 0


# -- the gate and the router -------------------------------------------------------------------------


def test_sealed_gate_503_then_success_after_reopen(gateways: _Gateways, engine: CliServer, url: str) -> None:
    """``--on-weight-update abort``: a sealed gate answers 503 (continue mode holds the request:
    tests/test_gateway_continue.py)."""
    gw = next(_gw(gateways, url, engine.url, "--on-weight-update", "abort"))
    client, s = gw.oai(), sid()
    messages = [{"role": "user", "content": "reach 3 from 1"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s})
    assert gw.store.gate.drain(10).drained
    gw.store.gate.seal(retry_after_ms=250)
    try:
        before = dump_run(gw.store)
        with pytest.raises(openai.InternalServerError) as ei:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s})
        assert ei.value.status_code == 503
        assert ei.value.response.headers["retry-after"] == "1" and ei.value.response.headers["retry-after-ms"] == "250"
        assert isinstance(ei.value.body, dict) and ei.value.body["code"] == "gate_sealed"
        with pytest.raises(anthropic.InternalServerError) as ea:
            gw.claude().messages.create(model=MODEL, max_tokens=2, messages=messages, extra_headers={"X-Session-Id": s})
        assert ea.value.status_code == 503 and ea.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert dump_run(gw.store) == before  # a refused request writes nothing

        # an SDK client with retries rides out the seal by itself
        out: dict[str, Any] = {}

        def call() -> None:
            out["r"] = gw.oai(max_retries=30).chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s}, extra_body=LONG
            )

        t = threading.Thread(target=call)
        t.start()
        assert gw.server.wait_metric("tracestore_gateway_sealed_total", 3, reason="gate_sealed") >= 3
    finally:
        gw.store.gate.reopen()
    t.join(30)
    assert out["r"].usage.completion_tokens == 2


def test_retired_and_released_sessions_get_410(gw: GW) -> None:
    client = gw.oai()
    messages = [{"role": "user", "content": "reach 3 from 1"}]
    retired, released = sid(), sid()
    for s in (retired, released):
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s, "X-Tracestore-Owner": "agents:x"}
        )
    assert gw.store.router([gw.engine_url]).retire([retired]) == [retired]
    assert gw.store.release([released], "agents:x", "test") == [released]
    for s, code in ((retired, "session_retired"), (released, "session_released")):
        with pytest.raises(openai.APIStatusError) as ei:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s})
        assert ei.value.status_code == 410 and ei.value.body["code"] == code  # type: ignore[index]
        with pytest.raises(anthropic.APIStatusError) as ea:
            gw.claude().messages.create(model=MODEL, max_tokens=2, messages=messages, extra_headers={"X-Session-Id": s})
        assert ea.value.status_code == 410 and ea.value.body["type"] == "error"  # type: ignore[index]
    assert gw.server.metric("tracestore_gateway_gone_total", reason="retired") >= 2
    assert gw.store.gate.drain(10).drained and gw.store.gate.status().poisoned == 0


# -- failures mid-request ----------------------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts_and_records_nothing(gw: GW, engine: CliServer) -> None:
    client, s = gw.oai(), sid()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "reach 3 from 1"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_headers={"X-Session-Id": s})
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    data_before = session_data(gw.store, s)
    aborted = engine.get("/get_model_info").json()["aborted"]
    gone = gw.server.metric("tracestore_gateway_aborted_total", reason="client_disconnect")
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1500, stream=True, extra_headers={"X-Session-Id": s}, extra_body=LONG
    )
    it = iter(stream)
    got = [next(it) for _ in range(3)]  # the answer is streaming
    assert any(c.choices and c.choices[0].delta.content for c in got)
    stream.close()
    assert gw.server.wait_metric("tracestore_gateway_aborted_total", gone + 1, reason="client_disconnect") == gone + 1
    assert gw.store.gate.drain(10).drained
    assert lease_outcomes(gw.store, s) == ["completed", "aborted"]
    assert session_data(gw.store, s) == data_before  # nothing recorded
    deadline = time.monotonic() + 10
    while engine.get("/get_model_info").json()["aborted"] == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get("/get_model_info").json()["aborted"] > aborted  # the engine stopped generating


def test_engine_killed_mid_request_502_and_lease_aborted_not_poisoned(gateways: _Gateways, url: str) -> None:
    """A lost engine connection is ``engine_lost``; the request is then shown stopped (its engine is
    gone: it refuses connections), so its lease is settled ``aborted`` and nothing is poisoned (issue
    25: a dead engine needs no operator)."""
    eng = CliServer("engine", "--port", "0", "--max-len", "2048").start()
    try:
        g = next(_gw(gateways, url, eng.url, "--engine-wait", "0"))  # fails at once (test_gateway_engines: the wait)
        client, s = g.oai(), sid()
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1800,
                    extra_headers={"X-Session-Id": s}, extra_body=LONG,
                )
            except openai.APIStatusError as exc:
                out["err"] = exc

        before = eng.get("/get_model_info").json()["requests"]
        t = threading.Thread(target=call)
        t.start()
        assert g.server.wait_metric("tracestore_gateway_in_flight", 1) == 1
        # (the gateway counts the request before it opens, admits and sends it): wait until the
        # engine has it; it is then generating (1800 tokens take seconds)
        deadline = time.monotonic() + 30
        while eng.get("/get_model_info").json()["requests"] == before:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        time.sleep(0.2)
        eng.kill()
        t.join(30)
        err = out["err"]
        assert err.status_code == 502 and err.body["code"] == "engine_lost"
        assert lease_outcomes(g.store, s) == ["aborted"]
        assert g.store.gate.status().poisoned == 0  # provably stopped: a weight update need not wait
        assert session_data(g.store, s) == {}

        # the engine is down: the request never reaches it, its outcome is known (failed, not poisoned)
        s2 = sid()
        with pytest.raises(openai.APIStatusError) as ei:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_headers={"X-Session-Id": s2})
        assert ei.value.status_code == 502 and ei.value.body["code"] == "engine_unreachable"  # type: ignore[index]
        assert lease_outcomes(g.store, s2) == ["failed"]
        assert g.store.gate.status().poisoned == 0
        g.store.close()
    finally:
        eng.stop()


def test_weight_update_aborts_requests_in_flight_and_clients_retry(gateways: _Gateways, engine: CliServer, url: str) -> None:
    """``--on-weight-update abort``: requests in flight are aborted, answered 503, retried by the SDK."""
    gw = next(_gw(gateways, url, engine.url, "--on-weight-update", "abort"))
    gen = 1500  # tokens per answer (the engine's context is 2048): the three requests are in flight together, even on a busy machine
    sids = [sid() for _ in range(3)]
    results: dict[str, Any] = {}
    version = gw.store.gate.status().version + 1

    def agent(s: str) -> None:
        try:
            results[s] = gw.oai(max_retries=10).chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "reach 3 from 1"}], max_tokens=gen,
                extra_headers={"X-Session-Id": s}, extra_body=LONG,
            )
        except Exception as exc:  # reported below
            results[s] = exc

    aborted = gw.server.metric("tracestore_gateway_aborted_total", reason="weight_update")
    threads = [threading.Thread(target=agent, args=(s,)) for s in sids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while gw.store.gate.status().live < 3 and not results and time.monotonic() < deadline:  # all three admitted
        time.sleep(0.01)
    assert gw.store.gate.status().live == 3, results  # an answer or an error before that: say which
    with gw.store.gate.weight_update(version, drain_timeout_s=30) as drained:
        assert drained.drained and drained.poisoned == 0
        assert engine.post("/update_weight_version", {"new_version": version}).status == 200
    for t in threads:
        t.join(60)
    assert gw.store.gate.drain(10).drained  # (a completed turn's lease is settled after its answer)
    for s in sids:
        raw = results[s]
        assert not isinstance(raw, Exception), raw
        assert raw.headers["x-tracestore-version"] == str(version)
        assert raw.parse().usage.completion_tokens == gen
        tr = gw.trace(s)
        assert set(tr["versions"]) == {version}  # the aborted attempt recorded nothing
        assert lease_outcomes(gw.store, s) == ["aborted", "completed"]
    assert gw.server.metric("tracestore_gateway_aborted_total", reason="weight_update") - aborted == 3


@pytest.mark.parametrize("change", ["stored again", "gone"])
def test_a_prefix_stored_again_since_the_gateway_read_it_is_409_prefix_changed(gw: GW, change: str) -> None:
    """The answer is generated after the prefix's tokens as the gateway read them (here from its
    cache, still current by version and chain); when the store holds that prefix from another write
    (a rollback and another writer would do it; here by hand: same records, another write id),
    the turn is refused 409 prefix_changed and nothing is recorded. Once the index's chain says
    so too (#v's chain, as any real write does), the client's retry is recorded on the stored prefix."""
    client, s = gw.oai(), sid()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "reach 3 from 1"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_headers={"X-Session-Id": s})
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    r: Any = gw.store.redis
    idx = gw.store.keys.idx(s)
    if change == "stored again":
        for f, v in r.hgetall(idx).items():  # every node stored again by another write
            if not f.startswith(b"#"):
                head, rest = v.split(b",", 1)
                r.hset(idx, f, head.split(b".")[0] + b".0badf00d," + rest)
    else:  # the rollback lost turn 1's answer (a leaf: the prefix of turn 2)
        leaf = max(
            (f for f in r.hgetall(idx) if not f.startswith(b"#")),
            key=lambda f: int(r.hget(idx, f).split(b",")[0].split(b".")[0]),
        )
        num = r.hget(idx, leaf).split(b",")[0].split(b".")[0]
        r.hdel(idx, leaf)
        r.hdel(gw.store.keys.tok(s), num)
        r.hdel(gw.store.keys.txt(s), num)
    before = r.hgetall(idx)
    with pytest.raises(openai.ConflictError) as ei:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_headers={"X-Session-Id": s})
    assert ei.value.code == "prefix_changed"
    assert ("stored again" if change == "stored again" else "no longer stored") in str(ei.value)
    assert r.hgetall(idx) == before  # nothing recorded
    assert lease_outcomes(gw.store, s)[-1] == "failed"
    version = r.hget(idx, "#v").split(b".")[0]
    r.hset(idx, "#v", version + b".0badf00d0badf00d")  # the index's chain, as the other write would leave it
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_headers={"X-Session-Id": s})
    assert again.choices[0].message.content is not None
    assert len(r.hgetall(idx)) > len(before)  # the retry is recorded, under the stored prefix


# -- bad input ---------------------------------------------------------------------------------------


def test_bad_input_4xx_native_shape_nothing_written(gw: GW) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    fresh = sid()
    oai_cases: list[tuple[Any, dict[str, str], int]] = [
        (b"{not json", {}, 400),
        (b"[1, 2]", {}, 400),
        ({"model": MODEL}, {}, 400),
        ({"model": MODEL, "messages": []}, {}, 400),
        ({"model": "no-such-model", "messages": msgs, "session_id": fresh}, {}, 404),
        ({"model": MODEL, "messages": msgs}, {"X-Session-Id": "has space"}, 400),
        ({"model": MODEL, "messages": msgs, "session_id": "{braces}"}, {}, 400),
        ({"model": MODEL, "messages": msgs, "session_id": 12}, {}, 400),
        ({"model": MODEL, "messages": msgs, "session_id": fresh}, {"X-Tracestore-Owner": "a b"}, 400),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}], "session_id": fresh}, {}, 400),
        ({"model": MODEL, "messages": msgs, "temperature": "hot", "session_id": fresh}, {}, 400),
        ({"model": MODEL, "messages": msgs, "n": 2, "session_id": fresh}, {}, 400),
        ({"model": MODEL, "messages": msgs, "max_tokens": 0, "session_id": fresh}, {}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}], "session_id": fresh}, {}, 400),
        ({"model": MODEL, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}], "session_id": fresh}, {}, 400),
        (json.dumps({"model": MODEL, "messages": msgs, "pad": "x" * (1 << 20), "session_id": fresh}).encode(), {}, 413),
    ]
    claude_cases: list[tuple[Any, dict[str, str], int]] = [
        (b"{not json", {}, 400),
        ({"model": MODEL, "messages": msgs, "session_id": fresh}, {}, 400),  # no max_tokens
        ({"model": MODEL, "max_tokens": 4, "messages": [], "session_id": fresh}, {}, 400),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}], "session_id": fresh}, {}, 400),
        ({"model": MODEL, "max_tokens": 4, "messages": msgs}, {"X-Session-Id": "bad\tid"}, 400),
        ({"model": "no-such-model", "max_tokens": 4, "messages": msgs, "session_id": fresh}, {}, 404),
        (json.dumps({"model": MODEL, "max_tokens": 4, "messages": msgs, "pad": "x" * (1 << 20)}).encode(), {}, 413),
    ]
    before = dump_run(gw.store)
    for body, headers, status in oai_cases:
        r = gw.server.post("/v1/chat/completions", body, headers)
        assert r.status == status, (body if not isinstance(body, bytes) else body[:60], r.text)
        e = r.json()
        assert e["object"] == "error" and e["message"] and e["type"], e
    for body, headers, status in claude_cases:
        r = gw.server.post("/v1/messages", body, {"anthropic-version": "2023-06-01", **headers})
        assert r.status == status, (body if not isinstance(body, bytes) else body[:60], r.text)
        e = r.json()
        assert e["type"] == "error" and e["error"]["type"] and e["error"]["message"], e
    assert dump_run(gw.store) == before


# -- endpoints ------------------------------------------------------------------------------------


def test_models_health_metrics_and_plain_proxy(gw: GW) -> None:
    assert [m.id for m in gw.oai().models.list()] == [MODEL]
    assert gw.server.get("/v1/models", {"anthropic-version": "2023-06-01"}).json()["data"][0]["type"] == "model"
    health = gw.server.get("/health")
    assert health.json()["status"] == "ok"
    # served by the gateway's own HTTP server (tracestore.gateway.h1), not aiohttp's (which names itself)
    assert not [v for k, v in health.headers.items() if k.lower() == "server" and "aiohttp" in v], health.headers
    before = dump_run(gw.store)
    r = gw.oai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3, extra_body=LONG)
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens > 0
    assert dump_run(gw.store) == before  # no session id: a plain proxy, nothing recorded
    text = gw.server.get("/metrics").text
    for name in (
        "tracestore_gateway_requests_total",
        "tracestore_gateway_in_flight",
        'tracestore_gateway_latency_seconds_bucket{le="0.001",part="tracestore"}',
        'tracestore_gateway_latency_seconds_count{part="engine"}',
        'tracestore_gateway_latency_seconds_count{part="total"}',
        'tracestore_gateway_tokens_total{kind="prompt"}',
    ):
        assert name in text, name
    assert gw.server.metric("tracestore_gateway_requests_total", route="chat_completions", status="200") > 0
    r404 = gw.server.get("/v1/sessions/never-seen/trace")
    assert r404.status == 404 and r404.json()["object"] == "error"


# -- Hugging Face tokenizer -------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content or '' }}{%- for tc in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real byte-level BPE tokenizer (under the engine's 321 ids) with a ChatML template, saved to disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [SYSTEM, "reach 7 from 3", "add 3", "sub 4", "mul 2", "done", "<tool_call>", '{"name": "add"}'] * 20
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    d = tmp_path_factory.mktemp("hf-tokenizer") / "tiny-chatml"
    hf.save_pretrained(str(d))
    return d


def test_hf_tokenizer_tool_parsing_round_trips(hf_dir: Path) -> None:
    tok = HFTokenizer(str(hf_dir))
    assert len(tok.encode("reach 7 from 3")) > 0 and tok.vocab_size <= 321
    text = '<tool_call>\n{"name": "add", "arguments": {"n": 3}}\n</tool_call>'
    content, calls = tok.parse_tool_calls(text, TOOLS)
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("add", {"n": 3})])
    msg = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"n": 3}}}]}
    rendered = tok.render([{"role": "user", "content": "x"}, msg], TOOLS, False)
    assert text in rendered  # the template writes back what the parser read
    assert tok.parse_tool_calls("<tool_call>not json</tool_call>", TOOLS)[1] == []


def test_hf_tokenizer_gateway_records_its_tokens(gateways: _Gateways, engine: CliServer, url: str, hf_dir: Path) -> None:
    g = next(_gw(gateways, url, engine.url, "--tokenizer", str(hf_dir)))
    tok = HFTokenizer(str(hf_dir))
    client, s = g.oai(), sid()
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "reach 7 from 3"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"n": 4}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "= 7"},
    ]
    models = client.models.list()
    assert [m.id for m in models] == ["tiny-chatml"]
    completions = []
    r = client.chat.completions.create(model="tiny-chatml", messages=history, tools=TOOLS, max_tokens=6, extra_headers={"X-Session-Id": s})
    completions.append(r.usage.completion_tokens)
    history += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "done?"}]
    r2 = client.chat.completions.create(model="tiny-chatml", messages=history, tools=TOOLS, max_tokens=6, extra_headers={"X-Session-Id": s})
    completions.append(r2.usage.completion_tokens)
    tr = g.trace(s)
    assert labelled(tr) == sum(completions)
    # the first prompt is the HF template's rendering (arguments parsed from their JSON string), tokenised by HF
    canonical = [dict(m) for m in history[:4]]
    canonical[2] = {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "add", "arguments": {"n": 4}}}]}
    want = tok.encode(tok.render(canonical, TOOLS, True))
    assert tr["input_ids"][: r.usage.prompt_tokens] == want
    g.store.close()


# -- the command line ----------------------------------------------------------------------------


def test_cli_help_and_one_line_errors(standalone_url: str, engine: CliServer) -> None:
    import subprocess

    from tests._gateway import BIN

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*BIN, *args], capture_output=True, text=True, timeout=120)

    h = run("gateway", "--help")
    assert h.returncode == 0 and "X-Session-Id" in h.stdout and "--tokenizer" in h.stdout
    assert "SGLang" in run("engine", "--help").stdout
    for args, needle in (
        (("gateway",), "Missing option '--engine'"),
        (("gateway", "--engine", "localhost:30000"), "expected http://host:port"),
        (("gateway", "--engine", engine.url, "--url", standalone_url, "--tokenizer", "/no/such/dir"), "not a directory"),
        (("gateway", "--engine", engine.url, "--url", standalone_url, "--owner", "a b"), "owner"),
    ):
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) <= 4, r.stderr  # click usage + one line
    port = engine.url.rsplit(":", 1)[1]
    busy = run("gateway", "--engine", engine.url, "--url", standalone_url, "--port", port)
    assert busy.returncode == 1 and "cannot listen" in busy.stderr
