"""The gateway behind each engine adapter: the official SDKs through a real gateway in front of
``tracestore engine --api sglang`` and ``--api vllm`` (the same reference policy in either shape).

The same conversations, greedy, give the same traces through both adapters; a weight update
aborts the requests in flight on both; an engine killed mid-request is ``engine_lost`` and a
refused connection ``engine_unreachable`` on both. (The wire formats, failures and gating in
depth are tests/test_gateway.py's, through the default adapter.)
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests._gateway import CliServer, lease_outcomes, settled_outcomes
from tests.test_gateway import CLAUDE_TOOLS, LONG, MODEL, SYSTEM, TOOLS, labelled
from tracestore import TraceStore

APIS = ("sglang", "vllm")


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, CliServer]]:
    """The warm-started reference policy in both shapes (greedy: a tool call first)."""
    made = {
        api: CliServer("engine", "--api", api, "--port", "0", "--max-len", "2048", "--warmup-steps", "40", "--seed", "0").start()
        for api in APIS
    }
    yield made
    for e in made.values():
        e.stop()


class Gw:
    def __init__(self, url: str, engine: str, api: str, *extra: str) -> None:
        self.run = f"gwe-{uuid.uuid4().hex[:10]}"
        self.server = CliServer(
            "gateway", "--engine", engine, "--engine-api", api, "--url", url, "--run", self.run, "--port", "0", *extra
        ).start()
        self.store = TraceStore.connect(url, run=self.run)

    def oai(self, max_retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=max_retries)

    def claude(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.server.url, api_key="unused", max_retries=0)

    def trace(self, sid: str) -> dict[str, Any]:
        r = self.server.get(f"/v1/sessions/{sid}/trace")
        assert r.status == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.server.stop()
        self.store.close()


@pytest.fixture(scope="module")
def gws(engines: dict[str, CliServer], standalone_url: str) -> Iterator[dict[str, Gw]]:
    made = {api: Gw(standalone_url, engines[api].url, api, "--on-weight-update", "abort") for api in APIS}
    yield made
    for g in made.values():
        g.close()


def _conversations(g: Gw, tag: str) -> tuple[dict[str, dict[str, Any]], int]:
    """Four 3-turn sessions (openai and anthropic, streamed and not, with tools): their traces and
    how many tool calls the answers made."""
    out: dict[str, dict[str, Any]] = {}
    ncalls = 0
    for stream in (False, True):
        s = f"{tag}-oai-{int(stream)}-{uuid.uuid4().hex[:6]}"
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 7 from 3"}]
        done = 0
        for turn in range(3):
            r = g.oai().chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0, stream=stream,
                stream_options={"include_usage": True} if stream else None, extra_headers={"X-Session-Id": s},
            )
            if stream:
                chunks = list(r)
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
                done += chunks[-1].usage.completion_tokens
                msg: dict[str, Any] = {"role": "assistant", "content": content or None}
                ncalls += len(calls)
                if calls:
                    msg["tool_calls"] = [
                        {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                        for tc in calls
                    ]
                    messages.append(msg)
                    messages += [{"role": "tool", "tool_call_id": tc.id, "content": "= 4"} for tc in calls]
                else:
                    messages += [msg, {"role": "user", "content": f"then {turn}"}]
            else:
                done += r.usage.completion_tokens
                m = r.choices[0].message
                messages.append(m.model_dump(exclude_none=True))
                ncalls += len(m.tool_calls or [])
                if m.tool_calls:
                    messages += [{"role": "tool", "tool_call_id": tc.id, "content": "= 4"} for tc in m.tool_calls]
                else:
                    messages.append({"role": "user", "content": f"then {turn}"})
        tr = g.trace(s)
        assert labelled(tr) == done  # one path: every generated token is labelled
        out[f"openai-stream={stream}"] = tr
    for stream in (False, True):
        s = f"{tag}-claude-{int(stream)}-{uuid.uuid4().hex[:6]}"
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "reach 7 from 3"}]
        done = 0
        for turn in range(3):
            kw: dict[str, Any] = dict(model=MODEL, max_tokens=8, system=SYSTEM, messages=msgs, tools=CLAUDE_TOOLS,
                                      extra_headers={"X-Session-Id": s}, extra_body={"temperature": 0})
            if stream:
                with g.claude().messages.stream(**kw) as st:
                    m = st.get_final_message()
            else:
                m = g.claude().messages.create(**kw)
            done += m.usage.output_tokens
            msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
            uses = [b for b in m.content if b.type == "tool_use"]
            ncalls += len(uses)
            if uses:
                msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "= 4"} for b in uses]})
            else:
                msgs.append({"role": "user", "content": f"then {turn}"})
        tr = g.trace(s)
        assert labelled(tr) == done
        out[f"anthropic-stream={stream}"] = tr
    return out, ncalls


def test_sdks_multi_turn_with_tools_give_the_same_traces_through_both_adapters(gws: dict[str, Gw]) -> None:
    runs = {api: _conversations(g, api) for api, g in gws.items()}
    got = {api: traces for api, (traces, _) in runs.items()}
    for name, tr in got["sglang"].items():
        other = got["vllm"][name]
        assert tr["input_ids"] == other["input_ids"], name
        assert tr["labels"] == other["labels"], name
        assert tr["versions"] == other["versions"], name
        assert tr["logprobs"] == pytest.approx(other["logprobs"], abs=1e-4), name
    # the warm-started policy calls tools: the same calls went through both, streamed and not
    assert runs["sglang"][1] == runs["vllm"][1] > 0
    for g in gws.values():
        assert g.store.gate.drain(10).drained


@pytest.mark.parametrize("api", APIS)
def test_a_weight_update_aborts_requests_in_flight(gws: dict[str, Gw], engines: dict[str, CliServer], api: str) -> None:
    """``--on-weight-update abort`` (the continue mode through both adapters: tests/test_gateway_continue.py)."""
    g = gws[api]
    s = f"wu-{uuid.uuid4().hex[:8]}"
    result: dict[str, Any] = {}
    version = g.store.gate.status().version + 1

    def agent() -> None:
        try:
            result["r"] = g.oai(max_retries=10).chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "reach 3 from 1"}], max_tokens=600,
                extra_headers={"X-Session-Id": s}, extra_body=LONG,
            )
        except Exception as exc:  # reported below
            result["r"] = exc

    t = threading.Thread(target=agent)
    t.start()
    deadline = time.monotonic() + 30
    while g.store.gate.status().live < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with g.store.gate.weight_update(version, drain_timeout_s=30) as drained:
        assert drained.drained
    t.join(60)
    raw = result["r"]
    assert not isinstance(raw, Exception), raw
    assert raw.headers["x-tracestore-version"] == str(version)
    outcomes = settled_outcomes(g.store, s)
    assert outcomes[-1] == "completed" and "aborted" in outcomes
    assert set(g.trace(s)["versions"]) == {version}


@pytest.mark.parametrize("api", APIS)
def test_a_killed_engine_is_engine_lost_and_a_refused_one_engine_unreachable(standalone_url: str, api: str) -> None:
    eng = CliServer("engine", "--api", api, "--port", "0", "--max-len", "2048").start()
    g = Gw(standalone_url, eng.url, api, "--engine-wait", "0")  # fail at once (the wait: the next test)
    try:
        s = f"kill-{uuid.uuid4().hex[:8]}"
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                g.oai().chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1800,
                    extra_headers={"X-Session-Id": s}, extra_body=LONG,
                )
            except openai.APIStatusError as exc:
                out["err"] = exc

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 30
        while eng.get("/get_model_info").json()["generated_tokens"] < 5:  # generating
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        eng.kill()
        t.join(30)
        assert out["err"].status_code == 502 and out["err"].body["code"] == "engine_lost"
        assert lease_outcomes(g.store, s) == ["aborted"]  # its engine is gone: provably stopped
        assert g.store.gate.status().poisoned == 0
        s2 = f"refused-{uuid.uuid4().hex[:8]}"
        with pytest.raises(openai.APIStatusError) as ei:
            g.oai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_headers={"X-Session-Id": s2})
        assert ei.value.status_code == 502 and ei.value.body["code"] == "engine_unreachable"  # type: ignore[index]
        assert lease_outcomes(g.store, s2) == ["failed"]
    finally:
        g.close()
        eng.stop()


@pytest.mark.parametrize("api", APIS)
def test_an_engine_restarted_within_the_wait_costs_the_agents_nothing(standalone_url: str, api: str) -> None:
    """The engine is killed under a streamed answer and restarted on its port within ``--engine-wait``:
    the stream goes on where it was cut, whole, and a turn sent while no engine listened is answered
    once it is back; each is recorded once, every lease is settled, nothing is poisoned."""
    eng = CliServer("engine", "--api", api, "--port", "0", "--max-len", "2048").start()
    port = eng.url.rsplit(":", 1)[1]
    g = Gw(standalone_url, eng.url, api, "--engine-wait", "60")
    again: CliServer | None = None
    try:
        s1, s2 = f"cut-{uuid.uuid4().hex[:8]}", f"down-{uuid.uuid4().hex[:8]}"
        out: dict[str, Any] = {}

        def streamed() -> None:
            ids: list[str] = []
            stream = g.oai(max_retries=2).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=400, stream=True,
                stream_options={"include_usage": True}, extra_headers={"X-Session-Id": s1}, extra_body=LONG,
            )
            for chunk in stream:
                if chunk.choices:
                    ids.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    out["usage"] = chunk.usage
            out["text"] = "".join(ids)

        def whole() -> None:
            r = g.oai(max_retries=2).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "y"}], max_tokens=40, extra_headers={"X-Session-Id": s2}, extra_body=LONG,
            )
            out["whole"] = r

        t1 = threading.Thread(target=streamed)
        t1.start()
        deadline = time.monotonic() + 30
        while eng.get("/get_model_info").json()["generated_tokens"] < 20:  # the stream is under way
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        eng.kill()
        t2 = threading.Thread(target=whole)  # sent while no engine listens
        t2.start()
        assert g.server.wait_metric("tracestore_gateway_in_flight", 2) == 2
        time.sleep(0.5)
        again = CliServer("engine", "--api", api, "--port", port, "--max-len", "2048").start()
        t1.join(120)
        t2.join(120)
        assert out["usage"].completion_tokens == 400 and "whole" in out  # no error seen by either agent
        assert out["whole"].usage is not None and out["whole"].usage.completion_tokens == 40
        tr = g.trace(s1)
        assert labelled(tr) == 400  # one answer of 400 tokens, recorded once
        assert settled_outcomes(g.store, s1) == ["aborted", "completed"]
        o2 = settled_outcomes(g.store, s2)
        assert o2[-1] == "completed" and set(o2) <= {"aborted", "completed"}
        assert g.store.gate.status().poisoned == 0 and g.store.gate.status().live == 0
        assert g.server.metric("tracestore_gateway_engine_waits_total", event="resumed") >= 2
        assert g.server.metric("tracestore_gateway_requests_total", route="chat_completions", status="502") == 0
    finally:
        g.close()
        eng.stop()
        if again is not None:
            again.stop()
