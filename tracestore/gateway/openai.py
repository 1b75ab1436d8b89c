"""OpenAI wire format: ``POST /v1/chat/completions`` (stream or not, tools) and its errors.

Request fields read: ``model``, ``messages`` (roles system/developer/user/
assistant/tool; string or text-part content; assistant ``tool_calls``),
``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``n``
(1 only), ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``,
``tools``, ``tool_choice``, ``logprobs``, and the extensions ``session_id``,
``top_k`` and ``ignore_eos`` (as SGLang's OpenAI server). Options not implemented
are a 400 naming them (:mod:`.refusals`); other fields are ignored. Errors are SGLang/vLLM-shaped (``{"object": "error", "message",
"type", "param", "code"}``), which the ``openai`` SDK reads as its own.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from .chat import (
    Answer,
    ApiError,
    ChatRequest,
    Message,
    as_dict,
    as_list,
    as_str,
    function_tool,
    invalid,
    opt_bool,
    opt_int,
    opt_number,
    stop_strings,
    template_kwargs,
    tool_arguments,
)
from .refusals import refuse_chat

NAME = "openai"

_TYPES = {
    "invalid_request": "invalid_request_error",
    "not_found": "not_found_error",
    "conflict": "conflict_error",
    "gone": "session_gone_error",
    "too_large": "invalid_request_error",
    "internal": "internal_error",
    "bad_gateway": "engine_error",
    "unavailable": "service_unavailable_error",
}

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def error_body(err: ApiError) -> dict[str, Any]:
    """The error shape of OpenAI-compatible servers (SGLang, vLLM, lmdeploy)."""
    return {
        "object": "error",
        "message": err.message,
        "type": _TYPES[err.kind],
        "param": err.param,
        "code": err.code or str(err.status),
    }


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = as_list(content, param)
    out = []
    for i, p in enumerate(parts):
        p = as_dict(p, f"{param}[{i}]")
        if p.get("type") not in ("text", "input_text", "output_text"):
            raise invalid(f"{param}[{i}]: only text parts are supported, got {p.get('type')!r}", param)
        out.append(as_str(p.get("text"), f"{param}[{i}].text"))
    return "".join(out)


def _message(raw: Any, i: int) -> Message:
    p = f"messages[{i}]"
    m = as_dict(raw, p)
    raw_role = m.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise invalid(f"{p}.role must be one of {sorted(_ROLES)}, got {m.get('role')!r}", f"{p}.role")
    out: Message = {"role": role, "content": _text(m.get("content"), f"{p}.content")}
    if role == "assistant" and m.get("reasoning_content") is not None:
        out["reasoning_content"] = as_str(m["reasoning_content"], f"{p}.reasoning_content")
    if role == "assistant" and m.get("tool_calls"):
        calls = []
        for j, c in enumerate(as_list(m["tool_calls"], f"{p}.tool_calls")):
            cp = f"{p}.tool_calls[{j}]"
            c = as_dict(c, cp)
            fn = as_dict(c.get("function"), f"{cp}.function")
            calls.append(
                {
                    "id": as_str(c.get("id", ""), f"{cp}.id"),
                    "type": "function",
                    "function": {
                        "name": as_str(fn.get("name"), f"{cp}.function.name"),
                        "arguments": tool_arguments(fn.get("arguments"), f"{cp}.function.arguments"),
                    },
                }
            )
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = as_str(m.get("tool_call_id", ""), f"{p}.tool_call_id")
    return out


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> str:
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("auto", "none", "required"):
        return str(raw)
    c = as_dict(raw, "tool_choice")
    name = as_dict(c.get("function"), "tool_choice.function").get("name")
    if not isinstance(name, str) or not any(t["function"]["name"] == name for t in tools or ()):
        raise invalid(f"tool_choice names no tool of the request: {name!r}", "tool_choice")
    return name


def parse(body: dict[str, Any], default_max_tokens: int) -> ChatRequest:
    """A :class:`ChatRequest` from a chat-completions body; ApiError (400) when invalid or asking
    for an option not implemented (:mod:`.refusals`)."""
    refuse_chat(body)
    model = as_str(body.get("model"), "model")
    msgs = as_list(body.get("messages"), "messages")
    if not msgs:
        raise invalid("messages must not be empty", "messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    n = opt_int(body, "n", 1, 1, 1)
    assert n == 1
    tools = None
    if body.get("tools"):
        tools = []
        for i, t in enumerate(as_list(body["tools"], "tools")):
            t = as_dict(t, f"tools[{i}]")
            if t.get("type", "function") != "function":
                raise invalid(f"tools[{i}].type must be 'function'", f"tools[{i}].type")
            fn = as_dict(t.get("function"), f"tools[{i}].function")
            tools.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}].function"))
    max_tokens = opt_int(body, "max_completion_tokens", None, 1, 1 << 20)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", default_max_tokens, 1, 1 << 20)
    opts = body.get("stream_options")
    include_usage = bool(opts and as_dict(opts, "stream_options").get("include_usage"))
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=int(max_tokens or default_max_tokens),
        stream=opt_bool(body, "stream"),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        temperature=opt_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=opt_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(opt_int(body, "top_k", -1, -1, 1 << 20) or -1),
        stop=stop_strings(body.get("stop"), "stop"),
        seed=opt_int(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        include_usage=include_usage,
        logprobs=opt_bool(body, "logprobs"),
        ignore_eos=opt_bool(body, "ignore_eos"),
        template_kwargs=template_kwargs(body),
    )


_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def _tool_calls(answer: Answer, *, indexed: bool) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(answer.tool_calls):
        item: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
        if indexed:
            item = {"index": i, **item}
        out.append(item)
    return out


def usage(answer: Answer) -> dict[str, int]:
    """The OpenAI ``usage`` object of an answer (chat and legacy completions alike)."""
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def _logprobs(answer: Answer, piece: Any) -> dict[str, Any]:
    items = []
    for tid, lp in zip(answer.output_ids, answer.logprobs, strict=True):
        text = piece(tid)
        items.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": items}


def response(req: ChatRequest, answer: Answer, rid: str, piece: Any) -> dict[str, Any]:
    """The ``chat.completion`` object of ``answer``; ``piece(id)`` names a token (logprobs)."""
    msg: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning is not None:
        msg["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        msg["content"] = answer.content or None
        msg["tool_calls"] = _tool_calls(answer, indexed=False)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "message": msg,
                "logprobs": _logprobs(answer, piece) if req.logprobs else None,
                "finish_reason": _FINISH[answer.finish],
            }
        ],
        "usage": usage(answer),
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Stream:
    """The SSE events of one streamed answer (``chat.completion.chunk`` objects, then ``[DONE]``)."""

    def __init__(self, req: ChatRequest, rid: str, prompt_tokens: int) -> None:
        self.req = req
        self.rid = rid
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        c: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.req.include_usage:
            c["usage"] = None
        return _sse(c)

    def start(self) -> bytes:
        """The first chunk (the assistant role)."""
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, delta: str) -> bytes:
        """A content delta."""
        return self._chunk({"content": delta})

    def reasoning(self, delta: str) -> bytes:
        """A reasoning delta (``reasoning_content``, as vLLM, SGLang and DeepSeek's API stream it)."""
        return self._chunk({"reasoning_content": delta})

    def end(self, answer: Answer, pending_text: str, pending_reasoning: str = "") -> bytes:
        """Remaining reasoning and text, tool calls, the finish chunk, usage (when asked) and ``[DONE]``."""
        out = [self.reasoning(pending_reasoning)] if pending_reasoning else []
        out += [self.text(pending_text)] if pending_text else []
        if answer.tool_calls:
            out.append(self._chunk({"tool_calls": _tool_calls(answer, indexed=True)}))
        out.append(self._chunk({}, _FINISH[answer.finish]))
        if self.req.include_usage:
            out.append(
                _sse(
                    {
                        "id": self.rid,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.req.model,
                        "choices": [],
                        "usage": usage(answer),
                    }
                )
            )
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def error(self, err: ApiError) -> bytes:
        """An error after the stream started (the SDK raises it as an APIError)."""
        return _sse({"error": error_body(err)}) + b"data: [DONE]\n\n"


def models(model: str) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "tracestore"}]}


__all__ = ["NAME", "Stream", "error_body", "models", "parse", "response", "usage"]
