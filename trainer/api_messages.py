"""The calculator episode as OpenAI chat messages, and the key its trace is recorded under.

The gateway records a session token-exact (``--prompt-mode tito``): its path
is keyed by the canonical messages (:func:`tracestore.conversation_key`),
and a turn extends it when the client sends each answer back as the gateway
returned it. :func:`to_openai` turns the episode's plain messages into those
API messages: an assistant text becomes what the gateway's builtin tool
parser makes of it (:func:`~.tool_syntax.parse_calls`: the lines that are
calls become ``tool_calls``, the rest stays content), a tool message answers
the calls before it. :func:`tito_key` is the key of a sample's conversation
up to its last answer: the learner exports the sample's trace with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from tracestore.conversation import conversation_key

from .tool_syntax import parse_calls

#: The calculator, as OpenAI function tools.
CALC_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": op,
            "description": f"{op} a one-digit number to the current value",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        },
    }
    for op in ("add", "sub", "mul")
]


def to_openai(messages: Sequence[Mapping[str, str]]) -> list[dict[str, Any]]:
    """The episode's conversation as OpenAI messages, each answer as the gateway returned it.

    An answer whose lines the builtin parser reads as calls (``add 3``) is a
    ``tool_calls`` message with the remaining text as content; a tool
    message after it names its first call's id. ``done`` and anything else
    stay content, verbatim (`` add 3``, with its space, is not a call).
    """
    out: list[dict[str, Any]] = []
    last_call = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            content, calls = parse_calls(m["content"], CALC_TOOLS)
            if calls:
                ids = [f"call_{i}_{j}" for j in range(len(calls))]
                last_call = ids[0]
                out.append(
                    {
                        "role": "assistant",
                        "content": content or None,
                        "tool_calls": [
                            {"id": cid, "type": "function", "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
                            for cid, (name, args) in zip(ids, calls, strict=True)
                        ],
                    }
                )
                continue
            last_call = ""  # a result after it answers no call of the API's
            out.append({"role": "assistant", "content": m["content"]})
        elif m["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": last_call, "content": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def tito_key(messages: Sequence[Mapping[str, str]]) -> str:
    """The token-exact trace key of the conversation up to its last answer (with the calculator tools)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return conversation_key(to_openai(messages[: last + 1]), CALC_TOOLS)


__all__ = ["CALC_TOOLS", "tito_key", "to_openai"]
