"""Reasoning and tool-call parsers (``tracestore/gateway/parsers``) against every family's real template.

Round trips: an assistant message (with reasoning where the family has it,
content, one and two tool calls) is rendered by the family's real template
(``tests/_families.py``); the text the model would have generated is what
the rendering adds after the generation prompt (for R1-style prompts that
end in ``<think>\\n``: the reasoning, ``</think>`` and the rest); the
family's suggested parsers must give back the same reasoning, content and
calls. Malformed calls leave the text as content.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

from tests._families import FAMILIES, FamilyDirs, family_dirs, load
from tests._scripted_engine import ROOT
from tracestore.errors import ConfigError
from tracestore.gateway.parsers import (
    REASONING_PARSERS,
    SUGGESTED,
    TOOL_PARSERS,
    reasoning_parser,
    tool_parser,
)

__all__ = ["family_dirs"]  # the session fixture, imported so pytest finds it

NAMES = list(FAMILIES)
WITH_CALLS = [n for n in NAMES if FAMILIES[n].renders_tool_calls]
REASONING = [n for n in NAMES if FAMILIES[n].reasoning != "none"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"}},
            },
        },
    },
]
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "code": "75"}),
    ("add", {"a": 1.5, "b": -2, "tags": ["x", "y z"], "opts": {"round": True, "to": None}}),
]
HISTORY = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris, and 1.5 - 2?"}]
REASON = "The user asks two things; I should call the tools."
CONTENT = "Let me look that up."


def _render(name: str, msgs: list[dict[str, Any]], gen: bool) -> str:
    f = FAMILIES[name]
    return str(load_for(name).apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=gen, tokenize=False, **f.template_kwargs))


_DIRS: dict[str, Any] = {}


def load_for(name: str) -> Any:
    return load(str(_DIRS[name]))


@pytest.fixture(autouse=True)
def _dirs(family_dirs: FamilyDirs) -> None:
    for n in NAMES:
        _DIRS.setdefault(n, family_dirs[n])


def _message(name: str, content: str | None, calls: int, reasoning: str | None) -> dict[str, Any]:
    f = FAMILIES[name]
    tp = tool_parser(f.tool_parser)
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = [
            {"id": tp.new_call_id(), "type": "function", "function": {"name": n, "arguments": json.dumps(a) if f.tool_args == "json" else a}}
            for n, a in CALLS[:calls]
        ]
        if m["content"] is None and name.startswith("deepseek"):
            m["content"] = ""  # DeepSeek's templates concatenate the content (transformers drops None keys)
    if reasoning is not None and f.reasoning == "rendered":
        m["reasoning_content"] = reasoning
    # R1's templates render no reasoning: the model wrote it after the prompt's <think> (see generated)
    return m


def generated(name: str, msg: dict[str, Any], reasoning: str | None) -> tuple[str, bool]:
    """The text the model generated for ``msg`` (its end-of-turn token cut), and whether the prompt opened reasoning."""
    f = FAMILIES[name]
    tok = load_for(name)
    base = _render(name, HISTORY, False)
    prompt = _render(name, HISTORY, True)
    full = _render(name, [*HISTORY, msg], False)
    assert full.startswith(base) and prompt.startswith(base)
    block, tail = full[len(base) :], prompt[len(base) :]
    rp = reasoning_parser(f.reasoning_parser)
    opened = rp.opens(prompt)
    if opened:  # R1-style: the prompt ends in <think>\n, the rendering drops the reasoning
        header = tail[: tail.rfind("<think>")]
        assert block.startswith(header), (block, header)
        text = f"{reasoning or ''}\n</think>\n\n" + block[len(header) :]
    else:
        assert block.startswith(tail), (block, tail)
        text = block[len(tail) :]
    text = text.rstrip("\n")
    for tid in (f.end_of_turn, *f.eos_ids):
        eos = tok.decode([tid], skip_special_tokens=False)
        text = text.removesuffix(eos)
    return text, opened


def parse(name: str, text: str, opened: bool) -> tuple[str | None, str, list[tuple[str, dict[str, Any]]]]:
    f = FAMILIES[name]
    r = reasoning_parser(f.reasoning_parser).split(text, opened=opened)
    content, calls = tool_parser(f.tool_parser).parse(r.content, TOOLS)
    return r.reasoning, content, [(c.name, c.arguments) for c in calls]


def _cases(name: str) -> list[tuple[str, str | None, int, str | None]]:
    """(case id, content, number of calls, reasoning) the family's template can render."""
    f = FAMILIES[name]
    reasons = [None, REASON] if f.reasoning != "none" else [None]
    out = []
    for r in reasons:
        tag = "+reasoning" if r else ""
        out.append((f"content{tag}", "The weather in Paris is sunny.", 0, r))
        if f.renders_tool_calls:
            out.append((f"one-call{tag}", CONTENT if f.calls_with_content else None, 1, r))
            if f.max_calls >= 2:
                out.append((f"two-calls{tag}", CONTENT if f.calls_with_content else None, 2, r))
                if f.calls_with_content:
                    out.append((f"two-calls-no-content{tag}", None, 2, r))
    return out


