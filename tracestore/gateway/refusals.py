"""Options the gateway does not implement: a 400 that names them, never silently ignored.

Each wire format has one check, run first by its ``parse``. An option is
refused when the request asks for something the gateway would not do (a JSON
schema for the answer, several choices, a bias on token logits, a built-in
tool, a background run...); the value a client sends by default when it asks
for nothing (``parallel_tool_calls: true``, ``response_format: {"type":
"text"}``, ``n: 1``, ``logit_bias: {}``, zero penalties) is accepted. Image,
audio and file parts are refused where the messages are parsed.
"""

from __future__ import annotations

from typing import Any

from .chat import invalid


def _refuse(name: str, what: str) -> None:
    raise invalid(f"{name}: {what} is not implemented by this gateway", name)


def _format_type(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else value


def _common(body: dict[str, Any]) -> None:
    if body.get("parallel_tool_calls") is False:
        _refuse("parallel_tool_calls", "false (at most one tool call per answer)")
    if body.get("top_logprobs"):
        _refuse("top_logprobs", "returning alternative tokens")


def refuse_chat(body: dict[str, Any]) -> None:
    """The chat-completions options not implemented (module docstring)."""
    rf = body.get("response_format")
    if rf is not None and _format_type(rf) != "text":
        _refuse("response_format", f"a structured answer ({_format_type(rf)!r})")
    if body.get("logit_bias"):
        _refuse("logit_bias", "biasing token logits")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            _refuse(name, "a repetition penalty")
    for name in ("functions", "function_call", "audio", "prediction", "web_search_options"):
        if body.get(name) is not None:
            _refuse(name, "this option")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        _refuse("modalities", f"output modalities {modalities!r}")
    _common(body)


def refuse_messages(body: dict[str, Any]) -> None:
    """The Messages API options not implemented (module docstring)."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
        _refuse("tool_choice.disable_parallel_tool_use", "at most one tool use per answer")
    for name in ("mcp_servers", "container"):
        if body.get(name) is not None:
            _refuse(name, "this option")


def refuse_responses(body: dict[str, Any]) -> None:
    """The Responses API options not implemented (module docstring)."""
    if body.get("background"):
        _refuse("background", "a background response")
    text = body.get("text")
    if isinstance(text, dict) and text.get("format") is not None and _format_type(text["format"]) != "text":
        _refuse("text.format", f"a structured answer ({_format_type(text['format'])!r})")
    for name in ("conversation", "prompt", "max_tool_calls"):
        if body.get(name) is not None:
            _refuse(name, "this option")
    if body.get("truncation") not in (None, "disabled"):
        _refuse("truncation", f"{body['truncation']!r}")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") not in (None, "none"):
        _refuse("reasoning.effort", "a reasoning effort")
    include = body.get("include")
    if include:
        _refuse("include", f"extra output ({include!r})")
    _common(body)


__all__ = ["refuse_chat", "refuse_messages", "refuse_responses"]
