"""Tokenisation for the gateway: chat template, token ids, tool-call parsing.

A :class:`ChatTokenizer` renders canonical messages (see :mod:`.chat`) to the
prompt text, encodes text to ids, decodes ids back, and finds tool calls in an
answer. Two implementations:

* :class:`HFTokenizer`: a Hugging Face tokenizer directory, loaded with
  ``transformers.AutoTokenizer.from_pretrained(path)``; the template is the
  tokenizer's ``chat_template`` (``apply_chat_template``), tool calls and
  reasoning are parsed by the family's syntax (``--tool-parser``,
  ``--reasoning-parser``, :mod:`.parsers`). Stop ids: the tokenizer's EOS id plus the ``eos_token_id``
  list of a ``generation_config.json`` beside it.
* :class:`BuiltinTokenizer`: the reference policy's toy tokenizer and
  ChatML-like template (``trainer/tokenizer.py``, ``trainer/chat.py``). Its
  tool-call syntax is compact, made for a tiny model: one call per line, the
  tool's name then its arguments' values in the order of the tool's
  parameters, separated by spaces (``add 3``); tool definitions are not
  rendered into the prompt (the reference policy is trained on its tools).

:func:`load_tokenizer` picks one from the ``--tokenizer`` option.
:class:`Detokenizer` turns a growing list of ids into text deltas for streaming.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from ..errors import ConfigError
from ..trainer import tool_syntax
from . import parsers
from .chat import Message, invalid
from .parsers import FoundCall, ReasoningParser


class ChatTokenizer(Protocol):
    """What the gateway needs of a tokenizer (see the module docstring)."""

    #: Model name served by default (``/v1/models``).
    name: str
    #: Ids that end an answer (sent to the engine as ``stop_token_ids``).
    stop_token_ids: tuple[int, ...]
    #: Text of the end-of-turn marker (cut from the content if the model spells it out).
    stop_word: str | None
    #: How reasoning is told apart from content in an answer (``--reasoning-parser``).
    reasoning: ReasoningParser

    def render(
        self,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:  # pragma: no cover - protocol
        """The chat template over ``messages`` (and ``tools``; ``template_kwargs`` reach the
        template, e.g. ``enable_thinking``)."""
        ...

    def encode(self, text: str) -> list[int]:  # pragma: no cover - protocol
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:  # pragma: no cover - protocol
        """Text of ``ids`` (special tokens kept)."""
        ...

    def parse_tool_calls(
        self, text: str, tools: list[dict[str, Any]]
    ) -> tuple[str, list[FoundCall]]:  # pragma: no cover - protocol
        """``(content, calls)`` of an answer; no calls when none parse."""
        ...

    def new_call_id(self, prefix: str) -> str:  # pragma: no cover - protocol
        """A tool-call id the template accepts (``prefix``: ``call_`` or ``toolu_``)."""
        ...


class BuiltinTokenizer:
    """The reference policy's tokenizer and template, with a compact tool-call syntax.

    Messages without tool calls render exactly as ``trainer.chat.render``;
    an assistant message with tool calls renders its content (if any) then
    one line per call (``name value ...``); ``tool`` messages render as
    their own role. Raises nothing at construction.
    """

    name = "tracestore-reference"
    tool_parser = "builtin"
    reasoning = parsers.reasoning_parser("none")

    def __init__(self) -> None:
        from ..trainer import chat
        from ..trainer.tokenizer import TOKENIZER

        self._tok = TOKENIZER
        self._render = chat.render
        self.stop_token_ids: tuple[int, ...] = (TOKENIZER.stop_id,)
        self.stop_word: str | None = chat.STOP_WORD
        self.vocab_size = TOKENIZER.vocab_size

    def render(
        self,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """ChatML-like rendering (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message; no options)."""
        params = tool_syntax.tool_params(tools)
        plain: list[dict[str, str]] = []
        for m in messages:
            content = m.get("content") or ""
            calls = m.get("tool_calls")
            if calls:
                lines = [content] if content else []
                lines += [tool_syntax.call_line(c, params) for c in calls]
                content = "\n".join(lines)
            plain.append({"role": m["role"], "content": content})
        return self._render(plain, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Greedy longest-match ids (byte fallback): every string encodes."""
        return self._tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; raises ValueError for an id outside the vocabulary."""
        return self._tok.decode(ids)

    def parse_tool_calls(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[FoundCall]]:
        """Lines ``name v1 v2 ...`` naming a tool with exactly that many typed values are calls."""
        content, calls = tool_syntax.parse_calls(text, tools)
        return content, [FoundCall(n, a) for n, a in calls]

    def new_call_id(self, prefix: str) -> str:
        """``<prefix><hex>`` (the builtin template renders no ids)."""
        return parsers.openai_call_id(prefix)


class HFTokenizer:
    """A Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained``) and its chat template.

    Raises ConfigError (``tracestore.errors``) when the directory cannot be
    loaded or has no chat template, or ``tool_parser`` is unknown.
    """

    def __init__(self, path: str, tool_parser: str = "hermes", reasoning_parser: str = "none") -> None:

        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(f"a Hugging Face tokenizer needs the extra tracestore[gateway]: {exc}") from None
        if not Path(path).is_dir():
            raise ConfigError(f"--tokenizer {path!r}: not a directory (give a tokenizer directory or 'builtin')")
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # transformers raises many kinds (OSError, ValueError, ...)
            raise ConfigError(f"--tokenizer {path!r}: cannot load it: {type(exc).__name__}: {exc}") from None
        if not getattr(self._tok, "chat_template", None):
            raise ConfigError(f"--tokenizer {path!r}: it has no chat_template")
        self._parser = parsers.tool_parser(tool_parser)  # ConfigError naming the choices
        self.reasoning = parsers.reasoning_parser(reasoning_parser)
        self.tool_parser = tool_parser
        self._args_json = False  # the template wants tool-call arguments as a JSON string (DeepSeek)
        self.name = Path(path).resolve().name
        stops = [self._tok.eos_token_id] if self._tok.eos_token_id is not None else []
        gen_cfg = Path(path) / "generation_config.json"
        if gen_cfg.is_file():
            eos = orjson.loads(gen_cfg.read_bytes()).get("eos_token_id")
            stops += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        if not stops:
            raise ConfigError(f"--tokenizer {path!r}: no eos_token_id (the answer's stop token)")
        self.stop_token_ids = tuple(dict.fromkeys(int(x) for x in stops))
        self.stop_word = self._tok.eos_token if isinstance(self._tok.eos_token, str) else None
        self.vocab_size = len(self._tok)

    def render(
        self,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """``apply_chat_template(messages, tools=..., tokenize=False, **template_kwargs)``; a template error is a 400.

        Tool-call arguments go to the template as the objects canonical messages hold; a template
        that fails on them and renders them as JSON strings (DeepSeek's) gets strings from then on.
        """
        msgs = _json_arguments(messages) if self._args_json else list(messages)
        try:
            return self._apply(msgs, tools, add_generation_prompt, template_kwargs)
        except Exception as exc:  # jinja2 TemplateError and the template's own raise_exception
            if not self._args_json and any(m.get("tool_calls") for m in messages):
                try:
                    out = self._apply(_json_arguments(messages), tools, add_generation_prompt, template_kwargs)
                except Exception:
                    pass
                else:
                    self._args_json = True
                    return out
            raise invalid(f"the chat template refused the messages: {exc}", "messages") from None

    def _apply(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, gen: bool, kwargs: Mapping[str, Any] | None
    ) -> str:
        return str(
            self._tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=gen, tokenize=False, **dict(kwargs or {})
            )
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without added special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def parse_tool_calls(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[FoundCall]]:
        """Tool calls by the configured ``--tool-parser`` (:mod:`.parsers`)."""
        return self._parser.parse(text, tools)

    def new_call_id(self, prefix: str) -> str:
        """A tool-call id in the shape the family's template accepts (the tool parser's)."""
        return self._parser.new_call_id(prefix)


def _json_arguments(messages: Sequence[Message]) -> list[Message]:
    """``messages`` with every tool call's arguments as a JSON string."""
    out: list[Message] = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": orjson.dumps(c["function"]["arguments"]).decode()}}
                    if not isinstance(c["function"].get("arguments"), str)
                    else c
                    for c in calls
                ],
            }
        out.append(m)
    return out


def load_tokenizer(spec: str, tool_parser: str = "hermes", reasoning_parser: str = "none") -> ChatTokenizer:
    """``builtin`` or a Hugging Face tokenizer directory. Raises ConfigError."""
    if spec == "builtin":
        return BuiltinTokenizer()
    return HFTokenizer(spec, tool_parser, reasoning_parser)


class Detokenizer:
    """Text deltas of a growing list of ids (incremental, like vLLM's detokenizer).

    Decodes a short window of ids per step, not the whole answer, and holds
    back a delta that ends in an incomplete UTF-8 sequence (U+FFFD) until the
    next ids complete it.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids``; return the text they complete (possibly empty)."""
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""


__all__ = [
    "BuiltinTokenizer",
    "ChatTokenizer",
    "Detokenizer",
    "HFTokenizer",
    "load_tokenizer",
]
