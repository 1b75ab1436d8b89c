"""Tool-call parsers (``--tool-parser hermes|llama3|deepseek|glm|mistral|none``).

Each reads one family's syntax, as its real chat template renders an
assistant's tool calls, and returns ``(content, calls)``:

* ``hermes`` (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks; the behaviour of ``tokenizer.parse_hermes`` (content is the text
  before the first block, stripped; text between and after blocks is dropped).
* ``llama3`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}``
  (``arguments`` accepted too), optionally after ``<|python_tag|>``; several
  calls separated by ``;`` as vLLM's ``llama3_json`` reads them. Llama's
  template renders one call and no content beside it.
* ``deepseek`` (DeepSeek V3, R1, R1-Distill): ``<｜tool▁calls▁begin｜>`` then calls
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\\n```json\\n{args}\\n```<｜tool▁call▁end｜>``
  separated by newlines, then ``<｜tool▁calls▁end｜>`` (which R1-Distill's
  template omits after a single call); V3.1's ``{name}<｜tool▁sep｜>{args}`` calls too.
* ``glm`` (GLM-4.5, 4.6): ``<tool_call>{name}\\n<arg_key>{k}</arg_key>\\n<arg_value>{v}</arg_value>\\n...</tool_call>``;
  a value is raw text when the tool's schema says the parameter is a string,
  else JSON (the template writes strings raw and everything else as JSON).
* ``mistral`` (Mistral Small 3.2): ``[TOOL_CALLS]{name}[CALL_ID]{id}[ARGS]{json}`` per call
  (``[TOOL_CALLS]{name}[ARGS]{json}`` of later versions, and the older
  ``[TOOL_CALLS][{"name", "arguments", "id"}, ...]`` too). Ids are nine letters
  and digits (:meth:`MistralCalls.new_call_id`).
* ``none``: no calls.

A call is found only for a tool the request declares. Anything malformed
(JSON that does not parse, an unknown tool name, arguments that are not an
object, a call left open, text after the calls) leaves the whole answer as
content with no calls, as ``hermes`` always did: the client sees what the
model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import orjson

from .base import (
    FoundCall,
    Tools,
    mistral_call_id,
    openai_call_id,
    param_types,
    tool_params,
    unknown,
)

#: ``(content, calls)``: what a tool parser returns.
ToolParse = tuple[str, list[FoundCall]]


class Malformed(Exception):
    """Internal: the answer's calls do not parse (the answer is content)."""


def _object(raw: Any) -> dict[str, Any]:
    """``raw`` as a JSON object: a dict as it is, a string parsed; Malformed otherwise."""
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise Malformed from None
    if not isinstance(raw, dict):
        raise Malformed
    return raw


def _known(name: Any, tools: Tools) -> str:
    if not isinstance(name, str) or name not in tool_params(tools):
        raise Malformed
    return name


class ToolParser:
    """No tool-call syntax (``none``): every answer is content. The base of the real parsers."""

    name: ClassVar[str] = "none"
    #: Texts that open a call; a streaming gateway holds content back from the first one on.
    markers: ClassVar[tuple[str, ...]] = ()

    def parse(self, text: str, tools: Tools) -> ToolParse:
        """``(content, calls)`` of an answer; ``(text, [])`` when it has no well-formed calls. Raises nothing."""
        if not tools or not any(m in text for m in self.markers):
            return text, []
        try:
            return self._parse(text, tools)
        except Malformed:
            return text, []

    def _parse(self, text: str, tools: Tools) -> ToolParse:
        return text, []

    def new_call_id(self, prefix: str = "call_") -> str:
        """A new tool-call id in the shape this family's template accepts (``call_<hex>``)."""
        return openai_call_id(prefix)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesCalls(ToolParser):
    """Hermes / Qwen ``<tool_call>{json}</tool_call>`` (what ``tokenizer.parse_hermes`` does)."""

    name: ClassVar[str] = "hermes"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)

    def parse(self, text: str, tools: Tools) -> ToolParse:
        """As :meth:`ToolParser.parse`; a tool list without names makes no call match."""
        blocks = _HERMES.findall(text)
        if not blocks:
            return text, []
        try:
            calls = []
            for b in blocks:
                try:
                    obj = orjson.loads(b.strip())
                except orjson.JSONDecodeError:
                    raise Malformed from None
                if not isinstance(obj, dict):
                    raise Malformed
                name = _known(obj.get("name"), tools)
                calls.append(FoundCall(name, _object(obj.get("arguments", obj.get("parameters", {})))))
        except Malformed:
            return text, []
        return text[: text.find("<tool_call>")].strip(), calls


_DECODER = json.JSONDecoder()


class Llama3Json(ToolParser):
    """Llama 3's JSON calls: the answer is ``{"name", "parameters"}`` objects (``;``-separated)."""

    name: ClassVar[str] = "llama3"
    markers: ClassVar[tuple[str, ...]] = ("{", "<|python_tag|>")

    def _parse(self, text: str, tools: Tools) -> ToolParse:
        body = text.strip()
        body = body.removeprefix("<|python_tag|>").lstrip()
        if not body.startswith("{"):
            return text, []
        calls: list[FoundCall] = []
        i = 0
        while True:
            try:
                obj, i = _DECODER.raw_decode(body, i)
            except json.JSONDecodeError:
                raise Malformed from None
            if not isinstance(obj, dict):
                raise Malformed
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(FoundCall(_known(obj.get("name"), tools), _object(args)))
            rest = body[i:].lstrip()
            if not rest:
                return "", calls
            if not rest.startswith(";"):
                raise Malformed
            i = len(body) - len(rest) + 1
            while i < len(body) and body[i].isspace():
                i += 1


DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
_DS_FENCED = re.compile(r"(?P<name>[^\n]*)\n```(?:json)?\n(?P<args>.*)\n```", re.DOTALL)


class DeepSeekCalls(ToolParser):
    """DeepSeek's ``<｜tool▁calls▁begin｜>`` calls (V3/R1 fenced JSON; V3.1 bare JSON)."""

    name: ClassVar[str] = "deepseek"
    markers: ClassVar[tuple[str, ...]] = (DS_CALLS_BEGIN,)

    def _parse(self, text: str, tools: Tools) -> ToolParse:
        start = text.find(DS_CALLS_BEGIN)
        body = text[start + len(DS_CALLS_BEGIN) :]
        calls: list[FoundCall] = []
        while True:
            body = body.lstrip()
            if not body.startswith(DS_CALL_BEGIN):
                break
            end = body.find(DS_CALL_END)
            if end < 0:
                raise Malformed  # a call left open (cut by max_tokens)
            head, sep, tail = body[len(DS_CALL_BEGIN) : end].partition(DS_SEP)
            if not sep:
                raise Malformed
            fenced = _DS_FENCED.fullmatch(tail)
            if fenced:  # V3 / R1: type, then name and fenced arguments
                name, args = fenced["name"].strip(), fenced["args"]
            else:  # V3.1: name, then the arguments as they are
                name, args = head.strip(), tail
            calls.append(FoundCall(_known(name, tools), _object(args.strip())))
            body = body[end + len(DS_CALL_END) :]
        if not calls:
            raise Malformed
        body = body.removeprefix(DS_CALLS_END)
        if body.strip():
            raise Malformed
        return text[:start].strip(), calls


_GLM_CALL = re.compile(r"<tool_call>(?P<body>.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)


def _glm_value(raw: str, spec: Any) -> Any:
    """An ``<arg_value>``: raw text for a string parameter, else JSON (raw text when it is not JSON)."""
    types = param_types(spec)
    if types == ("string",):
        return raw
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        if types and "string" not in types:
            raise Malformed from None
        return raw
    if isinstance(value, str) and "string" in types:
        return raw  # a string the template wrote raw that happens to be quoted JSON text
    return value


class GlmCalls(ToolParser):
    """GLM-4.5's ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``."""

    name: ClassVar[str] = "glm"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)

    def _parse(self, text: str, tools: Tools) -> ToolParse:
        start = text.find("<tool_call>")
        params = tool_params(tools)
        calls: list[FoundCall] = []
        pos = start
        for m in _GLM_CALL.finditer(text, start):
            if text[pos : m.start()].strip():
                raise Malformed
            body = m["body"]
            cut = body.find("<arg_key>")
            name = _known((body if cut < 0 else body[:cut]).strip(), tools)
            args: dict[str, Any] = {}
            rest = body[len(body) if cut < 0 else cut :]
            for a in _GLM_ARG.finditer(rest):
                key = a["key"].strip()
                args[key] = _glm_value(a["value"], params[name].get(key))
            if _GLM_ARG.sub("", rest).strip():
                raise Malformed
            calls.append(FoundCall(name, args))
            pos = m.end()
        if not calls or text[pos:].strip():
            raise Malformed  # no closed call, or text (a call left open) after the calls
        return text[:start].strip(), calls


MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"


class MistralCalls(ToolParser):
    """Mistral's ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{json}`` (and the ``[ARGS]``-only and JSON-list forms)."""

    name: ClassVar[str] = "mistral"
    markers: ClassVar[tuple[str, ...]] = (MISTRAL_CALLS,)

    def _parse(self, text: str, tools: Tools) -> ToolParse:
        start = text.find(MISTRAL_CALLS)
        calls: list[FoundCall] = []
        for part in text[start + len(MISTRAL_CALLS) :].split(MISTRAL_CALLS):
            part = part.strip()
            if part.startswith(("[", "{")):  # v3/v7: a JSON list of {"name", "arguments", "id"}
                try:
                    items = orjson.loads(part)
                except orjson.JSONDecodeError:
                    raise Malformed from None
                for item in items if isinstance(items, list) else [items]:
                    if not isinstance(item, dict):
                        raise Malformed
                    cid = item.get("id")
                    calls.append(FoundCall(_known(item.get("name"), tools), _object(item.get("arguments", {})), cid if isinstance(cid, str) else None))
                continue
            head, sep, raw = part.partition(MISTRAL_ARGS)
            if not sep:
                raise Malformed
            name, has_id, cid = head.partition(MISTRAL_CALL_ID)
            try:
                args, end = _DECODER.raw_decode(raw.strip())
            except json.JSONDecodeError:
                raise Malformed from None
            if raw.strip()[end:].strip():
                raise Malformed
            calls.append(FoundCall(_known(name.strip(), tools), _object(args), cid.strip() if has_id else None))
        return text[:start].strip(), calls

    def new_call_id(self, prefix: str = "call_") -> str:
        """Nine letters and digits (``prefix`` is ignored: Mistral's templates refuse any other id)."""
        return mistral_call_id()


#: ``--tool-parser`` name -> parser class.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    c.name: c for c in (HermesCalls, Llama3Json, DeepSeekCalls, GlmCalls, MistralCalls, ToolParser)
}


def tool_parser(name: str) -> ToolParser:
    """The parser named ``name``; ConfigError naming the choices when there is none."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise unknown("tool parser", name, list(TOOL_PARSERS))
    return cls()


__all__ = [
    "TOOL_PARSERS",
    "DeepSeekCalls",
    "GlmCalls",
    "HermesCalls",
    "Llama3Json",
    "MistralCalls",
    "ToolParse",
    "ToolParser",
    "tool_parser",
]
