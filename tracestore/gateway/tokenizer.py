"""Tokenisation for the gateway: chat template, token ids, tool-call parsing.

A :class:`ChatTokenizer` renders canonical messages (see :mod:`.chat`) to the
prompt text, encodes text to ids, decodes ids back, and finds tool calls in an
answer. Two implementations:

* :class:`HFTokenizer`: a Hugging Face tokenizer directory, loaded with
  ``transformers.AutoTokenizer.from_pretrained(path)``; the template is the
  tokenizer's ``chat_template`` (``apply_chat_template``), tool calls are
  parsed in the Hermes/Qwen form ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` (``tool_parser="hermes"``, the default) or not at all
  (``"none"``). Stop ids: the tokenizer's EOS id plus the ``eos_token_id``
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

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from ..trainer import tool_syntax
from .chat import Message, invalid

ParsedCall = tool_syntax.ParsedCall


class ChatTokenizer(Protocol):
    """What the gateway needs of a tokenizer (see the module docstring)."""

    #: Model name served by default (``/v1/models``).
    name: str
    #: Ids that end an answer (sent to the engine as ``stop_token_ids``).
    stop_token_ids: tuple[int, ...]
    #: Text of the end-of-turn marker (cut from the content if the model spells it out).
    stop_word: str | None

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
    ) -> tuple[str, list[ParsedCall]]:  # pragma: no cover - protocol
        """``(content, calls)`` of an answer; no calls when none parse."""
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

    def parse_tool_calls(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ParsedCall]]:
        """Lines ``name v1 v2 ...`` naming a tool with exactly that many typed values are calls."""
        return tool_syntax.parse_calls(text, tools)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ParsedCall]]:
    """Hermes/Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    Content is the text before the first call, stripped. When any block is
    not a JSON object with a known tool ``name`` and object ``arguments``,
    the whole answer is content (no calls).
    """
    blocks = _HERMES.findall(text)
    if not blocks:
        return text, []
    names = set(tool_syntax.tool_params(tools))
    calls: list[ParsedCall] = []
    for b in blocks:
        try:
            obj = orjson.loads(b.strip())
        except orjson.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append((obj["name"], args))
    return text[: text.find("<tool_call>")].strip(), calls


class HFTokenizer:
    """A Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained``) and its chat template.

    Raises ConfigError (``tracestore.errors``) when the directory cannot be
    loaded or has no chat template, or ``tool_parser`` is unknown.
    """

    def __init__(self, path: str, tool_parser: str = "hermes") -> None:
        from ..errors import ConfigError

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
        parsers: dict[str, Callable[[str, list[dict[str, Any]]], tuple[str, list[ParsedCall]]]] = {
            "hermes": parse_hermes,
            "none": lambda text, tools: (text, []),
        }
        if tool_parser not in parsers:
            raise ConfigError(f"unknown tool parser {tool_parser!r}; choose one of {sorted(parsers)}")
        self._parse = parsers[tool_parser]
        self.tool_parser = tool_parser
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
        """``apply_chat_template(messages, tools=..., tokenize=False, **template_kwargs)``; a template error is a 400."""
        try:
            out = self._tok.apply_chat_template(
                list(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 TemplateError and the template's own raise_exception
            raise invalid(f"the chat template refused the messages: {exc}", "messages") from None
        return str(out)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without added special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def parse_tool_calls(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ParsedCall]]:
        """Tool calls by the configured parser (``hermes`` or ``none``)."""
        return self._parse(text, tools)


def load_tokenizer(spec: str, tool_parser: str = "hermes") -> ChatTokenizer:
    """``builtin`` or a Hugging Face tokenizer directory. Raises ConfigError."""
    if spec == "builtin":
        return BuiltinTokenizer()
    return HFTokenizer(spec, tool_parser)


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
    "parse_hermes",
]
