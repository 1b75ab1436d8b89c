"""The gateway's wire-independent view of a chat request and its answer.

Both wire formats (:mod:`.openai`, :mod:`.anthropic`) parse a request into a
:class:`ChatRequest` whose ``messages`` are *canonical*: plain dicts in the
shape Hugging Face chat templates expect (``role``, ``content`` as a string,
assistant ``tool_calls`` as ``{"id", "type": "function", "function": {"name",
"arguments": dict}}``, tool results as ``role: "tool"`` with
``tool_call_id``). Canonicalising is what keeps a multi-turn conversation on
one trie path: the answer the gateway returns is recorded under the template's
rendering of the canonical assistant message, and the client echoes the same
message back next turn (tool-call arguments arrive as JSON strings and are
parsed back to the same dict before templating; fields a template never reads
are dropped), so the earlier turns render to the same text.

:class:`ApiError` is what every check raises; each wire module renders it in
its own error shape (OpenAI ``object: "error"``, Anthropic ``type: "error"``).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

Message = dict[str, Any]

#: Error kinds and their HTTP status (the wire modules map kinds to their own type names).
STATUS = {
    "invalid_request": 400,
    "not_found": 404,
    "conflict": 409,
    "gone": 410,
    "too_large": 413,
    "internal": 500,
    "bad_gateway": 502,
    "unavailable": 503,
}


class ApiError(Exception):
    """An HTTP error answered in the caller's native shape.

    ``kind`` is a key of :data:`STATUS`; ``param`` names the offending request
    field when there is one; ``retry_after_s`` becomes the ``Retry-After``
    header (503 while the gate is sealed or a weight update aborted the request).
    """

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        if kind not in STATUS:
            raise ValueError(f"unknown error kind {kind!r}")
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.code = code
        #: Tell the SDKs not to retry (``x-should-retry: false``): nothing will change soon.
        self.no_retry = False

    @property
    def status(self) -> int:
        """The HTTP status of this error."""
        return STATUS[self.kind]

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` when set;
        ``x-should-retry: false`` (the openai and anthropic SDKs honour it) when :attr:`no_retry`."""
        out: dict[str, str] = {"x-should-retry": "false"} if self.no_retry else {}
        if self.retry_after_s is None:
            return out
        ms = max(1, round(self.retry_after_s * 1000))
        return {**out, "Retry-After": str(max(1, -(-ms // 1000))), "retry-after-ms": str(ms)}


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 ``invalid_request`` error about ``param``."""
    return ApiError("invalid_request", message, param=param)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an answer: ``arguments`` is the parsed JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]

    def canonical(self) -> dict[str, Any]:
        """The call as a canonical message's ``tool_calls`` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def arguments_json(self) -> str:
        """The arguments as the JSON string OpenAI clients expect."""
        return orjson.dumps(self.arguments).decode()


@dataclass
class ChatRequest:
    """A parsed chat request, wire format aside.

    ``tools`` are canonical function tools (``{"type": "function",
    "function": {"name", "description", "parameters"}}``), None when the
    request has none; ``tool_choice`` is ``auto``, ``none``, ``required`` or a
    tool name; ``stop`` are stop strings; ``session_id`` comes from the body
    (``session_id``) or the ``X-Session-Id`` header.
    """

    model: str
    messages: list[Message]
    max_tokens: int
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    include_usage: bool = False
    logprobs: bool = False
    ignore_eos: bool = False
    session_id: str | None = None
    #: ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``): they reach the chat template.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Responses API (:mod:`.stateful`): the answer's id, the response it continues, whether its
    #: items are kept, and what runs once the turn is recorded (before the client sees its end).
    response_id: str | None = None
    previous_response_id: str | None = None
    response_store: bool = True
    on_recorded: Callable[[Answer], Awaitable[None]] | None = None
    #: What the prompt mode derived from the request, kept so it is computed once per request
    #: (``tito``: the conversation key, its message ends and its digest: :meth:`.TitoPrompts.key_of`).
    memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def parse_tools(self) -> bool:
        """True when the answer should be searched for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class Answer:
    """What the engine produced, decoded: the text for the client and the ids to record.

    ``content`` excludes the stop word; ``finish`` is ``stop``, ``length`` or
    ``tool_calls``; ``stop_string`` is the stop string that ended the answer
    (None for a stop token). ``prompt_tokens``/``completion_tokens`` are the
    exact counts of ids sent and generated (the stop token included).
    """

    content: str
    tool_calls: tuple[ToolCall, ...]
    finish: str
    stop_string: str | None
    output_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    version: int | None = None
    #: The answer's reasoning (``--reasoning-parser``), None when it has none.
    reasoning: str | None = None

    @property
    def completion_tokens(self) -> int:
        """Ids the engine generated for this answer."""
        return len(self.output_ids)

    def message(self) -> Message:
        """The canonical assistant message (what the client will send back next turn)."""
        m: Message = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = [c.canonical() for c in self.tool_calls]
        return m


class Wire(Protocol):
    """What the gateway needs of a wire-format module (:mod:`.openai`, :mod:`.anthropic`)."""

    NAME: str
    Stream: Any

    def parse(self, body: dict[str, Any], default_max_tokens: int) -> ChatRequest: ...  # pragma: no cover
    def response(self, req: ChatRequest, answer: Answer, rid: str, piece: Any) -> dict[str, Any]: ...  # pragma: no cover
    def error_body(self, err: ApiError) -> dict[str, Any]: ...  # pragma: no cover
    def models(self, model: str) -> dict[str, Any]: ...  # pragma: no cover


def new_id(prefix: str) -> str:
    """A random id with ``prefix`` (``chatcmpl-``, ``msg_``, ``call_``, ``toolu_``)."""
    return prefix + secrets.token_hex(12)


# -- helpers shared by both wire formats ---------------------------------------------------------


def as_dict(value: Any, param: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else a 400 about ``param``."""
    if not isinstance(value, dict):
        raise invalid(f"{param} must be an object", param)
    return value


def as_list(value: Any, param: str) -> list[Any]:
    """``value`` if it is a JSON array, else a 400 about ``param``."""
    if not isinstance(value, list):
        raise invalid(f"{param} must be an array", param)
    return value


def as_str(value: Any, param: str) -> str:
    """``value`` if it is a string, else a 400 about ``param``."""
    if not isinstance(value, str):
        raise invalid(f"{param} must be a string", param)
    return value


def opt_number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    """The number ``body[name]`` (``default`` when absent or null), checked to lie in [lo, hi]."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise invalid(f"{name} must be a number in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def opt_int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    """The integer ``body[name]`` (``default`` when absent or null), checked to lie in [lo, hi]."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise invalid(f"{name} must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def opt_bool(body: dict[str, Any], name: str) -> bool:
    """The boolean ``body[name]`` (False when absent or null)."""
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"{name} must be a boolean, got {v!r}", name)
    return v


def stop_strings(value: Any, param: str) -> list[str]:
    """A ``stop``/``stop_sequences`` value as a list of non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else as_list(value, param)
    if len(items) > 16 or not all(isinstance(x, str) and x for x in items):
        raise invalid(f"{param} must be a non-empty string or up to 16 of them", param)
    return list(items)


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The body's ``chat_template_kwargs`` (an object of options for the chat template; {} when absent)."""
    raw = body.get("chat_template_kwargs")
    if raw is None:
        return {}
    kw = as_dict(raw, "chat_template_kwargs")
    for k in kw:
        if not k.isidentifier() or k in ("messages", "tools", "add_generation_prompt", "tokenize"):
            raise invalid(f"chat_template_kwargs: {k!r} is not an option a template can take", "chat_template_kwargs")
    return dict(kw)


def tool_arguments(raw: Any, param: str) -> dict[str, Any]:
    """Tool-call arguments as a dict: a JSON string is parsed (the template needs the object)."""
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            raise invalid(f"{param} is not valid JSON", param) from None
    if not isinstance(raw, dict):
        raise invalid(f"{param} must be a JSON object", param)
    return raw


def function_tool(name: Any, description: Any, parameters: Any, param: str) -> dict[str, Any]:
    """A canonical function tool, checked."""
    name = as_str(name, f"{param}.name")
    if not name or len(name) > 128:
        raise invalid(f"{param}.name must be 1..128 characters", f"{param}.name")
    params = {"type": "object", "properties": {}} if parameters is None else as_dict(parameters, f"{param}.parameters")
    fn: dict[str, Any] = {"name": name}  # OpenAI's key order: templates that tojson a tool show it as sent
    if description is not None:
        fn["description"] = as_str(description, f"{param}.description")
    fn["parameters"] = params
    return {"type": "function", "function": fn}


__all__ = [
    "STATUS",
    "Answer",
    "ApiError",
    "ChatRequest",
    "Message",
    "ToolCall",
    "Wire",
    "invalid",
    "new_id",
]
