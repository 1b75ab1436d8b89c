"""HTTP fuzz of both wire formats (issue 25): malformed input is a 4xx in the caller's shape, never a
500, and a refused request writes nothing.

A real gateway in front of a real engine; bodies drawn by hypothesis (a fixed
seed: the same bodies every run) with every field of a chat request given a
value of a random JSON type, plus the shapes seen to break it before (a
``role`` that is a list or an object, a ``Content-Encoding`` the body does not
have, deep nesting, huge numbers).
"""

from __future__ import annotations

import gzip
import json
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._gateway import CliServer, http
from tests.test_gateway import MODEL
from tracestore import TraceStore

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ROLES = st.sampled_from(["user", "assistant", "system", "tool", "developer", "robot", ""]) | JSON
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={"content": JSON | st.text(max_size=20), "tool_calls": JSON, "tool_call_id": JSON, "reasoning_content": JSON},
)
OPENAI = st.fixed_dictionaries(
    {"model": st.just(MODEL) | JSON, "messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={
        "max_tokens": st.integers(-3, 3) | JSON, "temperature": JSON, "top_p": JSON, "stream": JSON, "tools": JSON,
        "tool_choice": JSON, "stop": JSON, "n": JSON, "seed": JSON, "stream_options": JSON, "logprobs": JSON,
        "chat_template_kwargs": JSON, "session_id": JSON,
    },
)
ANTHROPIC = st.fixed_dictionaries(
    {"model": st.just(MODEL) | JSON, "max_tokens": st.integers(-3, 3) | JSON, "messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={"system": JSON, "tools": JSON, "tool_choice": JSON, "stop_sequences": JSON, "thinking": JSON, "stream": JSON},
)


@pytest.fixture(scope="module")
def setup(standalone_url: str) -> Iterator[tuple[CliServer, TraceStore, dict[str, int]]]:
    engine = CliServer("engine", "--port", "0", "--max-len", "512").start()
    run = f"fuzz-{uuid.uuid4().hex[:8]}"
    gw = CliServer("gateway", "--engine", engine.url, "--url", standalone_url, "--run", run, "--port", "0", "--max-tokens", "4").start()
    st_ = TraceStore.connect(standalone_url, run=run)
    counts: dict[str, int] = {}
    yield gw, st_, counts
    print(f"\nfuzz counts by status: {dict(sorted(counts.items()))}")
    st_.close()
    gw.stop()
    engine.stop()


def _check(setup: tuple[CliServer, TraceStore, dict[str, int]], path: str, body: Any, anthropic: bool, headers: dict[str, str] | None = None) -> None:
    gw, store, counts = setup
    sid = f"f-{uuid.uuid4().hex[:10]}"
    h = {"X-Session-Id": sid, **(headers or {})}
    if anthropic:
        h["anthropic-version"] = "2023-06-01"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # (stdlib: any int size)
    r = http("POST", gw.url + path, raw, h)
    counts[str(r.status)] = counts.get(str(r.status), 0) + 1
    assert r.status < 500 or r.status == 503 and b"gate" in r.body, (r.status, r.text[:500], body)
    if r.status >= 400:
        err = r.json()
        if anthropic:
            assert err["type"] == "error" and isinstance(err["error"]["message"], str)
        else:
            assert err["object"] == "error" and isinstance(err["message"], str)
        data = store.keys.data_keys(sid) if "{" not in sid else []
        assert not any(store.redis.exists(k) for k in data), sid  # type: ignore[union-attr]  # nothing recorded
        assert store.owner_of(sid) in (None, store.owner_of(sid))


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=OPENAI)
def test_openai_bodies(setup: tuple[CliServer, TraceStore, dict[str, int]], body: dict[str, Any]) -> None:
    _check(setup, "/v1/chat/completions", body, False)


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=ANTHROPIC)
def test_anthropic_bodies(setup: tuple[CliServer, TraceStore, dict[str, int]], body: dict[str, Any]) -> None:
    _check(setup, "/v1/messages", body, True)


@pytest.mark.parametrize(
    ("path", "anthropic"), [("/v1/chat/completions", False), ("/v1/messages", True)]
)
def test_the_shapes_that_broke_it_before(setup: tuple[CliServer, TraceStore, dict[str, int]], path: str, anthropic: bool) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    for role in (["user"], {"a": 1}, 3, None):
        _check(setup, path, {**base, "messages": [{"role": role, "content": "hi"}]}, anthropic)
    body = orjson.dumps({**base, "messages": [{"role": "user", "content": "hi"}]})
    for enc in ("gzip", "deflate", "br", "zstd", "bogus"):
        _check(setup, path, body, anthropic, {"Content-Encoding": enc})
    gz = http("POST", setup[0].url + path, gzip.compress(body), {"Content-Encoding": "gzip", **({"anthropic-version": "2023-06-01"} if anthropic else {})})
    assert gz.status == 200, gz.text  # a body that is what its header says is decoded and served
    deep: Any = "x"
    for _ in range(200):
        deep = [deep]
    _check(setup, path, {**base, "messages": deep}, anthropic)
    _check(setup, path, {**base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}, anthropic)
    _check(setup, path, b"\xff\xfe not json", anthropic)
    _check(setup, path, b"[1, 2]", anthropic)
