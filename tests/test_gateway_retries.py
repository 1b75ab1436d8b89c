"""A retry of a turn is one turn (docs/gateway.md, Retries), with the official ``openai`` SDK
against real gateway processes and a real ``tracestore engine``, on every backend.

Sent again after the first attempt was recorded: the recorded answer comes back (streamed or
not, as the retry asks), the engine generates once, the session holds one turn; on another
gateway process of the run too. Sent twice at once: the second joins the first. A real SDK
retry after a lost reply (a proxy drops the gateway's answer): one turn.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests._gateway import CliServer
from tests._netcut import CutProxy
from tracestore import TraceStore

MODEL = "tracestore-reference"
MSGS = [{"role": "user", "content": "reach 3 from 1"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[CliServer]:
    # a context of 8,192: the abandoned attempt below generates for ~16 s on a quiet machine
    e = CliServer("engine", "--port", "0", "--max-len", "8192", "--seed", "0").start()
    yield e
    e.stop()


class _Run:
    """Two gateway processes serving one run of one backend."""

    def __init__(self, engine: CliServer, url: str) -> None:
        self.run = f"retry-{uuid.uuid4().hex[:10]}"
        args = ("gateway", "--engine", engine.url, "--url", url, "--run", self.run, "--port", "0", "--retry-grace", "3")
        self.a = CliServer(*args).start()
        self.b = CliServer(*args).start()

    def stop(self) -> None:
        self.a.stop()
        self.b.stop()


@pytest.fixture(scope="module")
def runs(engine: CliServer) -> Iterator[dict[str, _Run]]:
    running: dict[str, _Run] = {}
    yield running
    for r in running.values():
        r.stop()


@pytest.fixture
def gw(runs: dict[str, _Run], engine: CliServer, url: str) -> Iterator[tuple[_Run, TraceStore]]:
    if url not in runs:
        runs[url] = _Run(engine, url)
    st = TraceStore.connect(url, run=runs[url].run)
    yield runs[url], st
    st.close()


def _client(base: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", **{"max_retries": 0, **kw})


def _requests(engine: CliServer) -> int:
    return int(engine.get("/get_model_info").json()["requests"])


def _nodes(st: TraceStore, sid: str) -> int:
    """Nodes stored in the session (a turn is 2: its prompt and its answer)."""
    return sum(1 for f in st.redis.hkeys(st.keys.idx(sid)) if not f.startswith(b"#"))


def _chat(client: openai.OpenAI, sid: str, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSGS, max_tokens=kw.pop("max_tokens", 8), seed=7,
        extra_headers={"X-Session-Id": sid, **(headers or {})}, **kw,
    )


def test_the_same_request_after_the_first_was_recorded_is_replayed(gw: tuple[_Run, TraceStore], engine: CliServer) -> None:
    run, st = gw
    sid = f"r-{uuid.uuid4().hex[:12]}"
    before = _requests(engine)
    replayed = run.a.metric("tracestore_gateway_retries_total", outcome="replayed")
    first = _chat(_client(run.a.url), sid)
    answer = first.parse().choices[0].message
    assert first.headers.get("x-tracestore-retry") is None
    again = _chat(_client(run.a.url), sid)  # the same turn again: the recorded answer
    assert again.headers["x-tracestore-retry"] == "replayed"
    assert again.parse().choices[0].message.content == answer.content
    assert again.parse().usage == first.parse().usage
    # a retry that streams gets the same answer as a stream
    chunks = list(
        _client(run.a.url).chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=8, seed=7, stream=True, extra_headers={"X-Session-Id": sid}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.content
    # on the other gateway process of the run: the answer is in the store
    other = _chat(_client(run.b.url), sid)
    assert other.headers["x-tracestore-retry"] == "replayed"
    assert other.parse().choices[0].message.content == answer.content
    assert _requests(engine) == before + 1  # one generation at the engine
    assert _nodes(st, sid) == 2  # one recorded turn: no orphan sibling
    assert run.a.metric("tracestore_gateway_retries_total", outcome="replayed") == replayed + 2
    # other sampling options are another turn (a new sample beside the first), and so is asking for one
    _chat(_client(run.a.url), sid, max_tokens=5)
    new = _chat(_client(run.a.url), sid, {"X-Tracestore-Retry": "new"})
    assert new.headers.get("x-tracestore-retry") is None
    assert _requests(engine) == before + 3


def test_a_token_id_completion_retried_is_replayed(gw: tuple[_Run, TraceStore], engine: CliServer) -> None:
    run, st = gw
    sid = f"r-{uuid.uuid4().hex[:12]}"
    before = _requests(engine)
    kw: dict[str, Any] = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "seed": 3,
                          "extra_headers": {"X-Session-Id": sid}, "extra_body": {"return_token_ids": True}}
    first = _client(run.a.url).completions.create(**kw)
    again = _client(run.b.url).completions.with_raw_response.create(**kw)
    assert again.headers["x-tracestore-retry"] == "replayed"
    assert again.parse().choices[0].token_ids == first.choices[0].token_ids
    assert again.parse().choices[0].text == first.choices[0].text
    assert _requests(engine) == before + 1 and _nodes(st, sid) == 2


def test_the_same_request_twice_at_once_is_joined(gw: tuple[_Run, TraceStore], engine: CliServer) -> None:
    run, st = gw
    sid = f"r-{uuid.uuid4().hex[:12]}"
    before = _requests(engine)
    joined = run.a.metric("tracestore_gateway_retries_total", outcome="joined")
    out: dict[int, Any] = {}

    def send(i: int) -> None:
        out[i] = _chat(_client(run.a.url), sid, max_tokens=1500, extra_body={"ignore_eos": True}, stream=i == 1)

    t0 = threading.Thread(target=send, args=(0,))
    t0.start()
    run.a.wait_metric("tracestore_gateway_in_flight", 1)
    t1 = threading.Thread(target=send, args=(1,))
    t1.start()
    t0.join(120)
    t1.join(120)
    text0 = out[0].parse().choices[0].message.content
    text1 = "".join(c.choices[0].delta.content or "" for c in out[1].parse() if c.choices)
    assert text1 == text0 and out[1].headers["x-tracestore-retry"] == "joined"
    assert _requests(engine) == before + 1
    assert _nodes(st, sid) == 2
    assert run.a.metric("tracestore_gateway_retries_total", outcome="joined") == joined + 1


def test_an_sdk_retry_after_a_lost_reply_is_one_turn(gw: tuple[_Run, TraceStore], engine: CliServer) -> None:
    run, st = gw
    sid = f"r-{uuid.uuid4().hex[:12]}"
    host, port = run.a.url.removeprefix("http://").rsplit(":", 1)
    with CutProxy(host, int(port)) as proxy:
        before = _requests(engine)
        proxy.arm()  # the gateway answers, the answer is lost on the way: the SDK retries
        client = _client(f"http://127.0.0.1:{proxy.port}", max_retries=2, timeout=30.0)
        r = _chat(client, sid)
        assert proxy.cuts == 1
        assert r.headers["x-tracestore-retry"] == "replayed"
        assert r.parse().choices[0].message.content is not None
    assert _requests(engine) == before + 1
    assert _nodes(st, sid) == 2


def test_an_sdk_retry_after_a_timeout_continues_the_running_attempt(gw: tuple[_Run, TraceStore], engine: CliServer) -> None:
    """The SDK gives up waiting (0.4 s) on a generation of seconds and retries: the first attempt goes on
    without its client, the retry joins it (or, if it too timed out, the next one replays it)."""
    run, st = gw
    sid = f"r-{uuid.uuid4().hex[:12]}"
    before = _requests(engine)
    # 0.4 s is shorter than ~1,900 tokens take even on a quiet machine (so the SDK does retry), and
    # 8 retries back off for long enough to outlast the generation on a loaded one
    client = _client(run.a.url, max_retries=8, timeout=0.4)
    r = _chat(client, sid, max_tokens=1900, extra_body={"ignore_eos": True})
    assert r.headers["x-tracestore-retry"] in ("joined", "replayed")
    assert r.parse().usage.completion_tokens == 1900
    assert _requests(engine) == before + 1  # one generation
    assert _nodes(st, sid) == 2  # one turn, recorded once


def test_a_client_that_leaves_and_never_retries_is_aborted(engine: CliServer, url: str) -> None:
    """Without a retry within the grace period the attempt is aborted, nothing recorded (as without retries).

    A gateway of its own (1 s of grace, and its own abort counter) and an answer of 8,000 tokens, which
    takes ~16 s on a quiet machine: the abort at ~1.5 s comes long before the answer could."""
    run = f"leave-{uuid.uuid4().hex[:10]}"
    gw = CliServer("gateway", "--engine", engine.url, "--url", url, "--run", run, "--port", "0", "--retry-grace", "1").start()
    st = TraceStore.connect(url, run=run)
    try:
        sid = f"r-{uuid.uuid4().hex[:12]}"
        before = _requests(engine)
        with pytest.raises(openai.APITimeoutError):
            _chat(_client(gw.url, timeout=0.5), sid, max_tokens=8000, extra_body={"ignore_eos": True})
        assert gw.wait_metric("tracestore_gateway_aborted_total", 1, timeout_s=30.0, reason="client_disconnect") == 1
        assert _requests(engine) == before + 1
        assert _nodes(st, sid) == 0
        # the session is not poisoned: its next turn is answered and recorded
        _chat(_client(gw.url), sid)
        assert _nodes(st, sid) == 2
    finally:
        st.close()
        gw.stop()


def test_an_anthropic_messages_retry_is_replayed(gw: tuple[_Run, TraceStore], engine: CliServer) -> None:
    run, st = gw
    sid = f"r-{uuid.uuid4().hex[:12]}"
    before = _requests(engine)
    client = anthropic.Anthropic(base_url=run.a.url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": MSGS, "extra_headers": {"X-Session-Id": sid}}
    first = client.messages.create(**kw)
    again = anthropic.Anthropic(base_url=run.b.url, api_key="unused", max_retries=0).messages.with_raw_response.create(**kw)
    assert again.headers["x-tracestore-retry"] == "replayed"
    assert [b.model_dump() for b in again.parse().content] == [b.model_dump() for b in first.content]
    assert again.parse().usage.output_tokens == first.usage.output_tokens
    assert _requests(engine) == before + 1 and _nodes(st, sid) == 2
