"""The reference policy's tool-call syntax: one call per line, the tool's name then its values.

``add 3`` is a call of tool ``add`` with its one parameter ``n = 3``. The
builtin tokenizer of the gateway renders and parses assistant tool calls
this way (the tiny policy is trained on it), and the HTTP agents of the
trainer use the same parser to send an answer back exactly as the gateway
returned it (:mod:`.api_messages`). Pure: no I/O, no third-party imports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: A tool call found in an answer: (name, arguments).
ParsedCall = tuple[str, dict[str, Any]]


def tool_params(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, list[tuple[str, str]]]:
    """Tool name -> its parameters as ``(name, json type)`` in schema order."""
    out: dict[str, list[tuple[str, str]]] = {}
    for t in tools or ():
        fn = t.get("function", {})
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = [
            (p, str(spec.get("type", "string")) if isinstance(spec, dict) else "string") for p, spec in props.items()
        ]
    return out


def _typed(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    return True


def _value(v: Any) -> str:
    if isinstance(v, str) and v and not any(c.isspace() or c == '"' for c in v):
        return v
    return json.dumps(v, ensure_ascii=False)


def call_line(call: Mapping[str, Any], params: dict[str, list[tuple[str, str]]]) -> str:
    """One canonical tool call (``{"function": {"name", "arguments"}}``) as its line."""
    fn = call.get("function", call)
    name, args = fn["name"], fn.get("arguments") or {}
    order = [p for p, _ in params.get(name, [])] or list(args)
    return " ".join([name, *(_value(args[p]) for p in order if p in args)])


def parse_calls(text: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, list[ParsedCall]]:
    """``(content, calls)``: lines ``name v1 v2 ...`` naming a tool with exactly that many typed
    values are calls; the other lines, stripped, are the content (the whole text when no call)."""
    params = tool_params(tools)
    content: list[str] = []
    calls: list[ParsedCall] = []
    for line in text.split("\n"):
        words = line.split(" ")
        spec = params.get(words[0]) if words else None
        if spec is not None and len(words) - 1 == len(spec):
            args: dict[str, Any] = {}
            for (pname, kind), raw in zip(spec, words[1:], strict=True):
                try:
                    val: Any = json.loads(raw)
                except ValueError:
                    val = raw
                if kind == "string" and not isinstance(val, str):
                    val = raw
                if not _typed(val, kind):
                    break
                args[pname] = val
            else:
                calls.append((words[0], args))
                continue
        content.append(line)
    if not calls:
        return text, []
    return "\n".join(content).strip(), calls


__all__ = ["ParsedCall", "call_line", "parse_calls", "tool_params"]
