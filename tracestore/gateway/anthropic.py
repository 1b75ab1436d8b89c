"""Anthropic wire format: ``POST /v1/messages`` (stream or not, tool use) and its errors.

Request fields read: ``model``, ``max_tokens`` (required), ``messages``
(user/assistant; string content or ``text``, ``tool_use``, ``tool_result``
blocks; ``thinking`` blocks are dropped), ``system`` (string or text
blocks), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``,
``stream``, ``tools`` (client tools with ``input_schema``), ``tool_choice``,
and the extensions ``session_id`` and ``ignore_eos``. Canonically a
``tool_result`` block becomes a ``tool`` message (the form chat templates
render) and ``tool_use`` blocks become the assistant's ``tool_calls``, so the
two wire formats record the same conversation on the same trie path.
Errors: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

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
from .refusals import refuse_messages

NAME = "anthropic"

_TYPES = {
    "invalid_request": "invalid_request_error",
    "not_found": "not_found_error",
    "conflict": "invalid_request_error",
    "gone": "not_found_error",
    "too_large": "request_too_large",
    "internal": "api_error",
    "bad_gateway": "api_error",
    "unavailable": "overloaded_error",
}


def error_body(err: ApiError) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": _TYPES[err.kind], "message": err.message}}


def _text_blocks(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for i, b in enumerate(as_list(content, param)):
        b = as_dict(b, f"{param}[{i}]")
        if b.get("type") != "text":
            raise invalid(f"{param}[{i}]: only text blocks are supported here, got {b.get('type')!r}", param)
        out.append(as_str(b.get("text"), f"{param}[{i}].text"))
    return "".join(out)


def _messages(raw: Any) -> list[Message]:
    out: list[Message] = []
    for i, m in enumerate(as_list(raw, "messages")):
        p = f"messages[{i}]"
        m = as_dict(m, p)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise invalid(f"{p}.role must be 'user' or 'assistant', got {role!r}", f"{p}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        text: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(as_list(content, f"{p}.content")):
            bp = f"{p}.content[{j}]"
            b = as_dict(b, bp)
            kind = b.get("type")
            if kind == "text":
                text.append(as_str(b.get("text"), f"{bp}.text"))
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "id": as_str(b.get("id", ""), f"{bp}.id"),
                        "type": "function",
                        "function": {
                            "name": as_str(b.get("name"), f"{bp}.name"),
                            "arguments": tool_arguments(b.get("input", {}), f"{bp}.input"),
                        },
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = b.get("content", "")
                out.append(
                    {
                        "role": "tool",
                        "content": _text_blocks(result, f"{bp}.content") if result is not None else "",
                        "tool_call_id": as_str(b.get("tool_use_id", ""), f"{bp}.tool_use_id"),
                    }
                )
            elif kind == "thinking" and role == "assistant":
                thinking.append(as_str(b.get("thinking", ""), f"{bp}.thinking"))
            elif kind == "redacted_thinking":
                continue
            else:
                raise invalid(f"{bp}: unsupported block type {kind!r} for role {role}", f"{bp}.type")
        if role == "assistant":
            msg: Message = {"role": "assistant", "content": "".join(text)}
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> str:
    if raw is None:
        return "auto" if tools else "none"
    c = as_dict(raw, "tool_choice")
    kind = c.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool":
        name = c.get("name")
        if not isinstance(name, str) or not any(t["function"]["name"] == name for t in tools or ()):
            raise invalid(f"tool_choice names no tool of the request: {name!r}", "tool_choice.name")
        return name
    raise invalid(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def parse(body: dict[str, Any], default_max_tokens: int) -> ChatRequest:
    """A :class:`ChatRequest` from a Messages API body; ApiError (400) when invalid.

    ``max_tokens`` is required, as in Anthropic's API (``default_max_tokens`` unused); options not
    implemented are refused (:mod:`.refusals`).
    """
    refuse_messages(body)
    model = as_str(body.get("model"), "model")
    if body.get("max_tokens") is None:
        raise invalid("max_tokens is required", "max_tokens")
    max_tokens = opt_int(body, "max_tokens", None, 1, 1 << 20)
    msgs = _messages(body.get("messages"))
    if not msgs:
        raise invalid("messages must not be empty", "messages")
    if msgs[-1]["role"] == "assistant":
        raise invalid("a final assistant message (prefill) is not supported", "messages")
    system = body.get("system")
    if system:
        msgs.insert(0, {"role": "system", "content": _text_blocks(system, "system")})
    tools = None
    if body.get("tools"):
        tools = []
        for i, t in enumerate(as_list(body["tools"], "tools")):
            t = as_dict(t, f"tools[{i}]")
            if t.get("type") not in (None, "custom"):
                raise invalid(f"tools[{i}]: server tools ({t.get('type')!r}) are not supported", f"tools[{i}].type")
            tools.append(function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]"))
    return ChatRequest(
        model=model,
        messages=msgs,
        max_tokens=int(max_tokens or default_max_tokens),
        stream=opt_bool(body, "stream"),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        temperature=opt_number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=opt_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(opt_int(body, "top_k", -1, -1, 1 << 20) or -1),
        stop=stop_strings(body.get("stop_sequences"), "stop_sequences"),
        ignore_eos=opt_bool(body, "ignore_eos"),
        template_kwargs=_kwargs(body),
    )


def _kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``, and ``thinking`` (``{"type": "enabled"|"disabled"}``) as ``enable_thinking``."""
    kw = template_kwargs(body)
    thinking = body.get("thinking")
    if thinking is not None:
        kind = as_dict(thinking, "thinking").get("type")
        if kind not in ("enabled", "disabled"):
            raise invalid(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}", "thinking.type")
        kw.setdefault("enable_thinking", kind == "enabled")
    return kw


