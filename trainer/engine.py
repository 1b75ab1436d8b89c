"""The reference policy served over HTTP (``tracestore engine``): SGLang's native shape here,
vLLM's OpenAI-compatible shape in :mod:`.engine_vllm` (``--api vllm``).

Generation is continuously batched (:mod:`.batching`): concurrent requests
decode together, a newcomer joins the running batch after its prefill, a
finished or aborted one leaves it between steps, and the others go on.

SGLang's native endpoints (the subset a session gateway needs):

* ``POST /generate``: ``input_ids``, ``sampling_params`` (``max_new_tokens``,
  ``temperature`` (0 = greedy), ``stop_token_ids`` (with the end-of-turn id,
  as SGLang adds the model's EOS), ``stop`` strings, ``ignore_eos`` (no stop
  id then, as in SGLang), ``sampling_seed``; ``top_p``/``top_k`` are accepted
  and ignored), ``return_logprob``, ``return_routed_experts``, ``stream``,
  ``rid``. The reply: ``output_ids``, ``text``, ``meta_info`` with ``id``,
  ``finish_reason`` (``{"type": "stop"|"length"|"abort", "matched"}``),
  ``prompt_tokens``, ``completion_tokens``, ``output_token_logprobs``
  (``[[logprob, id, null], ...]``), ``weight_version`` and, when asked,
  ``routed_experts`` (base64 of int32 little-endian rows, one per token fed
  through the model: ``prompt + output - 1`` rows, as SGLang) with
  ``routed_experts_shape`` ``[rows, layers, top_k]`` (absent for a request
  aborted before it ran). With ``stream`` the reply is SSE: each ``data:``
  chunk carries the ids (and logprobs) new since the previous one, the last
  one the finish reason and the experts, then ``data: [DONE]``.
* ``POST /abort_request``: ``{"rid"}`` or ``{"abort_all": true}``; the
  request ends with finish reason ``abort`` and the ids generated so far (an
  abort that arrives before its request is remembered for a minute). A
  client that disconnects aborts its request too.
* ``GET /health``, ``GET /get_model_info``.

Both shapes also serve the reference engine's own extras:
``POST /update_weights_from_disk`` (``{"model_path", "weight_version"}``: a
``torch.save`` state dict or a trainer checkpoint's ``model.pt``),
``POST /update_weight_version`` (``{"new_version"}``) and ``GET
/get_model_info`` (with the counters ``requests``, ``aborted`` and
``generated_tokens``). A weight
load waits for the running batch to drain (no request is admitted
meanwhile): every generation comes from one weight version.

:class:`PolicyEngine` can also serve from inside a process that owns the
policy (a rollout worker): :meth:`PolicyEngine.set_weights`,
:meth:`PolicyEngine.abort_all`.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import orjson
import torch
from aiohttp import web

from .batching import MAX_BATCH, Batcher, Job, Sampled
from .policy import Generation, MoEPolicy, load_numpy_state, new_policy, set_determinism
from .tokenizer import TOKENIZER
from .warmup import warm_start

T = TypeVar("T")

#: How long an abort for a request not seen yet is remembered.
EARLY_ABORT_S = 60.0


class BadRequest(ValueError):
    """A request body the engine cannot serve (answered 400); ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def token_ids(raw: Any, vocab: int, what: str = "input_ids") -> list[int]:
    """``raw`` as a non-empty list of ids in ``[0, vocab)``; BadRequest (naming ``what``) otherwise."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"{what} must be a non-empty list of token ids (text input is not supported)", what)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab for x in raw):
        raise BadRequest(f"{what} must be integers in [0, {vocab})", what)
    return raw


def _sglang_job(body: dict[str, Any], vocab: int, eos: int) -> Job:
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = sp.get("max_new_tokens", 128)
    temp = sp.get("temperature", 1.0)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise BadRequest(f"max_new_tokens must be a positive integer, got {max_new!r}")
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or temp < 0:
        raise BadRequest(f"temperature must be >= 0, got {temp!r}")
    stop_ids = sp.get("stop_token_ids") or []
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop_ids, list) or not all(isinstance(x, int) for x in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers")
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest("stop must be a non-empty string or a list of them")
    seed = sp.get("sampling_seed")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    return Job(
        rid=rid,
        input_ids=token_ids(body.get("input_ids"), vocab),
        max_new_tokens=max_new,
        temperature=float(temp),
        # SGLang: the model's EOS ends an answer too, and ignore_eos turns every stop id off
        stop_ids=frozenset() if sp.get("ignore_eos") else frozenset([*stop_ids, eos]),
        stop=tuple(stop),
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        experts=bool(body.get("return_routed_experts", False)),
    )


class PolicyEngine:
    """A :class:`~trainer.policy.MoEPolicy` behind an inference engine's HTTP API, continuously batched.

    ``seed`` seeds the sampling generator shared by requests without their
    own seed; ``version`` is the initial weight version; ``max_batch``
    bounds the requests decoded together.
    """

    def __init__(self, policy: MoEPolicy, *, seed: int = 0, version: int = 0, max_batch: int = MAX_BATCH) -> None:
        self.policy = policy
        self.tok = TOKENIZER
        self.name = "tracestore-reference-moe"
        self.batcher = Batcher(policy, seed=seed, version=version, max_batch=max_batch)
        self._lock = threading.Lock()
        self._running: dict[str, Job] = {}
        self._early: OrderedDict[str, float] = OrderedDict()
        self.requests = 0

    @property
    def version(self) -> int:
        """The weight version served now."""
        return self.batcher.version

    @property
    def aborted(self) -> int:
        """Requests that ended with finish reason ``abort``."""
        return self.batcher.aborted

    @property
    def max_len(self) -> int:
        """The context length: most tokens of prompt + answer."""
        return self.policy.cfg.max_len

    # -- requests ----------------------------------------------------------------------------

    def register(self, job: Job) -> None:
        """Count ``job`` and make it abortable by its rid (an abort that came first applies now)."""
        with self._lock:
            now = time.monotonic()
            while self._early and next(iter(self._early.values())) < now - EARLY_ABORT_S:
                self._early.popitem(last=False)
            if self._early.pop(job.rid, None) is not None:
                job.abort.set()
            self._running[job.rid] = job
            self.requests += 1

    def unregister(self, job: Job) -> None:
        """Forget ``job`` (it finished, or its client left)."""
        with self._lock:
            if self._running.get(job.rid) is job:
                del self._running[job.rid]

    def abort(self, rid: str) -> int:
        """Abort request ``rid`` (1), or remember the abort for a request not seen yet (0)."""
        with self._lock:
            job = self._running.get(rid)
            if job is not None:
                job.abort.set()
                return 1
            self._early[rid] = time.monotonic()
            while len(self._early) > 10_000:
                self._early.popitem(last=False)
            return 0

    def abort_all(self) -> int:
        """Abort every request running or queued (an engine pause before a weight update)."""
        with self._lock:
            for job in self._running.values():
                job.abort.set()
            return len(self._running)

    async def run(self, job: Job) -> AsyncIterator[tuple[list[Sampled], Generation | None]]:
        """Generate ``job``: yields the tokens new since the last piece, the :class:`Generation` with the last.

        Raises ValueError when the job cannot run (its prompt leaves no
        room). The caller registers the job and aborts it when it leaves.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Sampled | Future[Generation]] = asyncio.Queue()

        def put(item: Sampled | Future[Generation]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass

        job.emit = put
        fut = self.batcher.submit(job)
        fut.add_done_callback(put)  # after every emit of the job: same thread, FIFO
        while True:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            while isinstance(items[-1], Sampled) and items[-1].last:
                items.append(await queue.get())  # the last token goes out with the result, as engines send it
            tokens = [x for x in items if isinstance(x, Sampled)]
            done = next((x for x in items if isinstance(x, Future)), None)
            if done is not None:
                yield tokens, done.result()
                return
            yield tokens, None

    async def complete(self, job: Job) -> tuple[list[Sampled], Generation]:
        """:meth:`run` to its end: every token and the :class:`Generation` (ValueError as there)."""
        tokens: list[Sampled] = []
        async for piece, g in self.run(job):
            tokens += piece
            if g is not None:
                return tokens, g
        raise AssertionError("run() ended without its result")  # pragma: no cover - run always ends with one

    # -- weights -----------------------------------------------------------------------------

    def set_weights(self, state: dict[str, np.ndarray], version: int) -> int:
        """Load numpy weights and set the version once the running batch drained (blocks until done)."""

        def load() -> int:
            load_numpy_state(self.policy, state)
            self.batcher.version = version
            return version

        return self.batcher.call(load).result()

    def load_file(self, path: str, version: int) -> int:
        """Load a ``torch.save`` state dict (or a trainer ``model.pt``) and set the version, now.

        Only while nothing generates (before serving, or through
        :meth:`between_steps`). Raises OSError / RuntimeError / KeyError.
        """
        ck = torch.load(path, weights_only=True, map_location="cpu")
        self.policy.load_state_dict(ck["model"] if isinstance(ck, dict) and "model" in ck else ck)
        self.batcher.version = version
        return version

    async def between_steps(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread once the running batch drained (no admission meanwhile)."""
        return await asyncio.wrap_future(self.batcher.call(fn))

    def close(self) -> None:
        """Abort everything and stop the engine thread."""
        self.batcher.close()

    # -- HTTP: shared by both shapes -----------------------------------------------------------

    def add_extras(self, app: web.Application) -> None:
        """The reference engine's own endpoints (weights, counters), and stopping with the app."""
        app.router.add_post("/update_weights_from_disk", self._http_load)
        app.router.add_post("/update_weight_version", self._http_version)
        app.router.add_get("/get_model_info", self._http_info)
        app.on_cleanup.append(self._cleanup)

    async def _cleanup(self, app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def _http_load(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            path = body.get("model_path")
            if not isinstance(path, str):
                raise BadRequest("model_path must be a path")
            version = _version(body.get("weight_version"), self.version + 1)
            v = await self.between_steps(lambda: self.load_file(path, version))
        except (BadRequest, OSError, RuntimeError, KeyError) as exc:
            return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status=400)
        return web.json_response({"success": True, "message": "weights loaded", "weight_version": str(v)})

    async def _http_version(self, request: web.Request) -> web.Response:
        try:
            version = _version((await read_json(request)).get("new_version"), self.version + 1)
        except BadRequest as exc:
            return _error(400, str(exc))

        def bump() -> int:
            self.batcher.version = version
            return version

        v = await self.between_steps(bump)
        return web.json_response({"success": True, "weight_version": str(v)})

    async def _http_info(self, request: web.Request) -> web.Response:
        cfg = self.policy.cfg
        return web.json_response(
            {
                "model_path": self.name,
                "tokenizer_path": "builtin",
                "is_generation": True,
                "weight_version": str(self.version),
                "vocab_size": cfg.vocab_size,
                "max_len": cfg.max_len,
                "num_layers": cfg.n_layers,
                "top_k": cfg.top_k,
                "max_batch": self.batcher.max_batch,
                "requests": self.requests,
                "aborted": self.aborted,
                "generated_tokens": self.batcher.tokens,
            }
        )

    # -- HTTP: SGLang's native shape -----------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application in SGLang's native shape."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self._http_generate)
        app.router.add_post("/abort_request", self._http_abort)
        app.router.add_get("/health", self._http_health)
        self.add_extras(app)
        return app

    def _meta(self, job: Job, ids: list[int], lps: list[float], finish: dict[str, Any] | None, n: int) -> dict[str, Any]:
        return {
            "id": job.rid,
            "finish_reason": finish,
            "prompt_tokens": len(job.input_ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": str(job.version),
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps, strict=True)],
        }

    @staticmethod
    def _final(job: Job, g: Generation, meta: dict[str, Any]) -> None:
        if job.experts and len(g.routed_experts) > 1:  # none for a request aborted before it ran
            rows = np.ascontiguousarray(g.routed_experts[1:], dtype="<i4")
            meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
            meta["routed_experts_shape"] = list(rows.shape)

    async def _http_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            job = _sglang_job(body, self.tok.vocab_size, self.tok.stop_id)
            if len(job.input_ids) >= self.max_len:
                raise BadRequest(f"prompt of {len(job.input_ids)} tokens leaves no room (max_len {self.max_len})")
        except BadRequest as exc:
            return _error(400, str(exc))
        logprobs = bool(body.get("return_logprob", True))
        self.register(job)
        try:
            if body.get("stream"):
                return await self._stream(request, job, logprobs)
            _, g = await self.complete(job)
            meta = self._meta(job, g.output_ids, g.logprobs, _finish(g, job), len(g.output_ids))
            self._final(job, g, meta)
            if not logprobs:
                del meta["output_token_logprobs"]
            reply = {"text": self.tok.decode(g.output_ids), "output_ids": g.output_ids, "meta_info": meta}
            return web.Response(body=orjson.dumps(reply), content_type="application/json")
        except ValueError as exc:
            return _error(400, str(exc))
        except (asyncio.CancelledError, ConnectionResetError):
            job.abort.set()  # the client went away: stop generating for it
            raise
        finally:
            self.unregister(job)

    async def _stream(self, request: web.Request, job: Job, logprobs: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = 0
        async for tokens, g in self.run(job):
            ids = [t.id for t in tokens]
            n += len(ids)
            meta = self._meta(job, ids, [t.logprob for t in tokens], None if g is None else _finish(g, job), n)
            if g is not None:
                self._final(job, g, meta)
            elif not ids:
                continue
            if not logprobs:
                del meta["output_token_logprobs"]
            await resp.write(sse({"text": self.tok.decode(ids), "output_ids": ids, "meta_info": meta}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _http_abort(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return _error(400, str(exc))
        if body.get("abort_all"):
            n = self.abort_all()
        else:
            rid = body.get("rid")
            if not isinstance(rid, str):
                return _error(400, "rid must be a string (or abort_all: true)")
            n = self.abort(rid)
        return web.json_response({"success": True, "aborted": n})

    async def _http_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object; BadRequest otherwise."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _finish(g: Generation, job: Job) -> dict[str, Any]:
    return {"type": g.finish_reason, "matched": job.matched if g.finish_reason == "stop" else None}


def _version(raw: Any, default: int) -> int:
    if raw is None:
        return default
    try:
        v = int(raw)
    except (TypeError, ValueError):
        raise BadRequest(f"weight version must be an integer, got {raw!r}") from None
    if v < 0:
        raise BadRequest(f"weight version must be >= 0, got {v}")
    return v


def sse(obj: Any) -> bytes:
    """One server-sent event ``data: <json>``."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "BadRequest", "code": status}, status=status)


def build_engine(
    *, seed: int = 0, warmup_steps: int = 0, max_len: int = 256, version: int = 0, max_batch: int = MAX_BATCH
) -> PolicyEngine:
    """The reference policy (``seed``), warm-started for ``warmup_steps`` as the trainer does."""
    set_determinism(seed)
    policy = new_policy(TOKENIZER.vocab_size, seed=seed, max_len=max_len)
    if warmup_steps:
        warm_start(policy, TOKENIZER, steps=warmup_steps, seed=seed)
    policy.eval()
    return PolicyEngine(policy, seed=seed, version=version, max_batch=max_batch)


__all__ = ["BadRequest", "PolicyEngine", "build_engine", "read_json", "sse", "token_ids"]
