"""OpenAI Responses wire format: ``POST /v1/responses`` (stream or not, function tools) and its errors.

The Responses input is another spelling of the canonical messages every wire
parses to (:mod:`.chat`), so a turn is recorded token-exact on the same trie
path as the same conversation sent as chat completions:

* ``input`` a string: one user message; ``instructions``: a system message first;
* a ``message`` item (``type`` may be omitted; roles user, system, developer,
  assistant; string content or ``input_text``/``output_text`` parts): that message;
* a run of ``reasoning``, assistant ``message`` and ``function_call`` items (what one
  answer's output is): one assistant message (its text, ``reasoning_content``,
  ``tool_calls``), as the answer was recorded;
* a ``function_call_output`` item: a ``tool`` message with ``tool_call_id``.

An answer's output is a ``reasoning`` item (when the reasoning parser found
some), a ``message`` item with one ``output_text`` part (unless the answer is
tool calls only) and one ``function_call`` item per call. Fields read besides:
``model``, ``tools`` (``{"type": "function", "name", "description",
"parameters"}``), ``tool_choice``, ``max_output_tokens``, ``temperature``,
``top_p``, ``stream``, ``previous_response_id`` and ``store``
(:mod:`.stateful`), and the extensions ``session_id``, ``top_k``,
``ignore_eos``; options the gateway does not implement are refused
(:mod:`.refusals`). Errors: ``{"error": {"message", "type", "param", "code"}}``.
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
    template_kwargs,
    tool_arguments,
)
from .openai import error_body as _openai_error
from .refusals import refuse_responses

NAME = "responses"

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ANSWER_ITEMS = ("reasoning", "function_call")


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error shape (``{"error": {...}}``), which the ``openai`` SDK reads as its own."""
    e = _openai_error(err)
    return {"error": {"message": e["message"], "type": e["type"], "param": e["param"], "code": e["code"]}}


def _parts_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for i, p in enumerate(as_list(content, param)):
        p = as_dict(p, f"{param}[{i}]")
        kind = p.get("type")
        if kind not in ("input_text", "output_text", "text"):
            raise invalid(f"{param}[{i}]: {kind!r} parts are not supported (text only)", f"{param}[{i}].type")
        out.append(as_str(p.get("text"), f"{param}[{i}].text"))
    return "".join(out)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "".join(as_str(as_dict(p, param).get("text", ""), f"{param}.text") for p in as_list(parts, param))


def _kind(item: dict[str, Any]) -> Any:
    return item.get("type", "message" if "role" in item else None)


