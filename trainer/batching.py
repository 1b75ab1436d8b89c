"""Continuous batching of the reference policy: requests join and leave a running batch between decode steps.

One thread (``engine``) owns the policy and runs a loop of steps:

1. admit one waiting request: its prompt runs through the model on its own
   (the prefill), which gives its first logits and its KV cache;
2. sample one token for every running request (each with its own
   ``torch.Generator`` when it has a seed), hand it to the request's
   ``emit`` callback (a stream), and retire the requests that stopped, hit
   their budget or were aborted (:attr:`Job.abort`, checked before every
   token, as :meth:`~trainer.policy.MoEPolicy.generate` does);
3. feed the sampled tokens of the requests still running through the model
   in one batched forward: the rows share one KV cache, left-padded to the
   longest row, each row at its own position with a key mask over its
   padding (:meth:`~trainer.policy.MoEPolicy.forward`).

A request's result is what :meth:`MoEPolicy.generate` returns for it: the
same sampling code on the same logits (a lone request goes through the
very same operations, so its result is bitwise the same; in a batch with
padding, float rounding of the batched matmuls and the masked attention
may move logprobs by ~1e-6, and so a token only where two candidates tie
to that precision).

Weight loads (:meth:`Batcher.call`) run between steps, once the running
batch has drained: no new request is admitted while a load waits, so every
generation comes from one weight version (the one it reports).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch import Tensor

from .policy import Generation, KVCache, MoEPolicy
from .tokenizer import TOKENIZER

T = TypeVar("T")

#: Default most requests decoded together (more wait for a free row).
MAX_BATCH = 64


class Sampled(NamedTuple):
    """One generated token: its id, its logprob, when asked the top alternatives ``(id, logprob)``,
    and whether it is the last (its generation's result follows at once)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    last: bool = False


@dataclass
class Job:
    """One generation request, as the engine's HTTP shapes parse it.

    ``stop_ids``: token ids that end it (an empty set: only the budget
    does); ``stop``: stop strings (matched anywhere in the text a token
    completes); ``seed``: its own sampling generator (None: the engine's
    shared one); ``top_n``: alternatives to report per token. Set by the
    engine: ``matched`` (the stop id or string that ended it), ``version``
    (weights it ran with), ``emit`` (called from the engine thread with
    each :class:`Sampled`).
    """

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    stop_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_n: int = 0
    experts: bool = False
    abort: threading.Event = field(default_factory=threading.Event)
    emit: Callable[[Sampled], None] | None = None
    matched: int | str | None = None
    version: int = 0


@dataclass
class _Row:
    """A running request: its state between steps."""

    job: Job
    future: Future[Generation]
    gen: torch.Generator
    budget: int
    logits: Tensor  # [V]: the next token's
    routing: list[Tensor]  # [n, layers, k] pieces: the rows of every token fed
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    cache: KVCache | None = None  # its own, until it joins the batch's


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


class Batcher:
    """The engine thread and its running batch over ``policy`` (see the module docstring).

    ``seed`` seeds the generator shared by requests without their own;
    ``version`` is the initial weight version; ``max_batch`` bounds the
    requests decoded together. :meth:`close` stops the thread.
    """

    def __init__(self, policy: MoEPolicy, *, seed: int = 0, version: int = 0, max_batch: int = MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.policy = policy
        self.version = version
        self.max_batch = max_batch
        self.aborted = 0
        #: Tokens sampled, decode steps run, and the most rows one step fed (tests, benchmarks).
        self.tokens = 0
        self.steps = 0
        self.widest = 0
        self._gen = torch.Generator().manual_seed(seed)
        self._cv = threading.Condition()
        self._waiting: deque[tuple[Job, Future[Generation]]] = deque()
        self._calls: deque[_Call] = deque()
        self._rows: list[_Row] = []  # the batch, in cache row order
        self._cache: KVCache | None = None  # [B, heads, L, d] per layer, left-padded
        self._mask: Tensor | None = None  # [B, L] bool: which cache columns are a row's
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- the API (any thread) ---------------------------------------------------------------

    def submit(self, job: Job) -> Future[Generation]:
        """Queue ``job``; the future resolves to its :class:`Generation` (ValueError: it cannot run).

        Raises ValueError at once for an empty prompt, a negative
        temperature or a prompt that leaves no room under ``max_len``.
        """
        if not job.input_ids:
            raise ValueError("empty prompt")
        if not job.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {job.temperature}")
        room = self.policy.cfg.max_len - len(job.input_ids)
        if room <= 0:
            raise ValueError(
                f"prompt of {len(job.input_ids)} tokens leaves no room (max_len {self.policy.cfg.max_len})"
            )
        fut: Future[Generation] = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine is closed")
            self._waiting.append((job, fut))
            self._cv.notify()
        return fut

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread between steps, once the running batch has drained.

        No request is admitted while a call waits (so a weight load never
        splits a generation between two versions); the future has ``fn``'s
        result or exception.
        """
        fut: Future[T] = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine is closed")
            self._calls.append(_Call(fn, fut))
            self._cv.notify()
        return fut

    def running(self) -> int:
        """Requests in the batch now (not counting those waiting)."""
        return len(self._rows)

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort every request, stop the thread and join it."""
        with self._cv:
            self._stopped = True
            for job, _ in self._waiting:
                job.abort.set()
            for row in self._rows:
                row.job.abort.set()
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # -- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._waiting or self._rows or self._calls):
                    self._cv.wait()
                if self._stopped and not self._rows and not self._waiting:
                    break
                call = self._calls.popleft() if self._calls and not self._rows else None
                admit = None
                if call is None and not self._calls and self._waiting and len(self._rows) < self.max_batch:
                    admit = self._waiting.popleft()
            if call is not None:
                self._run_call(call)
                continue
            try:
                if admit is not None:
                    self._prefill(*admit)
                if self._rows:
                    self._step()
            except Exception as exc:  # a broken step fails the requests it held, not the engine
                self._fail_all(exc)
        for call in self._calls:
            call.future.set_exception(RuntimeError("the engine is closed"))

    def _run_call(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            call.future.set_result(call.fn())
        except BaseException as exc:
            call.future.set_exception(exc)

    def _prefill(self, job: Job, fut: Future[Generation]) -> None:
        """Run a newcomer's prompt on its own; it joins the sampling of this step."""
        if not fut.set_running_or_notify_cancel():
            return
        job.version = self.version
        if job.abort.is_set():  # aborted while it waited: it never ran
            self._finish(_Row(job, fut, self._gen, 0, torch.empty(0), []), "abort")
            return
        gen = torch.Generator().manual_seed(job.seed) if job.seed is not None else self._gen
        budget = min(job.max_new_tokens, self.policy.cfg.max_len - len(job.input_ids))
        with torch.no_grad():
            logits, used, cache = self.policy(torch.tensor([job.input_ids], dtype=torch.long))
        row = _Row(job, fut, gen, budget, logits[0, -1], [torch.zeros_like(used[0, :1]), used[0]])
        row.cache = cache
        self._rows.append(row)

    def _step(self) -> None:
        """Sample a token for every row, retire the finished ones, feed the rest in one forward."""
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            job = row.job
            if job.abort.is_set():
                self._finish(row, "abort")
                continue
            tok, lp, top = self._sample(row)
            self.tokens += 1
            row.out_ids.append(tok)
            row.out_lps.append(lp)
            matched: int | str | None = self._stop_string(row)
            if matched is None and tok in job.stop_ids:
                matched = tok
            finish = "stop" if matched is not None else "length" if len(row.out_ids) >= row.budget else None
            if job.emit is not None:
                try:
                    job.emit(Sampled(tok, lp, top, finish is not None))
                except Exception:  # a consumer that cannot take tokens (its loop closed) breaks no batch
                    job.emit = None
            if finish is None:
                keep.append(i)
                continue
            job.matched = matched
            self._finish(row, finish)
        self._retain(keep)
        if self._rows:
            self._feed()

    def _sample(self, row: _Row) -> tuple[int, float, tuple[tuple[int, float], ...]]:
        # the operations of MoEPolicy.generate, on this row's logits
        temperature = row.job.temperature
        if temperature == 0:
            logp = torch.log_softmax(row.logits, dim=-1)
            tok = int(logp.argmax().item())
        else:
            logp = torch.log_softmax(row.logits / temperature, dim=-1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=row.gen).item())
        top: tuple[tuple[int, float], ...] = ()
        if row.job.top_n > 0:
            vals, idx = logp.topk(min(row.job.top_n, logp.shape[-1]))
            top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))
        return tok, float(logp[tok].item()), top

    @staticmethod
    def _stop_string(row: _Row) -> str | None:
        stop = row.job.stop
        if not stop:
            return None
        # an earlier occurrence would have stopped it earlier: any occurrence in the tail is new
        tail = TOKENIZER.decode(row.out_ids[-64:])
        return next((s for s in stop if s in tail), None)

    def _retain(self, keep: list[int]) -> None:
        """Drop the finished rows from the batch and its cache (and columns no row uses any more)."""
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if self._cache is None or self._mask is None:
            return
        joined = [i for i in keep if i < self._mask.shape[0]]  # newcomers are not in the cache yet
        if not joined:
            self._cache = self._mask = None
            return
        sel = torch.tensor(joined, dtype=torch.long)
        mask = self._mask.index_select(0, sel)
        first = int(mask.any(0).to(torch.int8).argmax())
        self._mask = mask[:, first:]
        self._cache = [(k.index_select(0, sel)[:, :, first:], v.index_select(0, sel)[:, :, first:]) for k, v in self._cache]

    def _join(self) -> None:
        """Merge the caches of newcomers (rows after the batch's) into the batch's, left-padded."""
        n = 0 if self._mask is None else self._mask.shape[0]
        new = self._rows[n:]
        if not new:
            return
        parts: list[tuple[KVCache, Tensor]] = []
        if self._cache is not None and self._mask is not None:
            parts.append((self._cache, self._mask))
        for row in new:
            assert row.cache is not None
            parts.append((row.cache, torch.ones(1, row.cache[0][0].shape[2], dtype=torch.bool)))
            row.cache = None
        width = max(m.shape[1] for _, m in parts)

        def pad(x: Tensor, dim: int) -> Tensor:
            missing = width - x.shape[dim]
            if missing == 0:
                return x
            shape = list(x.shape)
            shape[dim] = missing
            return torch.cat([torch.zeros(shape, dtype=x.dtype), x], dim=dim)

        layers = len(parts[0][0])
        self._cache = [
            (
                torch.cat([pad(c[layer][0], 2) for c, _ in parts], dim=0),
                torch.cat([pad(c[layer][1], 2) for c, _ in parts], dim=0),
            )
            for layer in range(layers)
        ]
        self._mask = torch.cat([pad(m, 1) for _, m in parts], dim=0)

    def _feed(self) -> None:
        """One batched forward of every row's last sampled token."""
        self._join()
        assert self._cache is not None and self._mask is not None
        rows = self._rows
        ids = torch.tensor([[r.out_ids[-1]] for r in rows], dtype=torch.long)
        positions = torch.tensor([[len(r.job.input_ids) + len(r.out_ids) - 1] for r in rows], dtype=torch.long)
        mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
        padded = not bool(mask.all())
        with torch.no_grad():
            logits, used, self._cache = self.policy(
                ids, cache=self._cache, positions=positions, key_mask=mask if padded else None
            )
        self._mask = mask
        self.steps += 1
        self.widest = max(self.widest, len(rows))
        for b, row in enumerate(rows):
            row.logits = logits[b, -1]
            row.routing.append(used[b])

    def _finish(self, row: _Row, reason: str) -> None:
        job = row.job
        if reason == "abort":
            self.aborted += 1
        if reason != "stop":
            job.matched = None
        n_rows = len(job.input_ids) + len(row.out_ids)  # an abort may have fed one more token
        if row.routing:
            experts = torch.cat(row.routing, dim=0)[:n_rows].to(torch.int32).numpy()
        else:  # aborted before it ran: only the dummy row
            cfg = self.policy.cfg
            experts = np.zeros((1, cfg.n_layers, cfg.top_k), dtype=np.int32)
        row.future.set_result(Generation(row.out_ids, row.out_lps, experts, reason))

    def _fail_all(self, exc: Exception) -> None:
        for row in self._rows:
            if not row.future.done():
                row.future.set_exception(exc)
        self._rows = []
        self._cache = self._mask = None


__all__ = ["MAX_BATCH", "Batcher", "Job", "Sampled"]
