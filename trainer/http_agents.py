"""The calculator agent over HTTP: each episode an asyncio task of the official ``openai`` SDK.

``tracestore train --agents http`` rolls samples out the way real agents
run: :func:`run_over_http` drives :func:`~tracestore.trainer.agent.play` for
every sample at once, one task per sample, each turn a chat completion
through the session gateway (``X-Session-Id``: the sample's session;
``X-Tracestore-Owner``: the tag that owns it during the rollout) with the
calculator as tools (``add``/``sub``/``mul`` with one integer ``n``). The
builtin template renders a tool call as ``add 3``, exactly what the policy
writes, so the conversation the SDK sends back stays on one trie path. The
episode reads each answer as the template renders what the gateway returned
(:func:`_as_written`: the text it recorded), and :func:`to_openai` sends it
back in the form that renders to that text again: an answer the gateway did
not parse as a call (`` add 3``, which the task strips and runs) goes back
as content, never as a call, and an answer with two calls is one malformed
turn, as for local agents.

A weight update answers 503 with ``Retry-After``: the SDK waits and retries
(``http_retries`` times), and the turn is generated under the new weights.
Only when the retries run out does the turn come back aborted (the group
goes back to the buffer, as with local agents).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .agent import NoReply, Outcome, Reply, TurnRequest, play
from .api_messages import CALC_TOOLS, to_openai
from .config import TrainConfig
from .sample import Sample

MODEL = "tracestore-reference"
#: The name samples carry as ``worker`` when their routed experts are in the gateway's holder.
GATEWAY_HOLDER = "gateway"


def gateway_name(i: int) -> str:
    """The name of the ``i``-th gateway of ``--gateways N`` (its holder's and its role's):
    ``gateway``, then ``gateway-1``, ``gateway-2``..."""
    return GATEWAY_HOLDER if i == 0 else f"{GATEWAY_HOLDER}-{i}"


def gateway_of(sid: str, names: Sequence[str]) -> str:
    """The gateway of ``names`` that serves session ``sid``: the same one every step (CRC-32 of the
    id), so that every turn's routed experts are in the holder its sample names."""
    return names[zlib.crc32(sid.encode()) % len(names)]


@dataclass
class HttpStats:
    """What the agents saw: requests sent, turns that came back, each turn's latency."""

    requests: int = 0
    turns: int = 0
    turn_s: list[float] = field(default_factory=list)
    gave_up: int = 0

    def add(self, other: HttpStats) -> None:
        """Fold ``other`` into these counters."""
        self.requests += other.requests
        self.turns += other.turns
        self.turn_s += other.turn_s
        self.gave_up += other.gave_up


async def _turn(client: Any, req: TurnRequest, cfg: TrainConfig, owner: str, temperature: float, stats: HttpStats) -> Outcome:
    import openai

    t0 = time.perf_counter()
    stats.requests += 1
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=to_openai(req.messages),
            tools=CALC_TOOLS,
            max_tokens=cfg.max_new_tokens,
            temperature=temperature,
            extra_headers={"X-Session-Id": req.sid, "X-Tracestore-Owner": owner},
        )
    except openai.APIStatusError as exc:
        stats.gave_up += 1
        detail = f"HTTP {exc.status_code}: {exc.message}"
        return NoReply("aborted", detail) if exc.status_code == 503 else NoReply("failed", detail)
    except openai.APIError as exc:
        stats.gave_up += 1
        return NoReply("failed", f"{type(exc).__name__}: {exc}")
    r = raw.parse()
    choice = r.choices[0]
    stats.turns += 1
    stats.turn_s.append(time.perf_counter() - t0)
    return Reply(_as_written(choice.message), choice.finish_reason != "length", int(raw.headers["x-tracestore-version"]))


def _as_written(message: Any) -> str:
    """An answer's text as the builtin template renders it: its content, then one line per call.

    That is the text the gateway recorded for the turn, and what the model
    wrote (up to blank space the parser dropped around a call): the episode
    reads it as a local agent's episode reads the engine's text (two calls
    are a malformed turn, not the first call), and :func:`to_openai` sends
    it back in the form that renders to it again.
    """
    lines = [message.content] if message.content else []
    for call in message.tool_calls or []:
        values = json.loads(call.function.arguments).values()
        lines.append(" ".join([call.function.name, *(str(v) for v in values)]))
    return "\n".join(lines)


async def _episode(client: Any, sample: Sample, cfg: TrainConfig, owner: str, temperature: float, stats: HttpStats) -> Sample:
    agent = play(sample, cfg.max_calls)
    try:
        request = next(agent)
        while True:
            request = agent.send(await _turn(client, request, cfg, owner, temperature, stats))
    except StopIteration as end:
        done: Sample = end.value
        return dataclasses.replace(done, keying="tito")  # the gateway records it token-exact


def run_over_http(
    url: str | Mapping[str, str], samples: Sequence[Sample], cfg: TrainConfig, owner: str, temperature: float = 1.0
) -> tuple[list[Sample], HttpStats]:
    """Continue every sample through the gateway at ``url``, all at once; the samples and what was seen.

    ``url`` may map gateway names to URLs (``--gateways N``): each sample then goes to the
    gateway its ``worker`` names.
    """
    import openai

    stats = HttpStats()
    urls = {"": url} if isinstance(url, str) else dict(url)

    async def main() -> list[Sample]:
        # aiohttp, not the SDK's default httpx transport: it writes a request's headers and body in
        # one send, where httpx yields to the loop between them (anyio's checkpoint after each
        # write), so the gateway's handler, started on the headers, waited for the other agents
        # of this loop to run before the body came (p50 15 ms counted in its own time, "parse")
        async with contextlib.AsyncExitStack() as stack:
            clients = {}
            for name, u in urls.items():
                http = await stack.enter_async_context(openai.DefaultAioHttpClient())
                clients[name] = await stack.enter_async_context(openai.AsyncOpenAI(
                    base_url=u + "/v1", api_key="unused", max_retries=cfg.http_retries, timeout=120, http_client=http
                ))
            one = clients.get("")
            return list(await asyncio.gather(*(
                _episode(one if one is not None else clients[s.worker or ""], s, cfg, owner, temperature, stats)
                for s in samples
            )))

    return asyncio.run(main()), stats


__all__ = ["CALC_TOOLS", "GATEWAY_HOLDER", "HttpStats", "gateway_name", "gateway_of", "run_over_http", "to_openai"]
