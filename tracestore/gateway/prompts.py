"""How a turn's engine input is built and how its answer is recorded: the gateway's prompt modes.

A prompt mode turns a request's canonical messages into the token ids the
engine receives (:meth:`PromptMode.prepare`, an operation reading the session's
stored trace) and records the answer as the session's next turn
(:meth:`PromptMode.write`). The gateway's request path does not depend on
which mode it runs.

``template`` (:class:`TemplatePrompts`): the chat template over the whole
conversation every turn, the longest stored *text* prefix looked up, only the
text after it tokenised; the answer recorded under the template's rendering
of the conversation with the answer (XTuner's text-keyed trie, through
:class:`~tracestore.session.AsyncTurnRecorder`). A turn that branches off the
stored path says so: fork ``template``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidInput, PrefixChanged
from ..scripts import Op
from ..session import AsyncTurnRecorder, ExpertHolder, Request
from ..store import AsyncTraceStore
from ..traces import KeptAnswer, Partial, Trace
from .chat import Answer, ApiError, ChatRequest, Message
from .engines import EngineOutput
from .experts import PutAhead, Puts, put_parts
from .failures import Unrecordable
from .tokenizer import ChatTokenizer


@dataclass
class Prepared:
    """A turn ready for its engine: ``input_ids`` to send, ``new_tokens`` of them tokenised
    this turn (the rest came from the store), and the mode's own state (``state``)."""

    sid: str
    input_ids: Sequence[int]
    new_tokens: int
    state: Any
    #: Why this turn leaves the stored path it matched (``client_edit``, ``template``), or None.
    fork: str | None = None
    #: The turn's prompt key (what kept tokens are filed under; None: the mode keeps none).
    key: str | None = None
    #: Tokens kept of this turn by an earlier attempt a weight update stopped (resume from them).
    partial: Partial | None = None


class PromptMode(Protocol):
    """What the gateway needs of a prompt mode (see the module docstring)."""

    name: str

    def prepare(self, sid: str, req: ChatRequest) -> Op[Prepared]:  # pragma: no cover - protocol
        """The operation that makes the engine input of ``req`` in session ``sid``; writes nothing.
        Built, not run: the gateway runs it in its admission round trip (:mod:`.admission`), so
        its reads share one pipeline with the turn's lease and route. Raises store errors, ApiError."""
        ...

    async def put_experts(self, prep: Prepared, out: EngineOutput) -> Any:  # pragma: no cover - protocol
        """Decode the routed experts of ``out`` and put them into the holder; the array (or None)."""
        ...

    async def write(
        self, prep: Prepared, req: ChatRequest, answer: Answer, experts: Any, version: int,
        versions: Sequence[int] | None = None, kept: KeptAnswer | None = None,
    ) -> None:  # pragma: no cover - protocol
        """Record the turn (the commit point); ``versions``: per answer token, when they differ;
        ``kept``: the answer record for its retries, written with the turn (a mode that cannot
        replay is never given one). Raises Unrecordable, NodeConflict, PrefixChanged..."""
        ...

    async def export(self, sid: str) -> Trace | None:  # pragma: no cover - protocol
        """The training trace of the latest turn this process recorded in ``sid`` (None: none)."""
        ...

    def plain(self, req: ChatRequest) -> list[int]:  # pragma: no cover - protocol
        """The engine input of ``req`` without a session (nothing stored, nothing read)."""
        ...


class TemplatePrompts:
    """``--prompt-mode template`` (see the module docstring).

    ``holder`` keeps routed experts (None: none are recorded); ``remember``:
    how many sessions' latest turns :meth:`export` can find (LRU).
    """

    name = "template"

    def __init__(self, store: AsyncTraceStore, tok: ChatTokenizer, holder: ExpertHolder | None, remember: int) -> None:
        self.store = store
        self.tok = tok
        self.holder = holder
        self.puts = Puts(holder) if holder is not None else None
        self.remember = remember
        self._last: OrderedDict[str, tuple[list[Message], Message, ChatRequest]] = OrderedDict()

    def _recorder(self, req: ChatRequest) -> AsyncTurnRecorder:
        tools, kwargs = req.tools, req.template_kwargs
        memo: dict[tuple[int, bool], str] = {}

        def render(messages: Sequence[Any], gen: bool) -> str:
            # The recorder renders the request's messages twice (prepare, then to check
            # the answer extends the same prompt): the list is not changed in between.
            key = (id(messages), gen)
            if messages is req.messages and key in memo:
                return memo[key]
            out = self.tok.render(messages, tools, gen, kwargs)
            if messages is req.messages:
                memo[key] = out
            return out

        return AsyncTurnRecorder(self.store, render, self.tok.encode, PutAhead() if self.holder is not None else None)

    def prepare(self, sid: str, req: ChatRequest) -> Op[Prepared]:
        """Render, look up the longest stored text prefix, tokenise the rest (1 round trip warm).

        A turn whose stored prefix ends where a stored node already continues, with new ids to
        add, starts a branch: it is reported as fork ``template`` (this mode cannot tell a
        re-rendered history from a client's edit; ``tito`` can).
        """
        rec = self._recorder(req)
        r = yield from rec.ops.prepare(sid, req.messages)
        fork = "template" if r.prefix.extended and r.delta_ids else None
        return Prepared(sid, r.input_ids, len(r.delta_ids), (rec, r), fork=fork, key=r.prompt_text)

    async def put_experts(self, prep: Prepared, out: EngineOutput) -> Any:
        """Split the engine's rows into the delta's and the answer's and put both ahead of the write."""
        if self.puts is None or out.routed_experts is None:
            return None
        rec, r = prep.state
        assert isinstance(r, Request) and isinstance(rec.holder, PutAhead)
        try:
            experts, rec.holder.keys = await put_parts(
                self.puts, prep.sid, out.routed_experts, out.experts_shape,
                len(r.prefix.token_ids), len(r.delta_ids), len(out.output_ids),
            )
        except ValueError as exc:
            raise ApiError("bad_gateway", f"engine reply: {exc}", code="engine_error") from None
        return experts

    async def write(
        self, prep: Prepared, req: ChatRequest, answer: Answer, experts: Any, version: int,
        versions: Sequence[int] | None = None, kept: KeptAnswer | None = None,
    ) -> None:
        """``record_turn`` through the recorder: the delta under the old prompt, the answer under the
        template's rendering of the conversation with the answer (1 round trip)."""
        rec, _ = prep.state
        assistant = answer.message()
        try:
            await rec.after_response(
                prep.sid, req.messages, assistant, answer.output_ids, answer.logprobs, experts, version, versions,
                prep.fork,
            )
        except PrefixChanged:
            raise
        except InvalidInput as exc:
            raise Unrecordable(str(exc)) from None
        self._last[prep.sid] = (req.messages, assistant, req)
        self._last.move_to_end(prep.sid)
        if len(self._last) > self.remember:
            self._last.popitem(last=False)

    async def export(self, sid: str) -> Trace | None:
        """The latest recorded turn's trace, by its key (the template's rendering with the answer)."""
        last = self._last.get(sid)
        if last is None:
            return None
        messages, assistant, req = last
        key = self.tok.render([*messages, assistant], req.tools, False, req.template_kwargs).rstrip()
        return await self.store.export_training_trace(sid, key)

    def plain(self, req: ChatRequest) -> list[int]:
        """The template over the messages, tokenised whole."""
        return self.tok.encode(self.tok.render(req.messages, req.tools, True, req.template_kwargs))


__all__ = ["Prepared", "PromptMode", "TemplatePrompts"]