ROUND_TRIPS = [pytest.param(n, *c[1:], id=f"{n}-{c[0]}") for n in NAMES for c in _cases(n)]


@pytest.mark.parametrize(("name", "content", "calls", "reasoning"), ROUND_TRIPS)
def test_round_trip_through_the_real_template(name: str, content: str | None, calls: int, reasoning: str | None) -> None:
    msg = _message(name, content, calls, reasoning)
    text, opened = generated(name, msg, reasoning)
    got = parse(name, text, opened)
    assert got == (reasoning, content or "", CALLS[:calls]), text


@pytest.mark.parametrize("name", [n for n in WITH_CALLS if FAMILIES[n].tool_parser == "mistral"])
def test_mistral_calls_keep_the_ids_the_model_wrote(name: str) -> None:
    msg = _message(name, None, 2, None)
    text, _ = generated(name, msg, None)
    _, calls = tool_parser("mistral").parse(text, TOOLS)
    assert [c.id for c in calls] == [c["id"] for c in msg["tool_calls"]]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in msg["tool_calls"])


def _malformed(name: str) -> list[tuple[str, str]]:
    """(what, text): the one-call answer with its arguments broken, and with an unknown tool name."""
    f = FAMILIES[name]
    msg = _message(name, CONTENT if f.calls_with_content else None, 1, None)
    text, opened = generated(name, msg, None)
    content = reasoning_parser(f.reasoning_parser).split(text, opened=opened).content
    if f.tool_parser == "glm":
        broken = content.replace("<arg_value>3</arg_value>", "<arg_value>3 days</arg_value>")
    else:
        broken = re.sub(r'"days": 3([,}])', r'"days": 3,,\1', content, count=1)
    assert broken != content
    unknown = content.replace("get_weather", "get_wether")
    assert unknown != content
    return [("bad-json", broken), ("unknown-tool", unknown)]


@pytest.mark.parametrize("name", WITH_CALLS)
def test_malformed_calls_leave_the_text_as_content(name: str) -> None:
    tp = tool_parser(FAMILIES[name].tool_parser)
    for what, text in _malformed(name):
        assert tp.parse(text, TOOLS) == (text, []), what
        assert tp.parse(text, None) == (text, []), what  # no tools declared: no calls either


@pytest.mark.parametrize("name", [n for n in WITH_CALLS if FAMILIES[n].tool_parser != "llama3"])
def test_a_call_cut_by_max_tokens_is_content(name: str) -> None:
    tp = tool_parser(FAMILIES[name].tool_parser)
    text, opened = generated(name, _message(name, None, 1, None), None)
    content = reasoning_parser(FAMILIES[name].reasoning_parser).split(text, opened=opened).content
    cut = content[: len(content) - 4]
    assert tp.parse(cut, TOOLS) == (cut, [])


