"""Stateless gateways side by side (issue 16 item 3).

Two ``tracestore gateway`` processes on different ports serve one run, in
front of the same two ``tracestore engine`` processes, as two gateways
behind a round-robin load balancer would. A gateway keeps no session state
of its own (routes, leases and traces are in the store), so:

* an agent (the official ``openai`` SDK) whose turns alternate between the
  two keeps one trie path (the exported trace labels every assistant turn),
  and every turn goes to the session's one sticky engine;
* both answer 503 while the gate is sealed (writing nothing for a known
  session), and 410 for a retired and for a released session (no lease
  left live or poisoned), whichever of them the agent calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from tests._gateway import CliServer, dump_run, lease_outcomes
from tracestore import TraceStore

#: Gateway processes per test: a standalone server and the cluster (tests/conftest.py, backends).
pytestmark = pytest.mark.backends("valkey", "cluster")

MODEL = "tracestore-reference"
SYSTEM = "use add sub mul with one digit then done"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[CliServer]]:
    """Two engines (the reference policy, different seeds)."""
    started: list[CliServer] = []
    try:
        for seed in (0, 1):
            started.append(CliServer("engine", "--port", "0", "--max-len", "2048", "--seed", str(seed)).start())
        yield started
    finally:
        for e in started:
            e.stop()


@dataclass
class Pair:
    """Two gateways of one run, the engines behind both, and a store of the run."""

    a: CliServer
    b: CliServer
    engines: list[CliServer]
    store: TraceStore

    @property
    def both(self) -> tuple[CliServer, CliServer]:
        return self.a, self.b

    def oai(self, gw: CliServer) -> openai.OpenAI:
        return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)

    def claude(self, gw: CliServer) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)

    def served(self) -> list[int]:
        """Requests each engine has served so far."""
        return [int(e.get("/get_model_info").json()["requests"]) for e in self.engines]


@pytest.fixture
def pair(engines: list[CliServer], url: str) -> Iterator[Pair]:
    run = f"gw2-{uuid.uuid4().hex[:10]}"
    eng = [a for e in engines for a in ("--engine", e.url)]
    started: list[CliServer] = []
    try:
        for _ in range(2):
            started.append(CliServer("gateway", *eng, "--url", url, "--run", run, "--port", "0", "--on-weight-update", "abort").start())
        with TraceStore.connect(url, run=run) as store:
            yield Pair(started[0], started[1], engines, store)
    finally:
        for g in started:
            g.stop()


def _sid() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def test_turns_alternating_between_gateways_keep_one_path_and_one_engine(pair: Pair) -> None:
    s = _sid()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reach 7 from 3"}]
    prompts, completions = [], []
    served = pair.served()
    recorded = [g.metric("tracestore_gateway_turns_recorded_total") for g in pair.both]
    for turn in range(6):
        gw = pair.both[turn % 2]  # a, b, a, b, ...: the load balancer's round robin
        r = pair.oai(gw).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, extra_headers={"X-Session-Id": s}
        )
        prompts.append(r.usage.prompt_tokens)
        completions.append(r.usage.completion_tokens)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"then {turn}"})
    # one path: the last turn's trace (from b, which recorded it) labels every assistant turn
    tr = pair.b.get(f"/v1/sessions/{s}/trace").json()
    assert sum(1 for x in tr["labels"] if x != -100) == sum(completions)
    assert len(tr["input_ids"]) == prompts[-1] + completions[-1]
    # every turn continued the previous one, whichever gateway recorded it: a's latest turn
    # (the 5th) is a prefix of b's (the 6th)
    tr_a = pair.a.get(f"/v1/sessions/{s}/trace").json()
    assert len(tr_a["input_ids"]) == prompts[4] + completions[4]
    assert tr["input_ids"][: len(tr_a["input_ids"])] == tr_a["input_ids"]
    assert all(p2 > p1 + c1 for p1, c1, p2 in zip(prompts, completions, prompts[1:], strict=False))
    # each gateway recorded its three turns
    assert [g.metric("tracestore_gateway_turns_recorded_total") - n for g, n in zip(pair.both, recorded, strict=True)] == [3, 3]
    # one sticky engine served all six turns, the one the shared route names
    delta = [after - before for after, before in zip(pair.served(), served, strict=True)]
    assert sorted(delta) == [0, 6]
    route = pair.store.router([e.url for e in pair.engines]).table([s]).routes[s]
    assert route == pair.engines[delta.index(6)].url
    assert pair.store.gate.drain(10).drained
    assert lease_outcomes(pair.store, s) == ["completed"] * 6


def test_both_gateways_answer_503_while_sealed_and_410_for_gone_sessions(pair: Pair) -> None:
    messages = [{"role": "user", "content": "reach 3 from 1"}]
    retired, released = _sid(), _sid()
    for s, gw in ((retired, pair.a), (released, pair.b)):  # each opened through the other gateway
        pair.oai(gw).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s, "X-Tracestore-Owner": "agents:x"}
        )
    assert pair.store.gate.drain(10).drained
    pair.store.gate.seal(retry_after_ms=250)
    try:
        before = dump_run(pair.store)
        for gw in pair.both:
            for s in (retired, released):  # each known to one gateway only
                with pytest.raises(openai.InternalServerError) as ei:
                    pair.oai(gw).chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s}
                    )
                assert ei.value.status_code == 503 and ei.value.response.headers["retry-after-ms"] == "250"
                assert isinstance(ei.value.body, dict) and ei.value.body["code"] == "gate_sealed"
                with pytest.raises(anthropic.InternalServerError) as ea:
                    pair.claude(gw).messages.create(
                        model=MODEL, max_tokens=2, messages=messages, extra_headers={"X-Session-Id": s}
                    )
                assert ea.value.status_code == 503
        assert dump_run(pair.store) == before  # refused requests write nothing, on either gateway
        fresh = _sid()  # a new session is refused by both too (its route is placed meanwhile)
        for gw in pair.both:
            with pytest.raises(openai.InternalServerError) as ei:
                pair.oai(gw).chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": fresh}
                )
            assert ei.value.status_code == 503
    finally:
        pair.store.gate.reopen()
    assert pair.store.router([e.url for e in pair.engines]).retire([retired]) == [retired]
    assert pair.store.release([released], "agents:x", "test") == [released]
    for gw in pair.both:
        for s, code in ((retired, "session_retired"), (released, "session_released")):
            with pytest.raises(openai.APIStatusError) as ei:
                pair.oai(gw).chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": s}
                )
            assert ei.value.status_code == 410 and ei.value.body["code"] == code  # type: ignore[index]
            with pytest.raises(anthropic.APIStatusError) as ea:
                pair.claude(gw).messages.create(model=MODEL, max_tokens=2, messages=messages, extra_headers={"X-Session-Id": s})
            assert ea.value.status_code == 410
    assert [g.metric("tracestore_gateway_gone_total", reason="retired") for g in pair.both] == [2, 2]
    assert pair.store.gate.drain(10).drained and pair.store.gate.status().poisoned == 0
