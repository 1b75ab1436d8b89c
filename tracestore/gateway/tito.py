"""``--prompt-mode tito`` (the default): token-exact multi-turn traces (DESIGN section 14).

A session's path is keyed by its canonical messages
(:func:`tracestore.conversation.conversation_key`), never by their rendering.
The engine's input for a turn is the stored path's ids (every earlier prompt
and generated token, exactly as the engine saw and generated them) followed
by the ids of the *suffix*: the messages after the last stored one, rendered
on their own by the model's template, plus the generation prompt. Earlier
turns are never rendered again, so:

* the continuity invariant holds by construction: turn k+1's input starts
  with turn k's input followed by the ids turn k generated;
* templates that drop reasoning from past turns, insert empty think blocks in
  the latest one or re-format tool-call arguments cannot branch the path;
* rendering and tokenising cost depends on the new messages only.

**The suffix.** The new messages are rendered after a stand-in history (a
user message and a plain assistant message whose content is a marker); the
text after the marker is what the template writes after an assistant
message, then the new messages and the generation prompt. Boundary rule: when
the stored answer ended with a generated end-of-turn token whose text opens
that suffix (Qwen's ``<|im_end|>``, Llama's ``<|eot_id|>``, DeepSeek's
``<｜end▁of▁sentence｜>``, Mistral's ``</s>``, GLM's ``<|observation|>``
before a tool result), the generated token stands for it; an answer cut by
``max_tokens`` or a stop string gets the template's whole closer (the
``<|im_end|>`` it did not generate). Tools are rendered with the first turn
only (the stand-in is rendered without them), so a template that moves the
tool list before the latest user message (Mistral) shows it once.

**Forks.** A request whose messages do not extend a stored path forks at its
longest stored message prefix and says so (``client_edit``): the node it
matched already has a child it does not follow, or it matched a prompt whose
stored answer the client replaced (then it forks at that prompt's parent).
The same messages again are not a fork: they match the whole stored prompt;
a retry is answered from the recorded turn (:mod:`.retries`), a new sample
(other options) hangs beside the first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import traces
from ..conversation import key_parts, message_key
from ..errors import InvalidInput, PrefixChanged
from ..scripts import Op
from ..session import ExpertHolder
from ..store import AsyncTraceStore
from ..traces import KeptAnswer, Partial, PrefixMatch, TokenIds, Trace
from .chat import Answer, ApiError, ChatRequest, Message, invalid
from .engines import EngineOutput, extend_ids
from .experts import Puts, put_parts
from .failures import Unrecordable
from .prompts import Prepared
from .tokenizer import ChatTokenizer

#: The stand-in assistant message's content (private-use brackets: no template rewrites them).
MARK = "\u27e6tracestore\u27e7"
_STAND_IN: list[Message] = [{"role": "user", "content": "\u27e6user\u27e7"}, {"role": "assistant", "content": MARK}]


@dataclass(frozen=True)
class _Plan:
    """What :meth:`TitoPrompts.prepare` decided: the key, the match it extends, the new ids."""

    key: str
    match: PrefixMatch
    delta: list[int]


class TitoPrompts:
    """``--prompt-mode tito`` (see the module docstring).

    ``holder`` keeps routed experts (None: none are recorded); ``remember``:
    how many sessions' latest turns :meth:`export` can find (LRU).
    """

    name = "tito"

    def __init__(self, store: AsyncTraceStore, tok: ChatTokenizer, holder: ExpertHolder | None, remember: int) -> None:
        self.store = store
        self.tok = tok
        self.holder = holder
        self.puts = Puts(holder) if holder is not None else None
        self.remember = remember
        self.stop_ids = frozenset(tok.stop_token_ids)
        self._last: OrderedDict[str, str] = OrderedDict()  # sid -> its latest response node's id

    # -- the engine input -------------------------------------------------------------------

    def render_all(self, req: ChatRequest, messages: list[Message] | None = None) -> list[int]:
        """The whole conversation through the template (a session's first turn, a fork at the root)."""
        msgs = req.messages if messages is None else messages
        return self.tok.encode(self.tok.render(msgs, req.tools, True, req.template_kwargs))

    def suffix_text(self, req: ChatRequest, start: int, last_id: int | None) -> str:
        """The text after a stored answer: the template's closer, ``messages[start:]``, the generation
        prompt; the boundary rule applied for an answer that ended with ``last_id`` (module docstring)."""
        text = self.tok.render([*_STAND_IN, *req.messages[start:]], None, True, req.template_kwargs)
        at = text.find(MARK)
        if at < 0:
            raise invalid(
                "the chat template does not render a plain assistant message before these messages; "
                "tito mode cannot continue this conversation (use --prompt-mode template)",
                "messages",
            )
        out = text[at + len(MARK) :]
        if last_id is not None and last_id in self.stop_ids:
            end = self.tok.decode([last_id])
            if end and out.startswith(end):
                out = out[len(end) :]
        return out

    def key_of(self, sid: str, req: ChatRequest) -> tuple[str, list[int], str]:
        """The request's conversation key, where each of its lines ends (``ends[i + 1]``: after
        message ``i - 1``; ``ends[1]``: the header) and the key's digest
        (:func:`~tracestore.traces.key_digest`: O(new messages) on a warm session). Computed
        once per request (kept in ``req.memo``). Raises InvalidInput on a message no key is made of."""
        got: tuple[str, list[int], str] | None = req.memo.get("tito")
        if got is None:
            parts = key_parts(req.messages, req.tools, req.template_kwargs)
            key = "".join(parts)
            ends = [0]
            for p in parts:
                ends.append(ends[-1] + len(p))
            got = req.memo["tito"] = (key, ends, traces.key_digest(self.store.context, sid, key))
        return got

    def retry_basis(self, sid: str, req: ChatRequest) -> str:
        """What identifies the request's prompt in its retry digest: its key's digest (the key is
        the canonical messages, tools and template options: :mod:`tracestore.conversation`)."""
        return self.key_of(sid, req)[2]

    def prepare(self, sid: str, req: ChatRequest) -> Op[Prepared]:
        """The stored path's ids plus the new messages' ids (1 round trip warm; 2 on a fork that
        backs off to a prompt's parent)."""
        if req.messages[-1]["role"] == "assistant":
            raise invalid("a final assistant message (prefill) is not supported", "messages")
        key, ends, digest = self.key_of(sid, req)
        ctx = self.store.context
        match, partial = yield from traces.lookup_partial(ctx, sid, key, digest)  # one round trip
        assert isinstance(match, PrefixMatch) and (partial is None or isinstance(partial, Partial))
        fork: str | None = None
        if match.text_len == len(key):  # the same messages again: a retry of this turn
            delta: list[int] = []
        else:
            covered = ends.index(match.text_len) - 1 if match.text_len else 0  # messages matched
            if covered and req.messages[covered - 1]["role"] != "assistant":
                # a stored prompt whose answer the client replaced: fork at the prompt's parent
                fork = "client_edit"
                parent = match.path[-2] if len(match.path) > 1 else None
                match = (yield from traces.lookup(ctx, sid, key[: parent.end])) if parent is not None else _NOTHING
                covered = ends.index(match.text_len) - 1 if match.text_len else 0
            elif match.extended:
                fork = "client_edit"
            if covered == 0:
                delta = self.render_all(req)
            else:
                stored = match.token_ids
                generated = match.node is not None and match.node.generated
                delta = self.tok.encode(self.suffix_text(req, covered, stored[-1] if stored and generated else None))
        plan = _Plan(key, match, delta)
        ids = extend_ids(match.token_ids, delta)  # the stored path's int32 ids, not a list of them
        if partial is not None and (partial.input_len != len(ids) or fork is not None):
            partial = None  # kept after another input: not this turn's (it expires)
        return Prepared(sid, ids, len(delta), plan, fork, key=key, partial=partial)

    # -- the record -------------------------------------------------------------------------

    async def put_experts(self, prep: Prepared, out: EngineOutput) -> Any:
        """Put the delta's and the answer's routed-expert rows into the holder ahead of the write."""
        if self.puts is None or out.routed_experts is None:
            return None
        plan: _Plan = prep.state
        try:
            experts, keys = await put_parts(
                self.puts, prep.sid, out.routed_experts, out.experts_shape,
                len(plan.match.token_ids), len(plan.delta), len(out.output_ids),
            )
        except ValueError as exc:
            raise ApiError("bad_gateway", f"engine reply: {exc}", code="engine_error") from None
        return keys

    async def write(
        self, prep: Prepared, req: ChatRequest, answer: Answer, experts: Any, version: int,
        versions: Sequence[int] | None = None, kept: KeptAnswer | None = None,
    ) -> None:
        """``record_turn``: the delta node under the request's key, the answer under key + its line."""
        plan: _Plan = prep.state
        keys: list[str] = list(experts or [])
        dkey = keys.pop(0) if keys and plan.delta else None
        rkey = keys.pop(0) if keys else None
        response = message_key(answer.message())
        try:
            turn = await self.store.record_turn(
                prep.sid,
                plan.key,
                response,
                prefix=plan.match,
                delta_token_ids=plan.delta,
                response_token_ids=answer.output_ids,
                response_logprobs=answer.logprobs,
                version=version,
                delta_expert_key=dkey,
                response_expert_key=rkey,
                fork=prep.fork,
                response_versions=versions,
                answer=kept,
            )
        except PrefixChanged:
            raise
        except InvalidInput as exc:
            raise Unrecordable(str(exc)) from None
        self._last[prep.sid] = turn.response.id  # 16 characters, not the conversation's key
        self._last.move_to_end(prep.sid)
        if len(self._last) > self.remember:
            self._last.popitem(last=False)

    def response_suffix(self, answer: Answer) -> str:
        """What the answer adds to the prompt's key: its canonical message's line (retries.py finds
        the recorded turn again with it)."""
        return message_key(answer.message())

    async def export(self, sid: str) -> Trace | None:
        """The latest recorded turn's trace, by its response node's id (kept per session: the
        key's 16-character id, not the conversation's text, which grows with the session)."""
        node = self._last.get(sid)
        return None if node is None else await self.store.export_node(sid, node)

    def plain(self, req: ChatRequest) -> list[int]:
        """The template over the messages, tokenised whole (no session: nothing stored)."""
        return self.render_all(req)


_NOTHING = PrefixMatch(0, TokenIds([]), None)

__all__ = ["MARK", "TitoPrompts"]