def test_llama3_template_renders_one_call_and_the_parser_reads_several() -> None:
    with pytest.raises(Exception, match="single tool-calls"):
        _render("llama3", [*HISTORY, _message("llama3", None, 2, None)], False)
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "arguments": {"a": 1, "b": 2}}'
    _, calls = tool_parser("llama3").parse(text, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    tagged = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'
    assert [c.name for c in tool_parser("llama3").parse(tagged, TOOLS)[1]] == ["add"]
    assert tool_parser("llama3").parse('{"answer": 42}', TOOLS) == ('{"answer": 42}', [])
    assert tool_parser("llama3").parse("The answer is {x}.", TOOLS) == ("The answer is {x}.", [])


def test_deepseek_reads_v31_calls_and_a_single_call_without_the_closing_token() -> None:
    tp = tool_parser("deepseek")
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert [(c.name, c.arguments) for c in tp.parse(v31, TOOLS)[1]] == [("get_weather", {"city": "Rome"}), ("add", {"a": 1})]
    single = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1}\n```<｜tool▁call▁end｜>'
    assert tp.parse(single, TOOLS)[1][0].arguments == {"a": 1}
    trailing = single + "<｜tool▁calls▁end｜> and more"
    assert tp.parse(trailing, TOOLS) == (trailing, [])


def test_glm_values_follow_the_tool_schema() -> None:
    tp = tool_parser("glm")
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>3</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>\"75\"</arg_value>\n</tool_call>"
    assert tp.parse(text, TOOLS)[1][0].arguments == {"city": "3", "days": 3, "code": '"75"'}
    undeclared = "<tool_call>add\n<arg_key>note</arg_key>\n<arg_value>two words</arg_value>\n<arg_key>n</arg_key>\n<arg_value>[1]</arg_value>\n</tool_call>"
    assert tp.parse(undeclared, TOOLS)[1][0].arguments == {"note": "two words", "n": [1]}
    left_open = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>"
    assert tp.parse(left_open, TOOLS) == (left_open, [])


def test_mistral_reads_the_args_only_and_json_list_forms() -> None:
    tp = tool_parser("mistral")
    v13 = '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    assert [(c.name, c.arguments, c.id) for c in tp.parse(v13, TOOLS)[1]] == [("add", {"a": 1}, None), ("get_weather", {"city": "Oslo"}, None)]
    old = 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}, "id": "Ab3dE6gH9"}]'
    content, calls = tp.parse(old, TOOLS)
    assert content == "Sure." and [(c.name, c.arguments, c.id) for c in calls] == [("add", {"a": 2}, "Ab3dE6gH9")]


@pytest.mark.parametrize("name", REASONING)
def test_reasoning_cut_by_max_tokens_is_all_reasoning(name: str) -> None:
    f = FAMILIES[name]
    rp = reasoning_parser(f.reasoning_parser)
    opened = rp.opens(_render(name, HISTORY, True))
    text = "I should think about the weather" if opened else "<think>\nI should think about the weather"
    assert rp.split(text, opened=opened) == type(rp.split(""))("I should think about the weather", "")


def test_a_prompt_that_closes_the_think_block_does_not_open_reasoning() -> None:
    rp = reasoning_parser("qwen3")
    prompt = str(load_for("qwen3").apply_chat_template(HISTORY, add_generation_prompt=True, tokenize=False, enable_thinking=False))
    assert prompt.endswith("<think>\n\n</think>\n\n") and not rp.opens(prompt)
    assert rp.split("The answer.", opened=rp.opens(prompt)).reasoning is None
    assert reasoning_parser("deepseek-r1").opens(_render("deepseek-r1-distill", HISTORY, True))
    assert reasoning_parser("none").split("<think>x</think>y").content == "<think>x</think>y"


def test_call_ids_have_the_shape_the_family_templates_accept() -> None:
    mistral = tool_parser("mistral").new_call_id()
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral)
    assert re.fullmatch(r"call_[0-9a-f]{24}", tool_parser("hermes").new_call_id())
    assert tool_parser("glm").new_call_id("toolu_").startswith("toolu_")
    assert tool_parser("mistral").new_call_id("toolu_") != mistral
    bad = _message("mistral", None, 1, None)
    bad["tool_calls"][0]["id"] = tool_parser("hermes").new_call_id()
    with pytest.raises(Exception, match="length 9"):
        _render("mistral", [*HISTORY, bad], False)


def test_registries_by_name_and_unknown_names() -> None:
    assert sorted(TOOL_PARSERS) == ["deepseek", "glm", "hermes", "llama3", "mistral", "none"]
    assert sorted(REASONING_PARSERS) == ["deepseek-r1", "none", "qwen3"]
    assert {n: (FAMILIES[n].tool_parser, FAMILIES[n].reasoning_parser) for n in NAMES} == SUGGESTED
    with pytest.raises(ConfigError, match="unknown tool parser 'json'; choose one of deepseek, glm"):
        tool_parser("json")
    with pytest.raises(ConfigError, match="unknown reasoning parser 'r1'"):
        reasoning_parser("r1")
    assert tool_parser("none").parse('<tool_call>{"name": "add", "arguments": {}}</tool_call>', TOOLS)[1] == []


def test_the_parsers_import_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['torch'] = None;"
        "from tracestore.gateway.parsers import tool_parser;"
        "print(tool_parser('hermes').parse('<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>',"
        " [{'function': {'name': 'f'}}])[1][0].name)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "f"