def _stop_reason(answer: Answer) -> str:
    if answer.finish == "tool_calls":
        return "tool_use"
    if answer.finish == "length":
        return "max_tokens"
    return "stop_sequence" if answer.stop_string is not None else "end_turn"


def _blocks(answer: Answer) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if answer.reasoning is not None:
        out.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        out.append({"type": "text", "text": answer.content})
    out += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in answer.tool_calls]
    return out


def response(req: ChatRequest, answer: Answer, rid: str, piece: Any) -> dict[str, Any]:
    """The ``message`` object of ``answer`` (``piece`` unused: no logprobs in this API)."""
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": _blocks(answer),
        "stop_reason": _stop_reason(answer),
        "stop_sequence": answer.stop_string,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
    }


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class Stream:
    """The SSE events of one streamed message (message_start ... message_stop)."""

    def __init__(self, req: ChatRequest, rid: str, prompt_tokens: int) -> None:
        self.req = req
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self._text_open = False
        self._thinking_open = False
        self._index = 0

    def start(self) -> bytes:
        """``message_start`` (with the exact input token count)."""
        msg: dict[str, Any] = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": msg})

    def text(self, delta: str) -> bytes:
        """A ``text_delta`` (opening the text block first, after closing the thinking block)."""
        head = self._close_thinking()
        if not self._text_open:
            self._text_open = True
            head += _event(
                "content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": {"type": "text", "text": ""}},
            )
        return head + _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": {"type": "text_delta", "text": delta}},
        )

    def reasoning(self, delta: str) -> bytes:
        """A ``thinking_delta`` (opening the thinking block first; it comes before the text)."""
        head = b""
        if not self._thinking_open:
            self._thinking_open = True
            head = _event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": self._index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                },
            )
        return head + _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": {"type": "thinking_delta", "thinking": delta}},
        )

    def _close_thinking(self) -> bytes:
        if not self._thinking_open:
            return b""
        self._thinking_open = False
        out = _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": {"type": "signature_delta", "signature": ""}},
        ) + _event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        self._index += 1
        return out

    def _close_text(self) -> bytes:
        if not self._text_open:
            return b""
        self._text_open = False
        out = _event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        self._index += 1
        return out

    def end(self, answer: Answer, pending_text: str, pending_reasoning: str = "") -> bytes:
        """Remaining thinking and text, ``tool_use`` blocks, ``message_delta`` and ``message_stop``."""
        out: list[bytes] = [self.reasoning(pending_reasoning)] if pending_reasoning else []
        out.append(self._close_thinking())
        out += [self.text(pending_text)] if pending_text else []
        out.append(self._close_text())
        for c in answer.tool_calls:
            i = self._index
            out.append(
                _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}},
                )
            )
            out.append(
                _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": c.arguments_json()}},
                )
            )
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": i}))
            self._index += 1
        out.append(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(answer), "stop_sequence": answer.stop_string},
                    "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
                },
            )
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, err: ApiError) -> bytes:
        """An ``error`` event after the stream started (the SDK raises it)."""
        return _event("error", error_body(err))


def models(model: str) -> dict[str, Any]:
    """``GET /v1/models`` in Anthropic's shape (asked with an ``anthropic-version`` header)."""
    item = {"type": "model", "id": model, "display_name": model, "created_at": "1970-01-01T00:00:00Z"}
    return {"data": [item], "has_more": False, "first_id": model, "last_id": model}


__all__ = ["NAME", "Stream", "error_body", "models", "parse", "response"]
