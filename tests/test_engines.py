"""The engine adapters (``tracestore/gateway/engines/``) against a real ``tracestore engine`` process.

Every test runs once per adapter, ``sglang`` and ``vllm``, against the
reference policy served in that shape (``tracestore engine --api X``), with
the same assertions: what the contract promises does not depend on the
engine behind it. The engine is warm-started on the calculator format, so
that a greedy answer ends with the end-of-turn id (the EOS). Waits are on
observable state (a chunk received, an engine counter), never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import openai
import pytest

from tests._gateway import CliServer
from tracestore.gateway.engines import (
    Engine,
    EngineLost,
    EngineOutput,
    EngineRefused,
    EngineRejected,
    EngineRequest,
    Sampling,
    engine_class,
)
from tracestore.trainer.chat import render
from tracestore.trainer.tokenizer import TOKENIZER

T = TypeVar("T")

APIS = ("sglang", "vllm")
MAX_LEN = 2048
MODEL = "tracestore-reference-moe"
#: What each engine reports that the other does not (vLLM: no vocabulary size, no weight version).
VOCAB = {"sglang": TOKENIZER.vocab_size, "vllm": None}
VERSION = {"sglang": "0", "vllm": None}
PROMPT = TOKENIZER.encode(
    render(
        [{"role": "system", "content": "use add sub mul with one digit then done"}, {"role": "user", "content": "reach 3 from 1"}],
        add_generation_prompt=True,
    )
)
EOS = TOKENIZER.stop_id


@dataclass
class Served:
    """A running engine process and the adapter name it speaks."""

    api: str
    server: CliServer

    @property
    def url(self) -> str:
        return self.server.url


def _start(api: str) -> CliServer:
    return CliServer("engine", "--api", api, "--port", "0", "--max-len", str(MAX_LEN), "--warmup-steps", "40", "--seed", "0").start()


@pytest.fixture(scope="module", params=APIS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    e = _start(request.param)
    yield Served(request.param, e)
    e.stop()


def drive(api: str, url: str, fn: Callable[[Engine, aiohttp.ClientSession], Awaitable[T]], timeout_s: float = 120) -> T:
    """Run ``fn(adapter, session)`` on a fresh event loop with an adapter of ``api`` at ``url``."""

    async def main() -> T:
        async with aiohttp.ClientSession() as session:
            return await fn(engine_class(api)(url, session, aiohttp.ClientTimeout(total=timeout_s)), session)

    return asyncio.run(main())


def req(rid: str, max_tokens: int, *, prompt: list[int] = PROMPT, **sampling: Any) -> EngineRequest:
    return EngineRequest(rid, prompt, Sampling(max_tokens=max_tokens, **sampling))


async def counters(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The reference engine's own counters (``GET /get_model_info``, both shapes)."""
    async with session.get(url + "/get_model_info") as resp:
        out: dict[str, Any] = await resp.json()
        return out


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60) -> None:
    """Poll ``check`` until it holds (fails the test after ``timeout_s``)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not await check():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def fold(chunks: AsyncIterator[Any]) -> tuple[EngineOutput, int]:
    """A stream folded, and how many chunks it had (only the last may have a finish)."""
    out, n = EngineOutput(), 0
    async for c in chunks:
        assert out.finish is None, "a chunk after the finish"
        out.add(c)
        n += 1
    return out, n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- generation ---------------------------------------------------------------------------------


def test_generate_and_stream_give_the_same_answer(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        sampling = {"temperature": 1.0, "seed": 7, "ignore_eos": True}
        whole = await eng.generate(req("g-1", 24, **sampling))
        assert len(whole.output_ids) == 24 and len(whole.logprobs) == 24
        assert all(lp <= 0 for lp in whole.logprobs)
        assert (whole.finish, whole.matched) == ("length", None)
        assert whole.weight_version == VERSION[served.api]
        streamed, n = await fold(eng.stream(req("g-2", 24, **sampling)))
        assert n > 1  # piece by piece
        assert streamed.output_ids == whole.output_ids  # its own seed: the same sample
        assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-5)
        assert (streamed.finish, streamed.matched) == ("length", None)

    drive(served.api, served.url, go)


def test_eos_stop_is_matched_by_its_id_which_ends_the_output(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        for out in (
            await eng.generate(req("e-1", 60, temperature=0.0, stop_token_ids=(EOS,))),
            (await fold(eng.stream(req("e-2", 60, temperature=0.0, stop_token_ids=(EOS,)))))[0],
        ):
            assert out.finish == "stop" and out.matched == EOS
            assert out.output_ids[-1] == EOS and EOS not in out.output_ids[:-1]  # the stop id is in the output
            assert len(out.logprobs) == len(out.output_ids)

    drive(served.api, served.url, go)


def test_stop_token_and_stop_string_end_where_they_are_generated(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        ref = (await eng.generate(req("s-0", 40, temperature=0.0, ignore_eos=True))).output_ids
        # the first id that was not generated before (and no EOS before it)
        k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i] and ref[i] != EOS)
        assert EOS not in ref[:k]
        by_id = await eng.generate(req("s-1", 40, temperature=0.0, stop_token_ids=(ref[k],)))
        assert by_id.output_ids == ref[: k + 1] and by_id.finish == "stop" and by_id.matched == ref[k]
        # a stop string: the text of a token that first completes it
        j, text = next(
            (i, TOKENIZER.decode([ref[i]]))
            for i in range(1, len(ref))
            if TOKENIZER.decode([ref[i]]).strip() and ref[i] != EOS
            and TOKENIZER.decode([ref[i]]) not in TOKENIZER.decode(ref[:i])
        )
        for out in (
            await eng.generate(req("s-2", 40, temperature=0.0, ignore_eos=True, stop=(text,))),
            (await fold(eng.stream(req("s-3", 40, temperature=0.0, ignore_eos=True, stop=(text,)))))[0],
        ):
            assert out.output_ids == ref[: j + 1]  # ids are kept whole: the string is cut from text only
            assert (out.finish, out.matched) == ("stop", text)

    drive(served.api, served.url, go)


def test_length_ends_at_max_tokens_and_ignore_eos_goes_past_the_stop_ids(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        out = await eng.generate(req("l-1", 7, temperature=0.0, ignore_eos=True))
        assert len(out.output_ids) == 7 and (out.finish, out.matched) == ("length", None)
        # the contract's ignore_eos goes on past stop_token_ids too (the greedy answer has the EOS early)
        past = await eng.generate(req("l-2", 30, temperature=0.0, ignore_eos=True, stop_token_ids=(EOS,)))
        assert EOS in past.output_ids[:-1] and len(past.output_ids) == 30 and past.finish == "length"

    drive(served.api, served.url, go)


def test_prompt_without_room_is_rejected_400(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        long = EngineRequest("r-1", [5] * MAX_LEN, Sampling(max_tokens=1))
        with pytest.raises(EngineRejected) as ei:
            await eng.generate(long)
        assert ei.value.status == 400 and str(MAX_LEN) in ei.value.detail
        with pytest.raises(EngineRejected) as ei:
            await fold(eng.stream(long))
        assert ei.value.status == 400

    drive(served.api, served.url, go)


# -- abort ---------------------------------------------------------------------------------------


def test_abort_mid_stream_ends_it_with_the_ids_so_far(served: Served) -> None:
    async def go(eng: Engine, session: aiohttp.ClientSession) -> None:
        ref = (await eng.generate(req("a-0", 40, temperature=0.0, ignore_eos=True))).output_ids
        before = (await counters(session, served.url))["aborted"]
        out, told = EngineOutput(), False
        async for c in eng.stream(req("a-1", 1800, temperature=0.0, ignore_eos=True)):
            out.add(c)
            if len(out.output_ids) >= 3 and out.finish is None and not told:
                told = await eng.abort("a-1")
        assert told
        assert out.finish == "abort" and out.matched is None
        assert 3 <= len(out.output_ids) < 1800 and len(out.logprobs) == len(out.output_ids)
        n = min(len(ref), len(out.output_ids))
        assert out.output_ids[:n] == ref[:n]  # the ids generated so far, as generated
        # the engine stopped generating it (vLLM: because its client left)

        async def counted() -> bool:
            return int((await counters(session, served.url))["aborted"]) > before

        await until(counted, "the engine to count the abort")

    drive(served.api, served.url, go)


def test_abort_mid_generate_returns_the_ids_so_far(served: Served) -> None:
    async def go(eng: Engine, session: aiohttp.ClientSession) -> None:
        ref = (await eng.generate(req("b-0", 40, temperature=0.0, ignore_eos=True))).output_ids
        start = await counters(session, served.url)
        task = asyncio.create_task(eng.generate(req("b-1", 1800, temperature=0.0, ignore_eos=True)))

        async def generating() -> bool:
            now = await counters(session, served.url)
            return bool(now["requests"] > start["requests"] and now["generated_tokens"] >= start["generated_tokens"] + 100)

        await until(generating, "the engine to generate 100 tokens of the request")
        assert await eng.abort("b-1")
        out = await task
        assert out.finish == "abort" and 0 < len(out.output_ids) < 1800
        assert len(out.logprobs) == len(out.output_ids)
        n = min(len(ref), len(out.output_ids))
        assert out.output_ids[:n] == ref[:n]

    drive(served.api, served.url, go)


def test_an_abort_before_the_request_is_remembered(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        assert await eng.abort("early-1")
        out = await eng.generate(req("early-1", 1800, temperature=0.0, ignore_eos=True))
        assert out.finish == "abort" and len(out.output_ids) < 1800

    drive(served.api, served.url, go)


# -- batching: concurrent requests ----------------------------------------------------------------


def test_concurrent_streams_progress_together(served: Served) -> None:
    """Both streams receive tokens before either finishes: the engine decodes them in one batch
    (a serial engine would answer the second only after the first)."""

    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        log: list[tuple[str, int, str | None]] = []

        async def read(name: str, seed: int) -> None:
            async for c in eng.stream(req(f"c-{name}", 400, temperature=1.0, seed=seed, ignore_eos=True)):
                log.append((name, len(c.ids), c.finish))

        await asyncio.gather(read("x", 1), read("y", 2))
        first_finish = next(i for i, (_, _, f) in enumerate(log) if f is not None)
        got = {name for name, n, _ in log[:first_finish] if n}
        assert got == {"x", "y"}, f"only {got} received tokens before the first finish"

    drive(served.api, served.url, go)


def test_abort_of_one_leaves_the_others_running_and_their_output_as_alone(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        lone = {s: await eng.generate(req(f"o-lone-{s}", 500, temperature=1.0, seed=s, ignore_eos=True)) for s in (11, 13)}
        d_ref = (await eng.generate(req("o-lone-12", 40, temperature=1.0, seed=12, ignore_eos=True))).output_ids
        progress: dict[str, EngineOutput] = {"c": EngineOutput(), "d": EngineOutput(), "e": EngineOutput()}
        running_at_abort: list[bool] = []

        async def read(name: str, seed: int, n: int) -> None:
            out = progress[name]
            async for c in eng.stream(req(f"o-{name}", n, temperature=1.0, seed=seed, ignore_eos=True)):
                out.add(c)
                others = [progress[k] for k in ("c", "e")]
                if name == "d" and len(out.output_ids) >= 3 and not running_at_abort and all(o.output_ids for o in others):
                    running_at_abort.append(all(o.finish is None for o in others))
                    assert await eng.abort("o-d")

        await asyncio.gather(read("c", 11, 500), read("d", 12, 1800), read("e", 13, 500))
        assert running_at_abort == [True]  # the others were generating when d was aborted
        d = progress["d"]
        assert d.finish == "abort" and len(d.output_ids) >= 3
        n = min(len(d_ref), len(d.output_ids))
        assert d.output_ids[:n] == d_ref[:n]
        for name, seed in (("c", 11), ("e", 13)):
            out = progress[name]
            assert out.finish == "length"
            assert out.output_ids == lone[seed].output_ids  # the same tokens as alone
            assert out.logprobs == pytest.approx(lone[seed].logprobs, abs=1e-4)

    drive(served.api, served.url, go)


# -- what the engine reports, and failures ---------------------------------------------------------


def test_info_and_health(served: Served) -> None:
    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        info = await eng.info()
        assert info.model == MODEL and info.max_context == MAX_LEN
        assert info.vocab_size == VOCAB[served.api] and info.weight_version == VERSION[served.api]
        assert await eng.health() is True

    drive(served.api, served.url, go)


@pytest.mark.parametrize("api", APIS)
def test_nothing_listening_is_refused(api: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def go(eng: Engine, _: aiohttp.ClientSession) -> None:
        with pytest.raises(EngineRefused):
            await eng.generate(req("n-1", 4))
        with pytest.raises(EngineRefused):
            await fold(eng.stream(req("n-2", 4)))
        with pytest.raises(EngineRefused):
            await eng.info()
        assert await eng.health() is False

    drive(api, url, go)


@pytest.mark.parametrize("api", APIS)
def test_engine_killed_mid_request_is_lost(api: str) -> None:
    server = _start(api)
    try:

        async def go(eng: Engine, session: aiohttp.ClientSession) -> None:
            start = await counters(session, server.url)
            streamed = EngineOutput()
            got_ids = asyncio.Event()

            async def read() -> None:
                async for c in eng.stream(req("k-1", 1800, temperature=0.0, ignore_eos=True)):
                    streamed.add(c)
                    if len(streamed.output_ids) >= 3:
                        got_ids.set()

            stream_task = asyncio.create_task(read())
            gen_task = asyncio.create_task(eng.generate(req("k-2", 1800, temperature=0.0, ignore_eos=True)))
            await asyncio.wait_for(got_ids.wait(), 60)

            async def both_at_the_engine() -> bool:
                return int((await counters(session, server.url))["requests"]) >= start["requests"] + 2

            await until(both_at_the_engine, "both requests to reach the engine")
            server.kill()
            for task in (stream_task, gen_task):
                with pytest.raises(EngineLost):
                    await task
            assert streamed.finish is None  # it was cut, not finished

        drive(api, server.url, go)
    finally:
        server.stop()


# -- the vLLM shape, read by the official openai SDK -----------------------------------------------


def test_vllm_shape_is_what_the_openai_sdk_reads() -> None:
    """``tracestore engine --api vllm`` answers in the shape of vLLM's OpenAI server, as the
    official SDK parses it: Completion objects with vLLM's extra fields, SSE chunks, the usage
    chunk, and vLLM's error shape."""
    server = _start("vllm")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        models = client.models.list().data
        assert [m.id for m in models] == [MODEL] and (models[0].model_extra or {})["max_model_len"] == MAX_LEN
        extra = {"return_token_ids": True, "stop_token_ids": [EOS]}
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, logprobs=1, extra_body=extra)
        choice = whole.choices[0]
        ids = (choice.model_extra or {})["token_ids"]
        assert choice.finish_reason == "stop" and (choice.model_extra or {})["stop_reason"] is None  # the EOS
        assert ids[-1] == EOS and (choice.model_extra or {})["prompt_token_ids"] == PROMPT
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == len(ids)
        assert choice.text == TOKENIZER.decode(ids[:-1])  # special tokens are not text
        assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPT), len(ids))
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, logprobs=1, stream=True,
                stream_options={"include_usage": True}, extra_body=extra,
            )
        )
        *pieces, usage = chunks
        assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == len(ids)
        streamed = [t for c in pieces for t in (c.choices[0].model_extra or {})["token_ids"]]
        assert streamed == ids and "".join(c.choices[0].text for c in pieces) == choice.text
        assert [c.choices[0].finish_reason for c in pieces] == [None] * (len(pieces) - 1) + ["stop"]
        assert (pieces[0].choices[0].model_extra or {})["prompt_token_ids"] == PROMPT
        assert all((c.choices[0].model_extra or {})["prompt_token_ids"] is None for c in pieces[1:])
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt=[5] * MAX_LEN, max_tokens=1)
        assert isinstance(bad.value.body, dict) and bad.value.body["code"] == 400 and bad.value.body["param"] == "input_tokens"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="another-model", prompt=PROMPT, max_tokens=1)
    finally:
        server.stop()


