"""OpenAI's legacy completions wire, as vLLM serves it: ``POST /v1/completions``, for clients that template.

A client that renders its own prompts (verl's, SkyRL's and prime-rl's
token-in/token-out rollouts) sends ``prompt`` as a list of token ids (or a
text, tokenised as it is: no chat template, no special tokens added) and
reads the ids back (``return_token_ids``, vLLM's extension: ``choices[0]``
carries ``prompt_token_ids`` and the generated ``token_ids``). The turn is
recorded token-exact by :class:`~.idprompts.TokenPrompts`.

Request fields read: ``model``, ``prompt`` (one text or one list of ids; a
list of one of them), ``max_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``stream``, ``stream_options.include_usage``, ``logprobs`` (0 or
1: the sampled token's logprob), ``echo`` (false only), ``return_token_ids``
and the extensions ``session_id``, ``top_k`` and ``ignore_eos``. What the
gateway does not implement is a 400 naming it: ``echo``, ``n``/``best_of``
> 1, ``suffix``, ``logit_bias``, penalties, ``logprobs`` > 1, several
prompts. Errors are OpenAI's shape (:mod:`.openai`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from . import openai
from .chat import (
    Answer,
    ApiError,
    ChatRequest,
    as_str,
    invalid,
    opt_bool,
    opt_int,
    opt_number,
    stop_strings,
)

NAME = "completions"

error_body = openai.error_body
models = openai.models


@dataclass
class CompletionRequest(ChatRequest):
    """A parsed completions request: ``prompt`` as sent (a text or token ids); ``prompt_ids`` the ids
    the engine gets (set when the prompt mode tokenises a text); ``logprob_count`` 0 or 1 (None:
    no logprobs); ``return_token_ids``: answer with the prompt's and the answer's ids."""

    prompt: str | list[int] = ""
    prompt_ids: list[int] | None = None
    logprob_count: int | None = None
    return_token_ids: bool = False


#: Fields refused unless they have their neutral value: (field, neutral values, why).
_REFUSED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("echo", (None, False), "echo is not implemented (the answer never repeats the prompt)"),
    ("n", (None, 1), "n > 1 is not implemented: one choice per request (sample in several sessions)"),
    ("best_of", (None, 1), "best_of > 1 is not implemented"),
    ("suffix", (None, ""), "suffix (insertion) is not implemented"),
    ("logit_bias", (None,), "logit_bias is not implemented"),
    ("presence_penalty", (None, 0, 0.0), "presence_penalty is not implemented"),
    ("frequency_penalty", (None, 0, 0.0), "frequency_penalty is not implemented"),
)


def _prompt(raw: Any) -> str | list[int]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        if not raw:
            raise invalid("prompt must not be empty", "prompt")
        return raw
    if not isinstance(raw, list) or not raw:
        raise invalid("prompt must be a non-empty text or a non-empty list of token ids", "prompt")
    if any(isinstance(x, (str, list)) for x in raw):
        raise invalid("one prompt per request: send several prompts as several requests", "prompt")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw):
        raise invalid("prompt token ids must be non-negative integers", "prompt")
    return list(raw)


def parse(body: dict[str, Any], default_max_tokens: int) -> CompletionRequest:
    """A :class:`CompletionRequest` from a completions body; ApiError (400) when invalid or when it
    asks for what is not implemented (the message names the field)."""
    model = as_str(body.get("model"), "model")
    for name, neutral, why in _REFUSED:
        v = body.get(name)
        if v not in neutral and v != {}:
            raise invalid(why, name)
    logprobs = opt_int(body, "logprobs", None, 0, 20)
    if logprobs is not None and logprobs > 1:
        raise invalid("logprobs > 1 (top alternatives) is not implemented: 0 or 1 give the sampled token's", "logprobs")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options must be an object", "stream_options")
    return CompletionRequest(
        model=model,
        messages=[],
        max_tokens=int(opt_int(body, "max_tokens", default_max_tokens, 1, 1 << 20) or default_max_tokens),
        stream=opt_bool(body, "stream"),
        temperature=opt_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=opt_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(opt_int(body, "top_k", -1, -1, 1 << 20) or -1),
        stop=stop_strings(body.get("stop"), "stop"),
        seed=opt_int(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        include_usage=bool(opts and opts.get("include_usage")),
        logprobs=logprobs is not None,
        ignore_eos=opt_bool(body, "ignore_eos"),
        prompt=_prompt(body.get("prompt")),
        logprob_count=logprobs,
        return_token_ids=opt_bool(body, "return_token_ids"),
    )


def _finish(answer: Answer) -> str:
    return "length" if answer.finish == "length" else "stop"


def _logprobs(answer: Answer, piece: Any) -> dict[str, Any]:
    tokens = [piece(t) for t in answer.output_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": list(answer.logprobs), "top_logprobs": None, "text_offset": offsets}


def _cmpl(rid: str) -> str:
    return "cmpl-" + rid.removeprefix("chatcmpl-")


def response(req: ChatRequest, answer: Answer, rid: str, piece: Any) -> dict[str, Any]:
    """The ``text_completion`` object of ``answer``; ``piece(id)`` names a token (logprobs)."""
    assert isinstance(req, CompletionRequest)
    choice: dict[str, Any] = {
        "index": 0,
        "text": answer.content,
        "logprobs": _logprobs(answer, piece) if req.logprobs else None,
        "finish_reason": _finish(answer),
        "stop_reason": answer.stop_string,
    }
    if req.return_token_ids:
        choice["prompt_token_ids"] = req.prompt_ids
        choice["token_ids"] = list(answer.output_ids)
    return {
        "id": _cmpl(rid),
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": openai.usage(answer),
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Stream:
    """The SSE events of one streamed completion (``text_completion`` chunks, then ``[DONE]``).

    With ``return_token_ids`` the first chunk carries ``prompt_token_ids`` and the finish chunk
    every generated id (``token_ids``); usage comes last when ``stream_options.include_usage``.
    """

    def __init__(self, req: ChatRequest, rid: str, prompt_tokens: int) -> None:
        assert isinstance(req, CompletionRequest)
        self.req = req
        self.rid = _cmpl(rid)
        self.created = int(time.time())

    def _chunk(self, text: str, finish: str | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **extra}
        c: dict[str, Any] = {
            "id": self.rid, "object": "text_completion", "created": self.created, "model": self.req.model,
            "choices": [choice],
        }
        if self.req.include_usage:
            c["usage"] = None
        return _sse(c)

    def start(self) -> bytes:
        """The first chunk (no text yet; the prompt's ids when asked)."""
        extra: dict[str, Any] = {"prompt_token_ids": self.req.prompt_ids} if self.req.return_token_ids else {}
        return self._chunk("", **extra)

    def text(self, delta: str) -> bytes:
        """A text delta."""
        return self._chunk(delta)

    reasoning = text  # no reasoning parser runs on completions: everything is text

    def end(self, answer: Answer, pending_text: str, pending_reasoning: str = "") -> bytes:
        """The remaining text, the finish chunk (with the answer's ids when asked), usage, ``[DONE]``."""
        out = [self.text(pending_reasoning + pending_text)] if pending_reasoning or pending_text else []
        extra: dict[str, Any] = {"stop_reason": answer.stop_string}
        if self.req.logprobs:
            extra["logprobs"] = {"tokens": None, "token_logprobs": list(answer.logprobs), "top_logprobs": None, "text_offset": None}
        if self.req.return_token_ids:
            extra["token_ids"] = list(answer.output_ids)
        c = orjson.loads(self._chunk("", _finish(answer))[6:])
        c["choices"][0].update(extra)
        out.append(_sse(c))
        if self.req.include_usage:
            out.append(
                _sse({"id": self.rid, "object": "text_completion", "created": self.created, "model": self.req.model,
                      "choices": [], "usage": openai.usage(answer)})
            )
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def error(self, err: ApiError) -> bytes:
        """An error after the stream started (the SDK raises it as an APIError)."""
        return _sse({"error": error_body(err)}) + b"data: [DONE]\n\n"


__all__ = ["NAME", "CompletionRequest", "Stream", "error_body", "models", "parse", "response"]
