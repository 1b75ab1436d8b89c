"""What a turn uses of its gateway: the store, tokenizer, prompt mode, admission, engines, options.

:class:`Services` is built once by :class:`~.server.Gateway` and shared by every
:class:`~.turn.Turn`; :func:`build_answer` turns an engine's output into the
answer the client gets (stop markers cut, reasoning and tool calls parsed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import SessionExists
from ..router import RouterOps
from ..store import AsyncTraceStore
from .admission import Admission, Flight
from .chat import Answer, ChatRequest, ToolCall
from .config import GatewayConfig
from .engines import Engine, EngineOutput, EngineRejected, Sampling
from .liveness import Liveness
from .metrics import Metrics
from .prompts import PromptMode
from .retries import Retries
from .sidtable import SidTable
from .startup import TemplateFeatures
from .stream import cut
from .tokenizer import ChatTokenizer
from .tracing import Spans


@dataclass
class Services:
    """What a turn uses of its gateway (built once by :class:`~.server.Gateway`)."""

    config: GatewayConfig
    store: AsyncTraceStore
    tok: ChatTokenizer
    prompts: PromptMode
    admission: Admission
    metrics: Metrics
    #: The router's operations (a turn's route rides in its admission round trip).
    router: RouterOps
    engines: dict[str, Engine]
    db: Callable[[Awaitable[Any]], Awaitable[Any]]
    spawn: Callable[[Awaitable[Any]], None]
    experts: bool = False
    features: TemplateFeatures = field(default_factory=TemplateFeatures)
    #: The engines' context length (prompt + answer), when they report it: max_tokens is clamped to it.
    max_context: int | None = None
    spans: Spans = field(default_factory=Spans)
    liveness: Liveness | None = None
    #: Attempts in flight and replays of recorded turns (a retry of a turn is one turn).
    retries: Retries = field(default_factory=Retries)
    #: Sessions this process has opened (a fixed-size table: :mod:`.sidtable`).
    opened: SidTable = field(default_factory=SidTable)
    #: Where each session last ran, as the index of its engine in ``engines`` (multi-engine only).
    routes: SidTable | None = None
    _rr: int = 0

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.tok.stop_token_ids)
        self._names = list(self.engines)
        self._index = {name: i for i, name in enumerate(self._names)}
        if len(self.engines) > 1 and self.routes is None:
            self.routes = SidTable(values=True)

    async def open_once(self, sid: str, owner: str) -> None:
        """Open the session for ``owner`` the first time this process records a turn of it, or
        again once :attr:`opened` forgot it (a request refused earlier opens nothing; an open
        session is left as it is: ``SessionExists`` is ignored)."""
        if sid in self.opened:
            return
        try:
            await self.db(self.store.open_session(sid, owner))
        except SessionExists:
            pass
        self.opened.add(sid)

    def route_hint(self, sid: str) -> str | None:
        """The engine ``sid`` will most likely run on (the only one, or where it last ran), for its
        lease record; None when unknown."""
        if self.routes is None:
            return self._names[0] if len(self._names) == 1 else None
        at = self.routes.get(sid)
        return None if at is None else self._names[at]

    def routed(self, sid: str, engine: str) -> None:
        """Remember where ``sid`` runs (its slot of a fixed-size table: :mod:`.sidtable`)."""
        if self.routes is not None and (at := self._index.get(engine)) is not None:
            self.routes.put(sid, at)

    def sampling(self, req: ChatRequest, max_tokens: int) -> Sampling:
        """The engine's sampling parameters for ``req`` with a budget of ``max_tokens``."""
        return Sampling(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=tuple(req.stop),
            stop_token_ids=tuple(self.tok.stop_token_ids),
            ignore_eos=req.ignore_eos,
            seed=req.seed,
        )

    def next_engine(self) -> Engine:
        """An engine for a request without a session (round-robin)."""
        engines = list(self.engines.values())
        self._rr += 1
        return engines[self._rr % len(engines)]


def build_answer(
    s: Services, req: ChatRequest, wire: str, flight: Flight, out: EngineOutput, prompt_tokens: int, opened: bool
) -> Answer:
    """The answer of an engine output: its text without the stop token, stop string or spelled-out
    end-of-turn marker, its reasoning (``opened``: the prompt opened the reasoning block) and tool
    calls parsed; exact token counts. EngineRejected when the output is not one (no ids, or as many
    logprobs as ids)."""
    ids, lps = out.output_ids, out.logprobs
    if len(lps) != len(ids) or not ids:
        raise EngineRejected(flight.engine.url, 502, f"{len(ids)} output ids with {len(lps)} logprobs")
    text_ids = ids[:-1] if out.finish == "stop" and ids[-1] in s.stop_ids else ids
    text = s.tok.decode(text_ids)
    stop_string = out.matched if isinstance(out.matched, str) else None
    text = cut(text, stop_string)
    if not req.ignore_eos:  # a model that spells out the end-of-turn marker ends its turn there
        text = cut(text, s.tok.stop_word)
    split = s.tok.reasoning.split(text, opened=opened)
    text = split.content
    calls: list[ToolCall] = []
    if req.parse_tools and req.tools:
        text, found = s.tok.parse_tool_calls(text, req.tools)
        prefix = "toolu_" if wire == "anthropic" else "call_"
        calls = [ToolCall(c.id or s.tok.new_call_id(prefix), c.name, c.arguments) for c in found]
    finish = "length" if out.finish == "length" else "tool_calls" if calls else "stop"
    version = flight.lease.version if flight.lease is not None else None
    return Answer(text, tuple(calls), finish, stop_string, ids, lps, prompt_tokens, version, split.reasoning)


__all__ = ["Services", "build_answer"]
