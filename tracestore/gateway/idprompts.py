"""The prompt mode of ``POST /v1/completions``: a session's path keyed by its token ids.

A client that does its own templating sends the engine's input itself. The
trie key of a token-id path is :func:`token_key` of its ids (a header line,
then each id in decimal followed by a space), so a stored node's key is the
key of exactly the ids from the session's start to the node's end, and:

* a prompt that starts with a stored path's ids (prompt, answer, prompt,
  answer, ...) extends that path: only the ids after it are new (the delta
  node), the answer hangs under them; the trace is exactly the ids sent and
  generated, nothing is tokenised again;
* a prompt that leaves a stored path (the client edited or dropped ids) forks
  at the longest stored prefix that ends at a node boundary, and says so
  (``client_edit``, as chat turns do);
* a session without nodes starts a path.

A text prompt is tokenised as it is (``tokenizer.encode``: no chat template,
no special tokens added) and then handled as those ids. Recorded, kept,
held and continued exactly as chat turns (:class:`~.tito.TitoPrompts`, whose
expert handling and export it shares).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import traces
from ..errors import InvalidInput, PrefixChanged
from ..scripts import Op
from ..traces import KeptAnswer, Partial, PrefixMatch
from .chat import Answer, ApiError, ChatRequest, invalid
from .completions import CompletionRequest
from .engines import extend_ids
from .failures import Unrecordable
from .prompts import Prepared
from .tito import TitoPrompts

#: The first line of every token-id key (a chat key's first line is ``["tito", ...]``: they never meet).
HEADER = '["tokens"]\n'


def token_key(ids: Sequence[int]) -> str:
    """The trie key of a token-id path: export a completions session's trace with
    ``store.export_training_trace(sid, token_key(prompt_ids + generated_ids))``."""
    return HEADER + "".join(f"{i} " for i in ids)


@dataclass(frozen=True)
class _Plan:
    key: str
    match: PrefixMatch
    delta: list[int]


class TokenPrompts(TitoPrompts):
    """Token-id prompts (see the module docstring); built by the gateway beside its chat prompt mode."""

    name = "tokens"

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        """The request's prompt as ids (a text tokenised as it is); 400 on ids outside the vocabulary."""
        assert isinstance(req, CompletionRequest)
        if req.prompt_ids is None:
            ids = self.tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
            vocab = getattr(self.tok, "vocab_size", None)
            if vocab is not None and any(i >= vocab for i in ids):
                raise invalid(f"prompt has token ids outside the vocabulary of {vocab} ids", "prompt")
            if not ids:
                raise invalid("prompt has no tokens", "prompt")
            req.prompt_ids = ids
        return req.prompt_ids

    def ids_key(self, sid: str, req: ChatRequest) -> tuple[str, str]:
        """The prompt's key (its ids) and the key's digest (:func:`~tracestore.traces.key_digest`),
        computed once per request (kept in ``req.memo``)."""
        got: tuple[str, str] | None = req.memo.get("tokens")
        if got is None:
            key = token_key(self.prompt_ids(req))
            got = req.memo["tokens"] = (key, traces.key_digest(self.store.context, sid, key))
        return got

    def retry_basis(self, sid: str, req: ChatRequest) -> str:
        """What identifies the request's prompt in its retry digest: its key's digest."""
        return self.ids_key(sid, req)[1]

    def prepare(self, sid: str, req: ChatRequest) -> Op[Prepared]:
        """The stored path's ids plus the prompt's ids after it (1 round trip: lookup and kept tokens)."""
        ids = self.prompt_ids(req)
        key, digest = self.ids_key(sid, req)
        ctx = self.store.context
        match, partial = yield from traces.lookup_partial(ctx, sid, key, digest)  # one round trip
        assert isinstance(match, PrefixMatch) and (partial is None or isinstance(partial, Partial))
        covered = key.count(" ", 0, match.text_len) if match.text_len else 0
        if covered != len(match.token_ids) or list(match.token_ids) != ids[:covered]:
            raise ApiError("conflict", f"session {sid!r} holds a path that is not keyed by its token ids", param="prompt")
        fork = "client_edit" if match.text_len < len(key) and match.extended else None
        delta = ids[covered:]
        ids_in = extend_ids(match.token_ids, delta)
        if partial is not None and (partial.input_len != len(ids_in) or fork is not None):
            partial = None  # kept after another input: not this turn's (it expires)
        return Prepared(sid, ids_in, len(delta), _Plan(key, match, delta), fork, key=key, partial=partial)

    def response_suffix(self, answer: Answer) -> str:
        """What the answer adds to the prompt's key: its ids."""
        return "".join(f"{i} " for i in answer.output_ids)

    async def write(
        self, prep: Prepared, req: ChatRequest, answer: Answer, experts: Any, version: int,
        versions: Sequence[int] | None = None, kept: KeptAnswer | None = None,
    ) -> None:
        """``record_turn``: the new ids under the prompt's key, the answer's ids under key + their key."""
        plan: _Plan = prep.state
        keys: list[str] = list(experts or [])
        dkey = keys.pop(0) if keys and plan.delta else None
        rkey = keys.pop(0) if keys else None
        response = self.response_suffix(answer)
        try:
            turn = await self.store.record_turn(
                prep.sid, plan.key, response, prefix=plan.match, delta_token_ids=plan.delta,
                response_token_ids=answer.output_ids, response_logprobs=answer.logprobs, version=version,
                delta_expert_key=dkey, response_expert_key=rkey, fork=prep.fork, response_versions=versions, answer=kept,
            )
        except PrefixChanged:
            raise
        except InvalidInput as exc:
            raise Unrecordable(str(exc)) from None
        self._last[prep.sid] = turn.response.id  # 16 characters, not the conversation's key
        self._last.move_to_end(prep.sid)
        if len(self._last) > self.remember:
            self._last.popitem(last=False)

    def plain(self, req: ChatRequest) -> list[int]:
        """The prompt's ids (no session: nothing stored)."""
        return self.prompt_ids(req)


__all__ = ["HEADER", "TokenPrompts", "token_key"]
