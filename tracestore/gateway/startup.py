"""Start-up checks: what one probe finds is never found per request (DESIGN section 13).

Before the gateway listens:

* :func:`check_engines`: every engine that answers is asked what it reports
  about itself (:class:`~.engines.EngineInfo`); a vocabulary that cannot hold
  the tokenizer's ids ends the gateway with one line naming the engine, the
  tokenizer and what differs. An engine that does not answer yet is reported
  and left to the per-request errors (it may be starting).
* :func:`probe_template`: one probe conversation (a system message, a user
  message, an assistant tool call, its tool result) is rendered through the
  chat template, and the tool call parsed back. A template that cannot
  render a feature is served without it: :meth:`TemplateFeatures.check`
  answers a request that uses it with a 400 that names it. Tool-call ids are
  the tool parser's (``call_<hex>``; Mistral's: 9 letters and digits); a
  template that refuses them ends the gateway with one line naming the
  parser that makes what it accepts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .chat import ApiError, ChatRequest, Message, invalid
from .engines import Engine, EngineError
from .tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_add",
        "description": "add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def tokenizer_ids(tok: ChatTokenizer) -> int:
    """How many ids the tokenizer can produce (its largest id + 1)."""
    return int(getattr(tok, "vocab_size", 0) or 0)


async def check_engines(tok: ChatTokenizer, engines: list[Engine]) -> int | None:
    """Ask every engine what it reports; ConfigError (one line) when one cannot serve ``tok``'s ids.

    Returns the smallest context length the engines report (None: none does): the gateway clamps
    each request's ``max_tokens`` to what the context leaves.
    """
    need = tokenizer_ids(tok)
    contexts: list[int] = []
    for e in engines:
        try:
            info = await e.info()
        except EngineError as exc:
            log.warning("gateway: start-up check skipped for %s (%s); requests to it will fail until it answers", e.url, exc)
            continue
        if info.vocab_size is not None and need and need > info.vocab_size:
            raise ConfigError(
                f"engine {e.url} ({info.model or e.api}) has a vocabulary of {info.vocab_size} ids, but the "
                f"tokenizer {tok.name!r} makes ids up to {need - 1}: --tokenizer must be the engine's model's tokenizer"
            )
        if info.max_context is not None:
            contexts.append(info.max_context)
    return min(contexts) if contexts else None


@dataclass(frozen=True)
class TemplateFeatures:
    """What the chat template renders: ``system`` role, ``tools`` (definitions, calls, results).
    ``notes``: what the probe found."""

    system: bool = True
    tools: bool = True
    notes: tuple[str, ...] = field(default=())

    def check(self, req: ChatRequest) -> None:
        """A 400 naming the feature ``req`` uses that this template cannot render; else nothing."""
        if not self.system and any(m["role"] == "system" for m in req.messages):
            raise invalid(
                "this model's chat template has no system role: send the instructions in the first user message",
                "messages",
            )
        if not self.tools and (req.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in req.messages)):
            raise invalid("this model's chat template cannot render tools, tool calls or tool results", "tools")


def _probe(call_id: str) -> list[Message]:
    return [
        {"role": "user", "content": "what is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "probe_add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5", "tool_call_id": call_id},
    ]  # (ends at the tool result: Mistral's templates allow no user message right after one)


def _renders(tok: ChatTokenizer, messages: list[Message], tools: list[dict[str, Any]] | None) -> str | None:
    try:
        return tok.render(messages, tools, True)
    except ApiError:  # the template refused (raise_exception) or failed
        return None


def probe_template(tok: ChatTokenizer, prompt_mode: str = "tito") -> TemplateFeatures:
    """Render the probe conversation through ``tok``'s template; what it can render (see the module docstring).

    In ``template`` mode the conversation rendered with an answer must extend the prompt (that is
    how that mode records a turn); a template that does not (R1's generation prompt ends in
    ``<think>\n``, its rendered answers drop it) ends the gateway with one line.
    """
    notes: list[str] = []
    if prompt_mode == "template":
        user = [{"role": "user", "content": "hi"}]
        prompt = tok.render(user, None, True)
        after = tok.render([*user, {"role": "assistant", "content": "hello"}], None, False).rstrip()
        if not after.startswith(prompt):
            raise ConfigError(
                f"--prompt-mode template cannot record turns of {tok.name!r}: its template renders an answer "
                f"differently from what follows its generation prompt ({prompt[-24:]!r}); use --prompt-mode tito"
            )
    system = _renders(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], None) is not None
    if not system:
        notes.append("no system role")
    call_id = tok.new_call_id("call_")
    text = _renders(tok, _probe(call_id), [_PROBE_TOOL])
    if text is None:
        if _renders(tok, _probe(_MISTRAL_ID), [_PROBE_TOOL]) is not None:
            raise ConfigError(
                f"the chat template of {tok.name!r} refuses tool-call ids like {call_id!r} and takes 9 letters and "
                "digits: --tool-parser mistral makes those"
            )
        notes.append("cannot render tool calls and results")
        return TemplateFeatures(system=system, tools=False, notes=tuple(notes))
    if "probe_add" not in (_renders(tok, _probe(call_id)[:1], [_PROBE_TOOL]) or ""):
        notes.append("does not render the tools' definitions (the client must describe them)")
    _check_parser(tok, _probe(call_id)[:2], notes)
    return TemplateFeatures(system=system, tools=True, notes=tuple(notes))


_MISTRAL_ID = "aB3dE6gH9"


def _check_parser(tok: ChatTokenizer, turn: list[Message], notes: list[str]) -> None:
    """The tool parser must read back the tool call the template writes (else calls arrive as content)."""
    if getattr(tok, "tool_parser", "") == "none":
        return
    before = tok.render(turn[:1], [_PROBE_TOOL], True)
    after = tok.render(turn, [_PROBE_TOOL], False)
    written = after[len(before) :] if after.startswith(before) else after
    if tok.stop_word:  # the gateway cuts the end-of-turn marker before it parses an answer
        written = written.split(tok.stop_word)[0]
    if "probe_add" not in written:  # (DeepSeek V3's): nothing to check; tito mode does not need it
        notes.append("does not render an assistant's tool calls (a fork or template mode re-renders without them)")
        return
    _, calls = tok.parse_tool_calls(written, [_PROBE_TOOL])
    if [(c.name, c.arguments) for c in calls] != [("probe_add", {"a": 2, "b": 3})]:
        raise ConfigError(
            f"the tool parser {getattr(tok, 'tool_parser', '?')!r} does not read the tool calls the chat template of "
            f"{tok.name!r} writes ({written.strip()[:120]!r}): choose the model family's --tool-parser (docs/gateway.md)"
        )


__all__ = ["TemplateFeatures", "check_engines", "probe_template", "tokenizer_ids"]
