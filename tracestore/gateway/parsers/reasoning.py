"""Reasoning parsers (``--reasoning-parser none|qwen3|deepseek-r1``): reasoning apart from content.

Both real parsers read ``<think>...</think>`` blocks, as the families'
templates render them (Qwen3: ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``;
GLM-4.5: ``\\n<think>{reasoning}</think>\\n{content}``; DeepSeek R1 and
Qwen3-Thinking-2507: the *generation prompt* ends in ``<think>\\n``, so the
answer holds only ``{reasoning}</think>\\n\\n{content}``). ``split(text,
opened=...)`` takes whether the prompt left the model inside a block;
``opens(prompt)`` tells it from the prompt's text. An end tag with no start
tag before it also means the prompt opened the block (a caller that did not
say). An answer cut inside its reasoning (``max_tokens``) is all reasoning,
no content.

``qwen3`` and ``deepseek-r1`` read the same syntax; both names exist so a
family's entry reads as its engine's flag does (vLLM, SGLang).
"""

from __future__ import annotations

from typing import ClassVar

from .base import Reasoned, unknown


class ReasoningParser:
    """No reasoning syntax (``none``): every answer is content. The base of the real parsers."""

    name: ClassVar[str] = "none"
    #: The tags that open and close a reasoning block (None: the family has none).
    start: ClassVar[str | None] = None
    end: ClassVar[str | None] = None

    def opens(self, prompt: str) -> bool:
        """Whether ``prompt`` (the rendered generation prompt) leaves the model inside a reasoning block."""
        if self.start is None or self.end is None:
            return False
        i = prompt.rfind(self.start)
        return i >= 0 and prompt.find(self.end, i) < 0

    def split(self, text: str, *, opened: bool = False) -> Reasoned:
        """``text`` as reasoning and content (see the module docstring). Raises nothing.

        ``opened``: the generation prompt already opened the block (see
        :meth:`opens`). Reasoning is stripped of surrounding whitespace (None
        when there is none, or the block is empty); the content loses the
        newlines the templates put after the end tag.
        """
        if self.start is None or self.end is None:
            return Reasoned(None, text)
        body = text
        lead = text.lstrip()
        if lead.startswith(self.start):
            body = lead[len(self.start) :]
        elif not opened and self.end not in text:
            return Reasoned(None, text)
        i = body.find(self.end)
        if i < 0:
            return Reasoned(body.strip() or None, "")
        return Reasoned(body[:i].strip() or None, body[i + len(self.end) :].lstrip("\n"))


class ThinkTags(ReasoningParser):
    """``<think>...</think>`` (Qwen3's syntax)."""

    name: ClassVar[str] = "qwen3"
    start: ClassVar[str | None] = "<think>"
    end: ClassVar[str | None] = "</think>"


class DeepSeekR1(ThinkTags):
    """DeepSeek R1's: the same tags, the prompt usually opening the block."""

    name: ClassVar[str] = "deepseek-r1"


#: ``--reasoning-parser`` name -> parser class.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {c.name: c for c in (ReasoningParser, ThinkTags, DeepSeekR1)}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser named ``name``; ConfigError naming the choices when there is none."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise unknown("reasoning parser", name, list(REASONING_PARSERS))
    return cls()


__all__ = ["REASONING_PARSERS", "DeepSeekR1", "ReasoningParser", "ThinkTags", "reasoning_parser"]
