"""What every parser shares: the found call, the split answer, tool schemas, call ids (pure, no I/O)."""

from __future__ import annotations

import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError

#: Tools as a request carries them: ``{"type": "function", "function": {"name", "parameters"}}``.
Tools = Sequence[dict[str, Any]] | None


@dataclass(frozen=True)
class FoundCall:
    """A tool call found in an answer's text.

    ``arguments`` is the parsed JSON object; ``id`` is the id the model
    wrote with the call (Mistral's ``[CALL_ID]``), None when its syntax has
    none (the gateway then makes one with the parser's ``new_call_id``).
    """

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class Reasoned:
    """An answer split into ``reasoning`` (None: none, or an empty block) and the ``content`` after it."""

    reasoning: str | None
    content: str


def tool_params(tools: Tools) -> dict[str, dict[str, Any]]:
    """Tool name -> its JSON-schema ``properties`` (empty when it declares none). Raises nothing."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        fn = t.get("function", {}) if isinstance(t, dict) else {}
        if not isinstance(fn, dict):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[str(fn.get("name", ""))] = props if isinstance(props, dict) else {}
    return out


def param_types(spec: Any) -> tuple[str, ...]:
    """The JSON types a parameter's schema allows (``("string",)``; empty when it says none)."""
    if not isinstance(spec, dict):
        return ()
    kind = spec.get("type")
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list):
        return tuple(str(k) for k in kind)
    return ()


def openai_call_id(prefix: str = "call_") -> str:
    """``call_`` (or ``prefix``) and 24 random hex digits: the id OpenAI-style templates accept."""
    return prefix + secrets.token_hex(12)


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine random letters and digits: the only tool-call id Mistral's templates accept."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def unknown(kind: str, name: str, choices: Sequence[str]) -> ConfigError:
    """The one-line error for an unknown ``--tool-parser`` / ``--reasoning-parser`` name."""
    return ConfigError(f"unknown {kind} {name!r}; choose one of {', '.join(sorted(choices))}")


__all__ = [
    "FoundCall",
    "Reasoned",
    "Tools",
    "mistral_call_id",
    "openai_call_id",
    "param_types",
    "tool_params",
    "unknown",
]
