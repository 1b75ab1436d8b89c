"""Routed experts through the gateway: engine -> gateway's RefHolder -> expert keys in the trace.

A gateway embedded in this process (``start_gateway``, as a Ray actor would
run it) with a real :class:`~tracestore.ray.RefHolder` on a real local Ray,
in front of a real ``tracestore engine`` process; the official ``openai`` SDK
as the agent.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import ray

from tests._gateway import CliServer, http
from tracestore import TraceStore
from tracestore.gateway import GATEWAY, GatewayConfig, start_gateway
from tracestore.ray import RefHolder, expert_values

pytestmark = [pytest.mark.ray, pytest.mark.backends("valkey", "cluster")]  # gateway processes: tests/conftest.py, backends


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine() -> Iterator[CliServer]:
    e = CliServer("engine", "--port", "0", "--seed", "3").start()
    yield e
    e.stop()


def test_routed_experts_go_to_the_holder_and_the_trace(url: str, run_id: str, engine: CliServer) -> None:
    store = TraceStore.connect(url, run=run_id)
    holder = RefHolder(store, reconcile_s=1.0)
    server = start_gateway(GatewayConfig(engines=(engine.url,), url=url, run=run_id), holder=holder)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        sid = f"x-{uuid.uuid4().hex[:8]}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "reach 7 from 3"}]
        completions = 0
        for turn in range(3):
            kw: dict[str, Any] = dict(model="tracestore-reference", messages=messages, max_tokens=5, extra_headers={"X-Session-Id": sid, "X-Tracestore-Owner": "agents:r3"})
            if turn == 1:  # one streamed turn: the experts come with the last chunk
                chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                answer: dict[str, Any] = {"role": "assistant", "content": text}
                completions += next(c.usage.completion_tokens for c in chunks if c.usage is not None)
            else:
                r = client.chat.completions.create(**kw)
                completions += r.usage.completion_tokens
                answer = r.choices[0].message.model_dump(exclude_none=True)
            messages += [answer, {"role": "user", "content": f"then {turn}"}]
        assert server.app is not None and server.app[GATEWAY].holder is holder
        tr = http("GET", f"{server.url}/v1/sessions/{sid}/trace").json()
        assert sum(1 for x in tr["labels"] if x != -100) == completions
        keys = tr["expert_keys"]
        assert keys is not None and len(keys) == 6  # a delta node and a response node per turn, each with its part
        # kept in the gateway's process, nothing put on the turns' path; one object when lent
        assert holder.stats().kept == 6 and holder.stats().refs == 6
        refs = holder.get(keys)
        assert len(set(refs)) == 1 and holder.stats().kept == 0 and holder.stats().refs == 1
        parts = expert_values(keys, refs)
        del refs
        routing = np.concatenate([np.asarray(p) for p in parts])[1:]  # the dummy row dropped
        assert routing.shape == (len(tr["input_ids"]) - 1, 2, 2)  # [tokens - 1, layers, top_k]
        assert routing.dtype == np.int32 and routing.min() >= 0 and routing.max() < 4
        assert holder.stats().sessions == 1 and holder.stats().bytes > 0

        store.release([sid], "agents:r3", "test")  # the release event frees the refs
        deadline = time.monotonic() + 15
        while holder.stats().refs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holder.stats().refs == 0
    finally:
        server.stop()
        holder.close()
        store.close()



@pytest.fixture(scope="module")
def long_engine() -> Iterator[CliServer]:
    """An engine with room for a long answer: the seal must land while the turn still generates."""
    e = CliServer("engine", "--port", "0", "--seed", "3", "--max-len", "2048").start()
    yield e
    e.stop()


def test_a_held_turn_resumed_on_another_gateway_keeps_its_routed_experts(
    url: str, run_id: str, long_engine: CliServer
) -> None:
    """A weight update holds a turn on gateway A, whose tokens are kept in the store with the routed
    experts they were generated with; A goes away; the client's retry on B resumes from them, and
    the recorded turn has the routing of every token (before, the kept tokens' rows stayed in A).

    The answer is long (1,800 tokens) and the seal comes at its 5th: the turn is still generating
    when the gateway's watcher stops it, however slow the machine (with 200 tokens and the seal at
    the 40th, a loaded machine could finish the turn first, and nothing was held).
    """
    import threading

    import orjson

    from tracestore.conversation import conversation_key

    store = TraceStore.connect(url, run=run_id)
    holders = [RefHolder(store, reconcile_s=1.0), RefHolder(store, reconcile_s=1.0)]
    cfg = GatewayConfig(engines=(long_engine.url,), url=url, run=run_id)
    a, b = (start_gateway(cfg, holder=h) for h in holders)
    sid = f"h-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "reach 4 from 2"}]
    body = orjson.dumps({"model": "tracestore-reference", "messages": messages, "max_tokens": 1800, "ignore_eos": True})
    headers = {"X-Session-Id": sid}
    generated = lambda: int(http("GET", long_engine.url + "/get_model_info").json()["generated_tokens"])  # noqa: E731
    def first_attempt() -> None:
        try:
            http("POST", a.url + "/v1/chat/completions", body, headers)
        except OSError:  # its gateway went away under it: the client retries elsewhere
            pass

    try:
        t = threading.Thread(target=first_attempt, daemon=True)
        before = generated()
        t.start()
        deadline = time.monotonic() + 60
        while generated() < before + 5:
            assert time.monotonic() < deadline, "the turn never generated"
            time.sleep(0.01)
        v0 = store.gate.status().version
        store.gate.seal()
        assert store.gate.drain(30).drained
        deadline = time.monotonic() + 30
        while (kept := store.read_partial(sid, conversation_key(messages))) is None:
            assert time.monotonic() < deadline, "the held turn's tokens were not kept"
            time.sleep(0.02)
        assert kept.experts is not None and kept.experts.start + kept.experts.rows == kept.input_len + len(kept.ids)
        a.stop()  # the gateway holding the turn goes away
        store.gate.install(v0 + 1)
        store.gate.reopen()
        r = http("POST", b.url + "/v1/chat/completions", body, headers)  # the client's retry, elsewhere
        assert r.status == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1800  # the whole answer: kept part + the rest
        tr = http("GET", f"{b.url}/v1/sessions/{sid}/trace").json()
        assert tr["expert_keys"] is not None and len(tr["expert_keys"]) == 2 and all(tr["expert_keys"])
        parts = holders[1].values(tr["expert_keys"])
        routing = np.concatenate([np.asarray(p) for p in parts])
        assert routing.shape[0] == len(tr["input_ids"])  # the dummy row, then every token but the last
        shape = (kept.experts.rows, *kept.experts.row_shape)
        rows = np.frombuffer(kept.experts.data, dtype="<i4").reshape(shape)
        at = kept.experts.start
        assert (routing[at : at + kept.experts.rows][1 if at == 0 else 0 :] == rows[1 if at == 0 else 0 :]).all()
    finally:
        for g in (a, b):
            g.stop()
        for h in holders:
            h.close()
        store.close()
