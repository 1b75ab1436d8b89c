"""The key of a conversation in a token-exact ("tito") trace: its canonical messages, not their rendering.

A session recorded token in, token out (the gateway's default ``--prompt-mode
tito``, DESIGN section 14) keys its trie by what the conversation *says*:
each message becomes one line of canonical JSON, and a path's key is the
concatenation of a header line (the tools and chat-template options) and
one line per message. A turn extends a stored path exactly when its
messages extend the stored ones; the token ids come from the store, never
from rendering the history again.

Canonical means: what a client may legitimately change when it echoes a
message back does not change the key.

* assistant messages: the content with surrounding white space stripped and
  the tool calls as ``[name, arguments]`` (arguments parsed from a JSON
  string, keys sorted); reasoning (``reasoning_content``, ``thinking``) and
  tool-call ids are left out, so a client that strips or keeps reasoning, or
  renames call ids, stays on its path;
* every other message: its role and content exactly (``developer`` is
  ``system``); a tool result's call id is left out.

Pure and dependency-free: a learner computes the key of the conversation
it trains on with :func:`conversation_key` to export its trace
(``store.export_training_trace(sid, conversation_key(messages, tools))``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from .errors import InvalidInput

_OPTS = orjson.OPT_SORT_KEYS
_LINE = _OPTS | orjson.OPT_APPEND_NEWLINE
#: Roles and the role their key uses.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            return raw  # kept as the string it is: a key, not a check
    return raw


def _content(raw: Any) -> str:
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):  # text parts / blocks
        return "".join(str(p.get("text", "")) for p in raw if isinstance(p, Mapping) and p.get("type") in ("text", "input_text", "output_text"))
    raise InvalidInput("messages", f"content must be a string or text parts, got {type(raw).__name__}")


def message_key(m: Mapping[str, Any]) -> str:
    """One message's line of the key (see the module docstring). InvalidInput on an unknown role."""
    role = _ROLES.get(str(m.get("role")))
    if role is None:
        raise InvalidInput("messages", f"unknown role {m.get('role')!r}")
    if role == "assistant":
        calls = []
        for c in m.get("tool_calls") or ():
            fn = c.get("function", c) if isinstance(c, Mapping) else {}
            calls.append([str(fn.get("name", "")), _arguments(fn.get("arguments"))])
        body: list[Any] = [role, _content(m.get("content")).strip(), calls]
    else:
        body = [role, _content(m.get("content"))]
    return orjson.dumps(body, option=_LINE).decode()  # the newline written by orjson: no copy of a long line


_NO_PARAMETERS = {"type": "object", "properties": {}}


def header_key(tools: Sequence[Mapping[str, Any]] | None = None, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The first line of a key: the tools (name, description, parameters) and the chat-template
    options; changing them forks at the root."""
    canon = []
    for t in tools or ():
        fn = t.get("function", t)
        params = fn.get("parameters", fn.get("input_schema")) or _NO_PARAMETERS
        canon.append([str(fn.get("name", "")), fn.get("description"), params])
    return orjson.dumps(["tito", canon, dict(template_kwargs or {})], option=_LINE).decode()


def key_parts(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
    """The header line and one line per message (their concatenation is :func:`conversation_key`)."""
    return [header_key(tools, template_kwargs), *(message_key(m) for m in messages)]


def conversation_key(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The trie key of a conversation recorded token-exact: export its trace with it.

    ``messages`` in OpenAI's shape (tool-call ``arguments`` as a JSON string
    or an object), ``tools`` the request's function tools as the gateway
    received them (OpenAI's ``{"type": "function", "function": {...}}``),
    ``template_kwargs`` its ``chat_template_kwargs``. Raises InvalidInput on
    a message the key cannot be made of. No I/O.
    """
    return "".join(key_parts(messages, tools, template_kwargs))


__all__ = ["conversation_key", "header_key", "key_parts", "message_key"]
