"""``POST /v1/completions`` end to end: the official ``openai`` SDK's ``client.completions.create``
with a prompt of token ids (a client that does its own templating) or a text, through a real
``tracestore gateway`` process in front of a real ``tracestore engine``, on every backend.

The trace is exactly the ids sent and generated; a prompt that starts with the session's
stored path extends it, one that edits it forks (``client_edit``); what is not implemented is
a 400 naming the field.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests._gateway import CliServer
from tracestore import TraceStore
from tracestore.gateway.idprompts import token_key
from tracestore.gateway.tokenizer import BuiltinTokenizer

MODEL = "tracestore-reference"
TOK = BuiltinTokenizer()
GREEDY: dict[str, Any] = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine() -> Iterator[CliServer]:
    e = CliServer("engine", "--port", "0", "--max-len", "2048", "--seed", "0").start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def gateways(engine: CliServer) -> Iterator[dict[str, tuple[CliServer, str]]]:
    running: dict[str, tuple[CliServer, str]] = {}
    yield running
    for server, _ in running.values():
        server.stop()


@pytest.fixture
def gw(gateways: dict[str, tuple[CliServer, str]], engine: CliServer, url: str) -> Iterator[tuple[CliServer, TraceStore]]:
    if url not in gateways:
        run = f"cmpl-{uuid.uuid4().hex[:10]}"
        gateways[url] = (CliServer("gateway", "--engine", engine.url, "--url", url, "--run", run, "--port", "0").start(), run)
    server, run = gateways[url]
    st = TraceStore.connect(url, run=run)
    yield server, st
    st.close()


def _client(server: CliServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _sid() -> str:
    return f"c-{uuid.uuid4().hex[:12]}"


def _complete(client: openai.OpenAI, sid: str, prompt: Any, **kw: Any) -> tuple[Any, dict[str, str]]:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=kw.pop("max_tokens", 6), extra_headers={"X-Session-Id": sid},
        extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **GREEDY, **kw,
    )
    return raw.parse(), dict(raw.headers)


def test_token_id_prompts_are_recorded_exactly_and_extend_the_path(gw: tuple[CliServer, TraceStore]) -> None:
    server, st = gw
    client, sid = _client(server), _sid()
    p1 = TOK.encode("<|im_start|>user\nreach 3 from 1<|im_end|>\n<|im_start|>assistant\n")
    r1, h1 = _complete(client, sid, p1, logprobs=1)
    c1 = r1.choices[0]
    out1 = list(c1.token_ids)
    assert c1.prompt_token_ids == p1 and out1 and r1.usage.prompt_tokens == len(p1)
    assert r1.usage.completion_tokens == len(out1) and "x-tracestore-fork" not in h1
    assert c1.text == TOK.decode(out1[:-1] if c1.finish_reason == "stop" else out1)
    tr1 = st.export_training_trace(sid, token_key(p1 + out1))
    assert tr1.input_ids == p1 + out1  # the trace is the ids sent and generated
    assert tr1.labels == [-100] * len(p1) + out1
    assert tr1.logprobs[len(p1):] == pytest.approx(c1.logprobs.token_logprobs, abs=1e-6)

    # the client appends the answer and a new message itself: the path is extended
    p2 = p1 + out1 + TOK.encode("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    r2, h2 = _complete(client, sid, p2)
    out2 = list(r2.choices[0].token_ids)
    assert "x-tracestore-fork" not in h2 and r2.choices[0].prompt_token_ids == p2
    tr2 = st.export_training_trace(sid, token_key(p2 + out2))
    assert tr2.input_ids == p2 + out2
    assert tr2.labels == [-100] * len(p1) + out1 + [-100] * (len(p2) - len(p1) - len(out1)) + out2
    assert [n.fork for n in tr2.nodes] == [None] * len(tr2.nodes)

    # an edited history forks, and says why
    p3 = p1 + out1[:-1] + TOK.encode("x") + p2[len(p1) + len(out1):]
    r3, h3 = _complete(client, sid, p3)
    assert h3.get("x-tracestore-fork") == "client_edit"
    tr3 = st.export_training_trace(sid, token_key(p3 + list(r3.choices[0].token_ids)))
    assert tr3.input_ids[: len(p3)] == p3 and any(n.fork == "client_edit" for n in tr3.nodes)

    # the gateway's own export of the session's latest turn is the same trace
    got = server.get(f"/v1/sessions/{sid}/trace").json()
    assert got["input_ids"] == tr3.input_ids


def test_text_prompts_are_tokenised_as_they_are(gw: tuple[CliServer, TraceStore]) -> None:
    server, st = gw
    client, sid = _client(server), _sid()
    text = "the sum of 1 and 2 is"
    r, _ = _complete(client, sid, text)
    c = r.choices[0]
    assert c.prompt_token_ids == TOK.encode(text)  # no template, no special tokens added
    tr = st.export_training_trace(sid, token_key(TOK.encode(text) + list(c.token_ids)))
    assert tr.input_ids == TOK.encode(text) + list(c.token_ids)
    # without a session: generated, nothing recorded
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=6, **GREEDY)
    assert plain.choices[0].text == c.text and plain.usage.completion_tokens == r.usage.completion_tokens


def test_streamed_completions_carry_the_same_answer(gw: tuple[CliServer, TraceStore]) -> None:
    server, st = gw
    client = _client(server)
    prompt = TOK.encode("<|im_start|>user\nreach 5 from 2<|im_end|>\n<|im_start|>assistant\n")
    whole, _ = _complete(client, _sid(), prompt, max_tokens=12)
    sid = _sid()
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": sid}, extra_body={"return_token_ids": True}, **GREEDY,
        )
    )
    assert all(ch.object == "text_completion" for ch in chunks)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finish = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and list(finish[0].token_ids) == list(whole.choices[0].token_ids)
    assert chunks[0].choices[0].prompt_token_ids == prompt
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    tr = st.export_training_trace(sid, token_key(prompt + list(finish[0].token_ids)))
    assert tr.input_ids == prompt + list(finish[0].token_ids)


@pytest.mark.parametrize(
    ("field", "value"),
    [("echo", True), ("n", 2), ("best_of", 3), ("logprobs", 3), ("suffix", "end"), ("logit_bias", {"5": 1}),
     ("presence_penalty", 0.5), ("prompt", [[1, 2], [3, 4]]), ("prompt", []), ("prompt", [1, -2])],
)
def test_what_is_not_implemented_is_a_400_naming_it(gw: tuple[CliServer, TraceStore], field: str, value: Any) -> None:
    server, st = gw
    sid = _sid()
    body: dict[str, Any] = {"prompt": [1, 2, 3], "max_tokens": 2, field: value}
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model=MODEL, extra_headers={"X-Session-Id": sid}, extra_body=body, prompt=body.pop("prompt"))
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == field, e.value.body
    assert not st.redis.exists(st.keys.idx(sid))  # nothing recorded


def test_ids_outside_the_vocabulary_are_a_400(gw: tuple[CliServer, TraceStore]) -> None:
    server, _ = gw
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        _client(server).completions.create(model=MODEL, prompt=[1, 10**7], max_tokens=2, extra_headers={"X-Session-Id": _sid()})