def test_every_adapter_module_registers_its_own_name_and_the_gateway_refuses_another() -> None:
    """A new engine is one module of tracestore/gateway/engines: it is found by its file, registers
    under its module's name, and ``--engine-api`` takes exactly those names (another: exit 2)."""
    import subprocess
    import sys

    from tracestore.gateway.engines.base import adapter_modules, engine_apis

    assert adapter_modules() == engine_apis() == sorted(APIS)
    for api in APIS:
        assert engine_class(api).api == api  # type: ignore[attr-defined]
    with pytest.raises(KeyError, match="choose one of"):
        engine_class("tgi")
    proc = subprocess.run(
        [sys.executable, "-m", "tracestore.cli", "gateway", "--engine", "http://127.0.0.1:9", "--engine-api", "tgi"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--engine-api 'tgi'" in lines[0] and "sglang" in lines[0] and "vllm" in lines[0]


def test_a_paths_ids_json_is_kept_per_buffer_and_each_turn_writes_only_its_new_ids() -> None:
    """``ids_json`` of a ``TokenIds`` path: the same JSON as its list on every turn, a branch, a
    shorter view and a fresh path; the text kept for the buffer grows with it (the next turn
    appends only its ids) and is dropped with the buffer."""
    import gc

    import orjson

    from tracestore.gateway.engines import base
    from tracestore.gateway.engines.base import JSON_OPTS, extend_ids, ids_json
    from tracestore.traces import TokenIds

    def dumped(ids: object) -> bytes:
        return orjson.dumps({"input_ids": ids_json(ids)}, option=JSON_OPTS)  # type: ignore[arg-type]

    path = TokenIds(range(500))
    buf = path.shared()[0]
    assert dumped(path) == orjson.dumps({"input_ids": list(range(500))})
    for turn in range(3):  # each turn: the stored path plus this turn's ids, in the same buffer
        path = extend_ids(path, [7 + turn, 8, 9])  # type: ignore[assignment]
        assert path.shared()[0] is buf
        assert dumped(path) == orjson.dumps({"input_ids": list(path)})
        assert base._SENT._texts[id(buf)][1] == len(path)  # kept: the next turn appends to it
    kept = base._SENT._texts[id(buf)][2]
    assert base._SENT.text(*path.shared()) is kept  # the same view again: nothing written
    short = path[:10]
    assert dumped(short) == orjson.dumps({"input_ids": list(range(10))})
    branch = extend_ids(short, [42])  # a fork at an earlier prompt: another buffer
    assert dumped(branch) == orjson.dumps({"input_ids": [*range(10), 42]})
    assert base._SENT._texts[id(buf)][2] is kept  # the longer path's text is not shortened
    assert dumped(TokenIds()) == b'{"input_ids":[]}'
    key = id(buf)
    del path, short, buf, branch
    gc.collect()
    assert key not in base._SENT._texts
    small = base._SentIds(max_bytes=100)  # the texts are bounded: least recently sent first out
    a, b = TokenIds(range(10)), TokenIds(range(20, 30))
    assert small.text(*a.shared()) == orjson.dumps(list(range(10)))
    assert small.text(*b.shared()) == orjson.dumps(list(range(20, 30)))
    assert small.nbytes == 21 + 31 and len(small._texts) == 2
    c = TokenIds(range(100, 115))
    assert small.text(*c.shared()) == orjson.dumps(list(range(100, 115)))
    assert id(a.shared()[0]) not in small._texts and small.nbytes <= 100
    assert small.text(*TokenIds(range(1000, 1100)).shared()) == orjson.dumps(list(range(1000, 1100)))  # too long to keep
    assert small.nbytes <= 100


def test_an_engine_calls_body_joins_the_kept_ids_text_into_the_json_of_the_rest() -> None:
    """``json_body``: the body of both engines' calls parses to the very object orjson would have
    written, for a stored path's ids (the kept text joined in), a list, an empty path and no other
    field; the SGLang and vLLM payloads name the ids' field their engine reads."""
    import orjson

    from tracestore.gateway.engines.base import EngineRequest, Sampling, extend_ids, json_body
    from tracestore.gateway.engines.sglang import SGLangEngine
    from tracestore.gateway.engines.vllm import VLLMEngine
    from tracestore.traces import TokenIds

    rest = {"rid": "r-1", "sampling_params": {"max_new_tokens": 8, "stop": ["\u00e9\n"]}, "stream": False}
    path = extend_ids(TokenIds(range(300)), [5, 6, 7])
    for ids in (path, list(path), TokenIds(), [], (1, 2)):
        for fields in (rest, {}):
            body = json_body("input_ids", ids, fields)
            assert orjson.loads(body) == {"input_ids": list(ids), **fields}, (type(ids), fields)
    sampling = Sampling(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=(2,), stop=("x",))
    req = EngineRequest(input_ids=path, sampling=sampling, rid="r-2")
    sg = orjson.loads(SGLangEngine.payload(req, stream=True))
    assert sg["input_ids"] == list(path) and sg["rid"] == "r-2" and sg["stream"] is True
    assert sg["sampling_params"]["max_new_tokens"] == 8 and sg["sampling_params"]["stop"] == ["x"]
    vl = orjson.loads(VLLMEngine.payload(req))
    assert vl["prompt"] == list(path) and vl["request_id"] == "r-2" and vl["stop_token_ids"] == [2]


def test_the_kept_id_texts_take_about_their_length_in_memory() -> None:
    """The texts ``_SentIds`` keeps are bounded by their length (``nbytes``), so they must take about
    that much memory: orjson's own bytes keep the capacity it reserved (3-5x the length of an id
    array's JSON), so 16 MB of kept texts took ~80 MB of a gateway's memory before they were copied."""
    import tracemalloc

    from tracestore.gateway.engines import base
    from tracestore.traces import TokenIds

    sent = base._SentIds()
    paths = [TokenIds(range(i * 10_000, i * 10_000 + 3_000)) for i in range(40)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for p in paths:
            sent.text(*p.shared())
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sent.nbytes == sum(len(v[2]) for v in sent._texts.values()) and len(sent._texts) == 40
    assert held < 1.5 * sent.nbytes, (held, sent.nbytes)  # (orjson's bytes as they were: ~4x)


def test_engine_bodies_carry_a_stored_paths_ids_as_the_same_json_without_a_list() -> None:
    """The ids of a stored path (int32 ``TokenIds``) go into the engines' JSON bodies as a numpy view
    and come out as the same JSON array as a list; extending one shares its buffer."""
    import orjson

    from tracestore.gateway.engines.base import JSON_OPTS, extend_ids, ids_json
    from tracestore.gateway.engines.sglang import SGLangEngine
    from tracestore.traces import TokenIds

    path = TokenIds(range(1000, 1100))
    ids = extend_ids(path, [7, 8, 9])
    assert isinstance(ids, TokenIds) and list(ids) == [*range(1000, 1100), 7, 8, 9]
    assert extend_ids(ids, []) is ids and extend_ids([1, 2], [3]) == [1, 2, 3]
    assert orjson.dumps(ids_json(ids), option=JSON_OPTS) == orjson.dumps(list(ids))
    assert ids_json([1, 2]) == [1, 2]
    req = EngineRequest("r-1", ids, Sampling(max_tokens=4))
    assert orjson.loads(SGLangEngine.payload(req, stream=False))["input_ids"] == list(ids)
