"""Reasoning and tool-call parsers of model answers, one per family syntax (DESIGN section 14).

Pure Python, no I/O, no transformers: text in, parts out.

* :func:`reasoning_parser` (``--reasoning-parser none|qwen3|deepseek-r1``)
  splits an answer into reasoning and content (:class:`Reasoned`);
  ``opens(prompt)`` tells whether a generation prompt already opened the
  reasoning block (DeepSeek R1's ``<think>\\n``), ``split(text, opened=...)``
  splits. See :mod:`.reasoning`.
* :func:`tool_parser` (``--tool-parser hermes|llama3|deepseek|glm|mistral|none``)
  finds tool calls (:class:`FoundCall`: name, arguments, the model's own id
  when its syntax has one) and the content around them; ``new_call_id()``
  makes an id in the shape the family's template accepts. See :mod:`.tools`.

Run the reasoning parser first, the tool parser on its content. Registries
by name: :data:`REASONING_PARSERS`, :data:`TOOL_PARSERS` (adding a syntax is
one class and one entry).

What to set per model family (:data:`SUGGESTED`; each row is tested with the
family's real template in ``tests/test_parsers.py``):

=======================================  ================  =====================  ====================
family                                   ``--tool-parser``  ``--reasoning-parser``  tool-call ids
=======================================  ================  =====================  ====================
Qwen2.5 Instruct                         ``hermes``        ``none``               ``call_<hex>``
Qwen3 (thinking: Qwen3-0.6B ... 235B)    ``hermes``        ``qwen3``              ``call_<hex>``
Qwen3 Instruct-2507                      ``hermes``        ``none``               ``call_<hex>``
Llama 3.1 / 3.2 / 3.3 Instruct           ``llama3``        ``none``               ``call_<hex>``
DeepSeek V3                              ``deepseek``      ``none``               ``call_<hex>``
DeepSeek R1, R1-Distill                  ``deepseek``      ``deepseek-r1``        ``call_<hex>``
GLM-4.5 / GLM-4.6                        ``glm``           ``qwen3``              ``call_<hex>``
Mistral Small 3.2                        ``mistral``       ``none``               9 letters and digits
=======================================  ================  =====================  ====================
"""

from __future__ import annotations

from .base import FoundCall, Reasoned, Tools, mistral_call_id, openai_call_id
from .reasoning import REASONING_PARSERS, ReasoningParser, reasoning_parser
from .tools import TOOL_PARSERS, ToolParse, ToolParser, tool_parser

#: Model family -> (``--tool-parser``, ``--reasoning-parser``), as the table above.
SUGGESTED: dict[str, tuple[str, str]] = {
    "qwen2.5": ("hermes", "none"),
    "qwen3": ("hermes", "qwen3"),
    "qwen3-instruct": ("hermes", "none"),
    "llama3": ("llama3", "none"),
    "deepseek-v3": ("deepseek", "none"),
    "deepseek-r1": ("deepseek", "deepseek-r1"),
    "deepseek-r1-distill": ("deepseek", "deepseek-r1"),
    "glm-4.5": ("glm", "qwen3"),
    "mistral": ("mistral", "none"),
}

__all__ = [
    "REASONING_PARSERS",
    "SUGGESTED",
    "TOOL_PARSERS",
    "FoundCall",
    "Reasoned",
    "ReasoningParser",
    "ToolParse",
    "ToolParser",
    "Tools",
    "mistral_call_id",
    "openai_call_id",
    "reasoning_parser",
    "tool_parser",
]