def input_messages(raw: Any) -> list[Message]:
    """The canonical messages of a Responses ``input`` (a string or a list of items)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[Message] = []
    answer: Message | None = None  # the assistant message being folded from a run of answer items
    for i, item in enumerate(as_list(raw, "input")):
        p = f"input[{i}]"
        item = as_dict(item, p)
        kind = _kind(item)
        if kind == "message" and item.get("role") == "assistant" or kind in _ANSWER_ITEMS:
            if answer is None:
                answer = {"role": "assistant", "content": ""}
                out.append(answer)
            if kind == "message":
                answer["content"] += _parts_text(item.get("content", ""), f"{p}.content")
            elif kind == "reasoning":
                answer["reasoning_content"] = answer.get("reasoning_content", "") + _reasoning_text(item, f"{p}.content")
            else:
                call = {
                    "id": as_str(item.get("call_id", ""), f"{p}.call_id"),
                    "type": "function",
                    "function": {
                        "name": as_str(item.get("name"), f"{p}.name"),
                        "arguments": tool_arguments(item.get("arguments"), f"{p}.arguments"),
                    },
                }
                answer.setdefault("tool_calls", []).append(call)
            continue
        answer = None
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise invalid(f"{p}.role must be one of {sorted(_ROLES)}, got {item.get('role')!r}", f"{p}.role")
            out.append({"role": role, "content": _parts_text(item.get("content", ""), f"{p}.content")})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append(
                {
                    "role": "tool",
                    "content": _parts_text(output, f"{p}.output"),
                    "tool_call_id": as_str(item.get("call_id", ""), f"{p}.call_id"),
                }
            )
        else:
            raise invalid(f"{p}: input items of type {kind!r} are not supported", f"{p}.type")
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if not raw:
        return None
    out = []
    for i, t in enumerate(as_list(raw, "tools")):
        t = as_dict(t, f"tools[{i}]")
        if t.get("type") != "function":
            raise invalid(f"tools[{i}]: built-in tools ({t.get('type')!r}) are not supported, only function tools", f"tools[{i}].type")
        out.append(function_tool(t.get("name"), t.get("description"), t.get("parameters"), f"tools[{i}]"))
    return out


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> str:
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("auto", "none", "required"):
        return str(raw)
    c = as_dict(raw, "tool_choice")
    if c.get("type") != "function":
        raise invalid(f"tool_choice of type {c.get('type')!r} is not supported", "tool_choice.type")
    name = c.get("name")
    if not isinstance(name, str) or not any(t["function"]["name"] == name for t in tools or ()):
        raise invalid(f"tool_choice names no tool of the request: {name!r}", "tool_choice.name")
    return name


def parse(body: dict[str, Any], default_max_tokens: int) -> ChatRequest:
    """A :class:`ChatRequest` of the request's own input (``previous_response_id`` is resolved by
    :mod:`.stateful`); ApiError (400) when invalid or asking for what is not implemented."""
    refuse_responses(body)
    model = as_str(body.get("model"), "model")
    if body.get("input") is None:
        raise invalid("input is required", "input")
    messages = input_messages(body.get("input"))
    if not messages and body.get("previous_response_id") is None:
        raise invalid("input must not be empty", "input")
    tools = _tools(body.get("tools"))
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=int(opt_int(body, "max_output_tokens", default_max_tokens, 1, 1 << 20) or default_max_tokens),
        stream=opt_bool(body, "stream"),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        temperature=opt_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=opt_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(opt_int(body, "top_k", -1, -1, 1 << 20) or -1),
        include_usage=True,
        ignore_eos=opt_bool(body, "ignore_eos"),
        template_kwargs=template_kwargs(body),
    )


def instructions(body: dict[str, Any]) -> list[Message]:
    """``instructions`` as the system message that goes first (none when absent)."""
    raw = body.get("instructions")
    if raw is None or raw == "":
        return []
    return [{"role": "system", "content": _parts_text(raw, "instructions") if not isinstance(raw, str) else raw}]


# -- the answer ------------------------------------------------------------------------------


def _ids(rid: str) -> tuple[str, str, str]:
    tail = rid.split("_", 2)[1] if rid.count("_") >= 1 else rid
    return f"rs_{tail}", f"msg_{tail}", f"fc_{tail}"


def _message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def _reasoning_item(rsid: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": rsid, "summary": [], "content": content}


def _call_item(fcid: str, i: int, c: Any, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"{fcid}_{i}", "call_id": c.id, "name": c.name, "arguments": arguments, "status": status}


def output_items(answer: Answer, rid: str) -> list[dict[str, Any]]:
    """The output items of ``answer`` (module docstring)."""
    rsid, mid, fcid = _ids(rid)
    out: list[dict[str, Any]] = []
    if answer.reasoning is not None:
        out.append(_reasoning_item(rsid, answer.reasoning))
    if answer.content or not answer.tool_calls:
        out.append(_message_item(mid, answer.content, "completed" if answer.finish != "length" else "incomplete"))
    out += [_call_item(fcid, i, c, c.arguments_json(), "completed") for i, c in enumerate(answer.tool_calls)]
    return out


def _response(req: ChatRequest, rid: str, created: float, output: list[dict[str, Any]], answer: Answer | None) -> dict[str, Any]:
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
              "parameters": t["function"]["parameters"], "strict": False} for t in req.tools or ()]
    status = "in_progress" if answer is None else ("incomplete" if answer.finish == "length" else "completed")
    choice: Any = req.tool_choice if req.tool_choice in ("auto", "none", "required") else {"type": "function", "name": req.tool_choice}
    r: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": choice,
        "tools": tools,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_tokens,
        "previous_response_id": req.previous_response_id,
        "store": req.response_store,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "metadata": {},
        "usage": None,
    }
    if answer is not None:
        r["usage"] = {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        }
    return r


def response(req: ChatRequest, answer: Answer, rid: str, piece: Any) -> dict[str, Any]:
    """The ``response`` object of ``answer`` (``piece`` unused: logprobs are not offered here)."""
    return _response(req, rid, int(time.time()), output_items(answer, rid), answer)


class Stream:
    """The SSE events of one streamed response (``response.created`` ... ``response.completed``),
    numbered by ``sequence_number``; the final response equals the one :func:`response` gives."""

    def __init__(self, req: ChatRequest, rid: str, prompt_tokens: int) -> None:
        self.req = req
        self.rid = rid
        self.created = int(time.time())
        self.seq = 0
        self.rsid, self.mid, self.fcid = _ids(rid)
        self.items: list[dict[str, Any]] = []
        self.reasoning_text: str | None = None  # the reasoning item is open
        self.message_text: str | None = None  # the message item is open

    def _ev(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        r = _response(self.req, self.rid, self.created, [], None)
        return self._ev("response.created", response=r) + self._ev("response.in_progress", response=r)

    def _close_reasoning(self) -> bytes:
        if self.reasoning_text is None:
            return b""
        i, text = len(self.items), self.reasoning_text
        part = {"type": "reasoning_text", "text": text}
        item = _reasoning_item(self.rsid, text)
        self.items.append(item)
        self.reasoning_text = None
        return (
            self._ev("response.reasoning_text.done", item_id=self.rsid, output_index=i, content_index=0, text=text)
            + self._ev("response.content_part.done", item_id=self.rsid, output_index=i, content_index=0, part=part)
            + self._ev("response.output_item.done", output_index=i, item=item)
        )

    def reasoning(self, delta: str) -> bytes:
        """A reasoning delta (the reasoning item opened first)."""
        out = b""
        i = len(self.items)
        if self.reasoning_text is None:
            self.reasoning_text = ""
            out += self._ev("response.output_item.added", output_index=i, item=_reasoning_item(self.rsid, None))
            out += self._ev("response.content_part.added", item_id=self.rsid, output_index=i, content_index=0,
                            part={"type": "reasoning_text", "text": ""})
        self.reasoning_text += delta
        return out + self._ev("response.reasoning_text.delta", item_id=self.rsid, output_index=i, content_index=0, delta=delta)

    def _open_message(self) -> bytes:
        if self.message_text is not None:
            return b""
        out = self._close_reasoning()
        i = len(self.items)
        self.message_text = ""
        out += self._ev("response.output_item.added", output_index=i, item=_message_item(self.mid, "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return out + self._ev("response.content_part.added", item_id=self.mid, output_index=i, content_index=0, part=part)

    def text(self, delta: str) -> bytes:
        """A text delta (the message item opened first)."""
        out = self._open_message()
        assert self.message_text is not None
        self.message_text += delta
        i = len(self.items)
        return out + self._ev("response.output_text.delta", item_id=self.mid, output_index=i, content_index=0, delta=delta, logprobs=[])

    def end(self, answer: Answer, pending_text: str, pending_reasoning: str = "") -> bytes:
        """What was held back, the items' ``done`` events, the function calls, ``response.completed``
        (``response.incomplete`` when cut by ``max_output_tokens``) with exact usage."""
        out = self.reasoning(pending_reasoning) if pending_reasoning else b""
        if answer.reasoning is not None and self.reasoning_text is None and not any(x["type"] == "reasoning" for x in self.items):
            out += self.reasoning("")
        out += self._close_reasoning()
        if pending_text or answer.content or not answer.tool_calls or self.message_text is not None:
            out += self.text(pending_text) if pending_text else self._open_message()
            i, text = len(self.items), answer.content
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item = _message_item(self.mid, text, "completed" if answer.finish != "length" else "incomplete")
            out += self._ev("response.output_text.done", item_id=self.mid, output_index=i, content_index=0, text=text, logprobs=[])
            out += self._ev("response.content_part.done", item_id=self.mid, output_index=i, content_index=0, part=part)
            out += self._ev("response.output_item.done", output_index=i, item=item)
            self.items.append(item)
        for j, c in enumerate(answer.tool_calls):
            i, args = len(self.items), c.arguments_json()
            fid = f"{self.fcid}_{j}"
            out += self._ev("response.output_item.added", output_index=i, item=_call_item(self.fcid, j, c, "", "in_progress"))
            out += self._ev("response.function_call_arguments.delta", item_id=fid, output_index=i, delta=args)
            out += self._ev("response.function_call_arguments.done", item_id=fid, output_index=i, name=c.name, arguments=args)
            item = _call_item(self.fcid, j, c, args, "completed")
            out += self._ev("response.output_item.done", output_index=i, item=item)
            self.items.append(item)
        final = _response(self.req, self.rid, self.created, output_items(answer, self.rid), answer)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._ev(kind, response=final)

    def error(self, err: ApiError) -> bytes:
        """An ``error`` event, then ``response.failed`` (the SDKs raise on either)."""
        e = error_body(err)["error"]
        failed = _response(self.req, self.rid, self.created, self.items, None)
        failed["status"] = "failed"
        failed["error"] = {"code": e["code"] if e["code"] else "server_error", "message": e["message"]}
        return self._ev("error", code=e["code"], message=e["message"], param=e["param"]) + self._ev("response.failed", response=failed)


def models(model: str) -> dict[str, Any]:
    """``GET /v1/models`` (OpenAI's list)."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "tracestore"}]}


__all__ = ["NAME", "Stream", "error_body", "input_messages", "instructions", "models", "output_items", "parse", "response"]
