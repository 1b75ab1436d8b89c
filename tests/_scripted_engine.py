"""A scripted inference engine for tests: real vocabularies, scripted answers, SGLang's or vLLM's wire shape.

Run it as a process::

    python -m tests._scripted_engine --tokenizer DIR --api sglang|vllm [--host H] [--port 0]
    # listening on http://H:P

It answers in ``DIR``'s real vocabulary (a Hugging Face tokenizer directory,
e.g. one of ``tests/_families.py``): each request takes the next answer of a
queue the test sets, encodes its text with the real tokenizer
(``add_special_tokens=False``: special tokens written in the text become their
ids) and, when the answer ends by stop, appends the family's end-of-turn id
(``tracestore_family.json``: ``end_of_turn``, or ``end_of_tool_turn`` when the
answer holds a tool call in the family's syntax; without that file, the
request's first stop id, else the tokenizer's eos). It then "generates" those
ids one by one, as an engine would: a stop id or stop string ends the answer
(finish ``stop``, with the matched id or string), ``max_tokens`` cuts it
(finish ``length``, no stop id), an abort ends it (finish ``abort`` and the
ids so far). Logprobs are scripted constants.

Control endpoints (the test's side):

* ``POST /script`` ``{"answers": [ANSWER, ...], "append": false, "default": ANSWER | null,
  "token_delay_s": 0.0}`` where ``ANSWER`` is a text or ``{"text": str}`` /
  ``{"ids": [int, ...]}`` with optional ``"stop": true`` (append the end-of-turn
  id), ``"stop_id": int``, ``"logprob": float`` (every token; default -0.5),
  ``"logprobs": [float, ...]``, ``"delay_s": float`` (before each token: a test
  can abort mid-generation). ``default`` answers when the queue is empty
  (else such a request gets a 500 naming the empty script).
* ``GET /log``: ``{"requests": [{"rid", "api", "input_ids", "sampling", "stream",
  "state": "running"|"done"|"aborted", "output_ids", "finish", "matched"}, ...]}`` in
  arrival order (live: a running request's ``output_ids`` grow), so a test can
  assert the continuity of engine inputs turn to turn. ``POST /reset`` empties
  the log and the script.

Engine endpoints:

* ``--api sglang`` (the shape of ``tracestore/gateway/engines/sglang.py`` and
  ``trainer/engine.py``): ``POST /generate`` (``rid``, ``input_ids``,
  ``sampling_params`` {``max_new_tokens``, ``stop``, ``stop_token_ids``,
  ``ignore_eos``, ...}, ``return_logprob``, ``stream``) answers ``{"text",
  "output_ids", "meta_info": {"id", "finish_reason": {"type", "matched"},
  "prompt_tokens", "completion_tokens", "output_token_logprobs": [[lp, id, null]],
  "weight_version"}}``; streamed: one SSE chunk per token with the new ids, the
  last with the finish reason, then ``data: [DONE]``. ``POST /abort_request``
  ``{"rid"}`` or ``{"abort_all": true}`` (an abort before its request arrives
  is remembered); ``POST /update_weight_version`` ``{"new_version"}``;
  ``GET /get_model_info`` (``vocab_size`` = the tokenizer's length); ``GET /health``.
* ``--api vllm`` (vLLM's OpenAI-compatible server, DESIGN section 13): ``POST
  /v1/completions`` with ``prompt`` a list of ids (or a text), ``max_tokens``,
  ``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs``,
  ``return_token_ids``, ``stream`` (+ ``stream_options.include_usage``) answers
  ``choices[0]`` {``text``, ``token_ids``, ``prompt_token_ids``, ``logprobs``
  {``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``},
  ``finish_reason``, ``stop_reason``} and ``usage``; streamed: one chunk per
  token (``prompt_token_ids`` in the first only, ``finish_reason`` on the
  last), then ``data: [DONE]``. Abort is the client closing its connection,
  as vLLM does. ``GET /v1/models``, ``GET /health``.

:class:`ScriptedEngine` runs the process from a test (start, script, log, stop).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tests._engine_script import BadRequest, Job, Script, int_list

ROOT = Path(__file__).resolve().parents[1]


# -- HTTP ----------------------------------------------------------------------------------------


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class Server:
    """The aiohttp application of one :class:`Script` in one API shape."""

    def __init__(self, script: Script) -> None:
        self.s = script

    def app(self) -> Any:
        """The application: the control endpoints and the ``--api`` shape's endpoints."""
        from aiohttp import web

        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/script", self.http_script)
        app.router.add_get("/script", self.http_queued)
        app.router.add_get("/log", self.http_log)
        app.router.add_post("/reset", self.http_reset)
        app.router.add_get("/health", self.http_health)
        if self.s.api == "sglang":
            app.router.add_post("/generate", self.sglang_generate)
            app.router.add_post("/abort_request", self.sglang_abort)
            app.router.add_post("/update_weight_version", self.sglang_version)
            app.router.add_get("/get_model_info", self.sglang_info)
        else:
            app.router.add_post("/v1/completions", self.vllm_completions)
            app.router.add_get("/v1/models", self.vllm_models)
        return app

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    async def body(request: Any) -> dict[str, Any]:
        """The JSON object body; BadRequest otherwise."""
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise BadRequest(f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def error(self, status: int, message: str) -> Any:
        """An error in the shape's own form (vLLM: ``{"error": {...}}``; SGLang: ``object: error``)."""
        from aiohttp import web

        if self.s.api == "vllm":
            kind = "BadRequestError" if status < 500 else "InternalServerError"
            return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status)
        return web.json_response({"object": "error", "message": message, "type": "BadRequest", "code": status}, status=status)

    @staticmethod
    def json(obj: Any) -> Any:
        from aiohttp import web

        return web.Response(body=json.dumps(obj, ensure_ascii=False).encode(), content_type="application/json")

    # -- control --------------------------------------------------------------------------------

    async def http_script(self, request: Any) -> Any:
        try:
            return self.json(self.s.set_script(await self.body(request)))
        except BadRequest as exc:
            return self.error(400, str(exc))

    async def http_queued(self, request: Any) -> Any:
        return self.json({"queued": len(self.s.queue), "default": self.s.default is not None})

    async def http_log(self, request: Any) -> Any:
        return self.json({"requests": [j.entry() for j in self.s.log]})

    async def http_reset(self, request: Any) -> Any:
        self.s.log.clear()
        self.s.queue.clear()
        self.s.default = None
        self.s.token_delay_s = 0.0
        return self.json({"success": True})

    async def http_health(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text="ok")

    # -- SGLang ---------------------------------------------------------------------------------

    def sglang_job(self, body: dict[str, Any]) -> Job:
        """A job from a ``/generate`` body; BadRequest when malformed."""
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        ids = int_list(body.get("input_ids"), "input_ids")
        if not ids:
            raise BadRequest("input_ids must not be empty (text input is not supported)")
        if max(ids) >= len(self.s.tok):
            raise BadRequest(f"input_ids must be integers in [0, {len(self.s.tok)})")
        max_new = sp.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
            raise BadRequest(f"max_new_tokens must be a positive integer, got {max_new!r}")
        stop = sp.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise BadRequest("stop must be a string or a list of non-empty strings")
        ignore = bool(sp.get("ignore_eos", False))
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        stop_ids = int_list(sp.get("stop_token_ids") or [], "stop_token_ids")
        return Job(rid, "sglang", ids, max_new, self.s.stop_set(stop_ids, ignore), stop, ignore, bool(body.get("stream")), sp)

    def sglang_meta(self, job: Job, ids: list[int], lps: list[float], final: bool, logprobs: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": job.rid,
            "finish_reason": {"type": job.finish, "matched": job.matched} if final else None,
            "prompt_tokens": len(job.input_ids),
            "completion_tokens": len(job.out),
            "cached_tokens": 0,
            "weight_version": str(self.s.version),
        }
        if logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
        return meta

    async def sglang_generate(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = await self.body(request)
            job = self.sglang_job(body)
            answer = self.s.next_answer()
        except BadRequest as exc:
            return self.error(400, str(exc))
        except LookupError as exc:
            return self.error(500, str(exc))
        self.s.register(job)
        logprobs = bool(body.get("return_logprob", True))
        if not job.stream:
            async for _ in self.s.run(job, answer):
                pass
            meta = self.sglang_meta(job, job.out, job.lps, True, logprobs)
            return self.json({"text": self.s.text(job), "output_ids": job.out, "meta_info": meta})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        async for tid, lp in self.s.run(job, answer):
            await resp.write(_sse({"text": self.s.piece(tid), "output_ids": [tid], "meta_info": self.sglang_meta(job, [tid], [lp], False, logprobs)}))
        await resp.write(_sse({"text": "", "output_ids": [], "meta_info": self.sglang_meta(job, [], [], True, logprobs)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def sglang_abort(self, request: Any) -> Any:
        try:
            body = await self.body(request)
        except BadRequest as exc:
            return self.error(400, str(exc))
        if body.get("abort_all"):
            n = self.s.abort(None)
        elif isinstance(body.get("rid"), str):
            n = self.s.abort(body["rid"])
        else:
            return self.error(400, "rid must be a string (or abort_all: true)")
        return self.json({"success": True, "aborted": n})

    async def sglang_version(self, request: Any) -> Any:
        try:
            v = (await self.body(request)).get("new_version")
            self.s.version = int(v) if v is not None else self.s.version + 1
        except (BadRequest, TypeError, ValueError) as exc:
            return self.error(400, f"new_version must be an integer: {exc}")
        return self.json({"success": True, "weight_version": str(self.s.version)})

    async def sglang_info(self, request: Any) -> Any:
        return self.json(
            {
                "model_path": str(self.s.dir),
                "tokenizer_path": str(self.s.dir),
                "is_generation": True,
                "weight_version": str(self.s.version),
                "vocab_size": len(self.s.tok),
                "max_len": int(getattr(self.s.tok, "model_max_length", 131072)),
            }
        )

    # -- vLLM -----------------------------------------------------------------------------------

    def vllm_job(self, body: dict[str, Any], request: Any) -> Job:
        """A job from a ``/v1/completions`` body; BadRequest when malformed."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = list(self.s.tok.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True))))
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise BadRequest("one prompt per request (this engine serves n=1, one prompt)")
            ids = int_list(prompt[0], "prompt")
        else:
            ids = int_list(prompt, "prompt")
        if not ids:
            raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.")
        if max(ids) >= len(self.s.tok):
            raise BadRequest(f"Token id {max(ids)} is out of vocabulary (size {len(self.s.tok)})")
        if body.get("n", 1) != 1:
            raise BadRequest("n must be 1 (this engine serves one sequence)")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise BadRequest("stop must be a string or a list of non-empty strings")
        ignore = bool(body.get("ignore_eos", False))
        stop_ids = int_list(body.get("stop_token_ids") or [], "stop_token_ids")
        rid = body.get("request_id") or request.headers.get("X-Request-Id") or uuid.uuid4().hex
        sampling = {k: v for k, v in body.items() if k not in ("prompt",)}
        return Job(str(rid), "vllm", ids, max_tokens, self.s.stop_set(stop_ids, ignore), stop, ignore, bool(body.get("stream")), sampling)

    def vllm_logprobs(self, ids: list[int], lps: list[float], offset: int) -> dict[str, Any]:
        tokens = [self.s.piece(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)]}

    def stop_reason(self, job: Job) -> int | str | None:
        """vLLM's ``stop_reason``: the stop string or id, None for the tokenizer's own eos."""
        if job.finish != "stop" or job.matched == self.s.tok.eos_token_id:
            return None
        return job.matched

    async def vllm_completions(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = await self.body(request)
            job = self.vllm_job(body, request)
            answer = self.s.next_answer()
        except BadRequest as exc:
            return self.error(400, str(exc))
        except LookupError as exc:
            return self.error(500, str(exc))
        self.s.register(job)
        want_ids = bool(body.get("return_token_ids"))
        want_lps = body.get("logprobs") is not None
        skip = bool(body.get("skip_special_tokens", True))
        cid, created = f"cmpl-{job.rid}", int(time.time())
        if not job.stream:
            async for _ in self.s.run(job, answer):
                pass
            choice: dict[str, Any] = {
                "index": 0,
                "text": self.s.text(job, skip),
                "logprobs": self.vllm_logprobs(job.out, job.lps, 0) if want_lps else None,
                "finish_reason": job.finish,
                "stop_reason": self.stop_reason(job),
            }
            if want_ids:
                choice.update(token_ids=job.out, prompt_token_ids=job.input_ids)
            usage = {"prompt_tokens": len(job.input_ids), "completion_tokens": len(job.out), "total_tokens": len(job.input_ids) + len(job.out)}
            return self.json({"id": cid, "object": "text_completion", "created": created, "model": self.s.model, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = 0
        pending: tuple[int, float] | None = None

        async def chunk(tid: int, lp: float, final: bool) -> None:
            nonlocal sent
            text = "" if final and job.finish == "stop" and job.matched == tid else self.s.piece(tid)
            c: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": self.vllm_logprobs([tid], [lp], sent) if want_lps else None,
                "finish_reason": job.finish if final else None,
                "stop_reason": self.stop_reason(job) if final else None,
            }
            if want_ids:
                c["token_ids"] = [tid]
                if sent == 0:
                    c["prompt_token_ids"] = job.input_ids
            sent += len(text)
            await resp.write(_sse({"id": cid, "object": "text_completion", "created": created, "model": self.s.model, "choices": [c]}))

        async for tid, lp in self.s.run(job, answer):  # each token is sent when the next one (or the end) is known
            if pending is not None:
                await chunk(*pending, final=False)
            pending = (tid, lp)
        if pending is not None:
            await chunk(*pending, final=True)
        opts = body.get("stream_options") or {}
        if isinstance(opts, dict) and opts.get("include_usage"):
            usage = {"prompt_tokens": len(job.input_ids), "completion_tokens": len(job.out), "total_tokens": len(job.input_ids) + len(job.out)}
            await resp.write(_sse({"id": cid, "object": "text_completion", "created": created, "model": self.s.model, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def vllm_models(self, request: Any) -> Any:
        card = {"id": self.s.model, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": str(self.s.dir), "parent": None, "max_model_len": 131072}
        return self.json({"object": "list", "data": [card]})


# -- process -------------------------------------------------------------------------------------


def _http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{method} {url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None


class ScriptedEngine:
    """``python -m tests._scripted_engine`` as a subprocess: start, script, read the log, stop.

    ``start()`` waits for its ``listening on`` line (RuntimeError with its
    output otherwise); ``stop()`` sends SIGTERM, then SIGKILL after 15 s.
    Also a context manager.
    """

    def __init__(self, tokenizer_dir: str | Path, api: str = "sglang", *extra: str) -> None:
        self.args = ["--tokenizer", str(tokenizer_dir), "--api", api, "--port", "0", *extra]
        self.api = api
        self.url = ""
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def start(self, timeout_s: float = 120.0) -> ScriptedEngine:
        """Start the process and wait until it listens."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._scripted_engine", *self.args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or not self.url:
            self.stop()
            raise RuntimeError(f"the scripted engine did not start: {''.join(self.lines)[-3000:]}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("listening on "):
                self.url = line.split()[-1]
                self._ready.set()
        self._ready.set()

    def script(self, *answers: Any, default: Any = None, token_delay_s: float = 0.0, append: bool = False) -> int:
        """Queue ``answers`` (texts or answer objects, see the module docstring); returns the queue length."""
        body: dict[str, Any] = {"answers": list(answers), "token_delay_s": token_delay_s, "append": append}
        if default is not None:
            body["default"] = default
        return int(_http("POST", self.url + "/script", body)["queued"])

    def log(self) -> list[dict[str, Any]]:
        """Every request so far (``GET /log``), in arrival order."""
        return list(_http("GET", self.url + "/log")["requests"])

    def inputs(self) -> list[list[int]]:
        """The ``input_ids`` of every request so far."""
        return [r["input_ids"] for r in self.log()]

    def wait_log(self, pred: Any, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll the log until ``pred(log)`` is true; returns it (AssertionError on timeout)."""
        end = time.monotonic() + timeout_s
        while True:
            log = self.log()
            if pred(log):
                return log
            if time.monotonic() > end:
                raise AssertionError(f"the engine log never satisfied the condition: {log}")
            time.sleep(0.02)

    def reset(self) -> None:
        """Empty the log and the script."""
        _http("POST", self.url + "/reset", {})

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ScriptedEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests._scripted_engine``: serve until SIGINT/SIGTERM; usage errors exit 2."""
    ap = argparse.ArgumentParser(prog="python -m tests._scripted_engine", description="A scripted engine for tests.")
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory")
    ap.add_argument("--api", choices=("sglang", "vllm"), default="sglang")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default=None, help="the served model name (default: the directory's name)")
    args = ap.parse_args(argv)
    if not Path(args.tokenizer).is_dir():
        ap.error(f"--tokenizer {args.tokenizer!r}: not a directory")
    from tracestore.gateway.serve import serve_forever

    server = Server(Script(args.tokenizer, args.api, args.model))

    async def make() -> Any:
        return server.app()

    serve_forever(make, args.host, args.port, lambda url: print(f"listening on {url}", flush=True))


__all__ = ["ScriptedEngine", "Server", "main"]


if __name__ == "__main__":
    main()
