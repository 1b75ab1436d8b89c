"""The scripted engine's state (``tests/_scripted_engine.py`` serves it): answers, jobs, generation.

:class:`Script` holds the tokenizer of one directory, the queue of scripted
answers, the request log and the running jobs; :meth:`Script.run` "generates"
an answer's ids one by one with the stop, ``max_tokens`` and abort rules the
module docstring of :mod:`tests._scripted_engine` describes. No HTTP here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class BadRequest(ValueError):
    """A request or script the engine refuses (answered 400)."""


@dataclass
class Answer:
    """One scripted answer: ``ids`` (already encoded), whether it ends by stop, its logprobs and delay."""

    ids: list[int]
    text: str | None
    stop: bool = True
    stop_id: int | None = None
    logprobs: list[float] | None = None
    logprob: float = -0.5
    delay_s: float | None = None


@dataclass
class Job:
    """One generation in flight (and its log entry)."""

    rid: str
    api: str
    input_ids: list[int]
    max_tokens: int
    stop_ids: set[int]
    stop: list[str]
    ignore_eos: bool
    stream: bool
    sampling: dict[str, Any]
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    finish: str | None = None
    matched: int | str | None = None
    state: str = "running"
    abort: asyncio.Event = field(default_factory=asyncio.Event)

    def entry(self) -> dict[str, Any]:
        """The ``GET /log`` view of this job."""
        return {
            "rid": self.rid,
            "api": self.api,
            "input_ids": self.input_ids,
            "sampling": self.sampling,
            "stream": self.stream,
            "state": self.state,
            "output_ids": list(self.out),
            "finish": self.finish,
            "matched": self.matched,
        }


def int_list(raw: Any, what: str) -> list[int]:
    """``raw`` as a list of token ids; BadRequest naming ``what`` otherwise."""
    if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw):
        raise BadRequest(f"{what} must be a list of non-negative integers")
    return list(raw)


class Script:
    """The engine's state: tokenizer, answer queue, request log, running jobs."""

    def __init__(self, tokenizer_dir: str, api: str, model: str | None, tok: Any = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.dir = Path(tokenizer_dir)
        # ``tok``: the directory's tokenizer already loaded (an engine served in a test's process)
        self.tok: Any = tok if tok is not None else AutoTokenizer.from_pretrained(tokenizer_dir)
        self.api = api
        self.model = model or self.dir.resolve().name
        meta_path = self.dir / "tracestore_family.json"
        self.meta: dict[str, Any] = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        gen_path = self.dir / "generation_config.json"
        eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
        self.eos_ids = [int(x) for x in (eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])]
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in self.eos_ids:
            self.eos_ids.append(int(self.tok.eos_token_id))
        self.markers = self._tool_markers(self.meta.get("tool_parser"))
        self.queue: list[Answer] = []
        self.default: Answer | None = None
        self.token_delay_s = 0.0
        self.log: list[Job] = []
        self.running: dict[str, Job] = {}
        self.early_aborts: OrderedDict[str, float] = OrderedDict()
        self.version = 0

    @staticmethod
    def _tool_markers(name: Any) -> tuple[str, ...]:
        if not isinstance(name, str):
            return ()
        from tracestore.gateway.parsers import TOOL_PARSERS

        cls = TOOL_PARSERS.get(name)
        return cls.markers if cls is not None and name != "llama3" else ()

    # -- the script ------------------------------------------------------------------------------

    def answer(self, raw: Any) -> Answer:
        """One ``ANSWER`` of a ``POST /script`` body; BadRequest when malformed."""
        if isinstance(raw, str):
            raw = {"text": raw}
        if not isinstance(raw, dict) or ("text" in raw) == ("ids" in raw):
            raise BadRequest("an answer is a text, or an object with exactly one of 'text' and 'ids'")
        text = raw.get("text")
        if text is not None and not isinstance(text, str):
            raise BadRequest("answer 'text' must be a string")
        ids = self.tok.encode(text, add_special_tokens=False) if text is not None else int_list(raw["ids"], "answer 'ids'")
        stop_id = raw.get("stop_id")
        if stop_id is not None and (not isinstance(stop_id, int) or isinstance(stop_id, bool)):
            raise BadRequest("answer 'stop_id' must be an integer")
        lps = raw.get("logprobs")
        if lps is not None and (not isinstance(lps, list) or not all(isinstance(x, (int, float)) for x in lps)):
            raise BadRequest("answer 'logprobs' must be a list of numbers")
        delay = raw.get("delay_s")
        if delay is not None and (not isinstance(delay, (int, float)) or delay < 0):
            raise BadRequest("answer 'delay_s' must be a number >= 0")
        return Answer(
            ids=list(ids),
            text=text if text is not None else self.tok.decode(ids, skip_special_tokens=False),
            stop=bool(raw.get("stop", True)),
            stop_id=stop_id,
            logprobs=[float(x) for x in lps] if lps is not None else None,
            logprob=float(raw.get("logprob", -0.5)),
            delay_s=float(delay) if delay is not None else None,
        )

    def set_script(self, body: dict[str, Any]) -> dict[str, Any]:
        """Apply a ``POST /script`` body (all or nothing); returns the queue length."""
        answers = body.get("answers", [])
        if not isinstance(answers, list):
            raise BadRequest("'answers' must be a list")
        parsed = [self.answer(a) for a in answers]
        default = self.answer(body["default"]) if body.get("default") is not None else None
        delay = body.get("token_delay_s", self.token_delay_s)
        if not isinstance(delay, (int, float)) or delay < 0:
            raise BadRequest("'token_delay_s' must be a number >= 0")
        self.queue = [*self.queue, *parsed] if body.get("append") else parsed
        if "default" in body:
            self.default = default
        self.token_delay_s = float(delay)
        return {"queued": len(self.queue)}

    def next_answer(self) -> Answer:
        """The next scripted answer; BadRequest (answered 500) when the script is empty."""
        if self.queue:
            return self.queue.pop(0)
        if self.default is not None:
            return self.default
        raise LookupError("scripted engine: no answer queued (POST /script first)")

    def stop_id(self, answer: Answer, job: Job) -> int:
        """The id that ends ``answer``: its own, the family's end of (tool) turn, else the first stop id."""
        if answer.stop_id is not None:
            return answer.stop_id
        tool_turn = self.meta.get("end_of_tool_turn")
        if tool_turn is not None and answer.text and any(m in answer.text for m in self.markers):
            return int(tool_turn)
        if self.meta.get("end_of_turn") is not None:
            return int(self.meta["end_of_turn"])
        return min(job.stop_ids) if job.stop_ids else int(self.eos_ids[0])

    # -- generation ------------------------------------------------------------------------------

    def register(self, job: Job) -> None:
        """Log ``job`` and make it abortable; an abort that came first applies now."""
        self.log.append(job)
        self.running[job.rid] = job
        if self.early_aborts.pop(job.rid, None) is not None:
            job.abort.set()

    def abort(self, rid: str | None) -> int:
        """Abort ``rid`` (None: all running); an unknown rid is remembered for when it arrives."""
        if rid is None:
            jobs = list(self.running.values())
        else:
            job = self.running.get(rid)
            jobs = [job] if job is not None else []
            if job is None:
                self.early_aborts[rid] = time.monotonic()
                while len(self.early_aborts) > 10_000:
                    self.early_aborts.popitem(last=False)
        for j in jobs:
            j.abort.set()
        return len(jobs)

    async def run(self, job: Job, answer: Answer) -> AsyncIterator[tuple[int, float]]:
        """Emit ``answer``'s ids one by one until a stop, ``max_tokens``, the script's end or an abort."""
        ids = list(answer.ids)
        if answer.stop and not job.ignore_eos:
            ids.append(self.stop_id(answer, job))
        delay = answer.delay_s if answer.delay_s is not None else self.token_delay_s
        try:
            for i, tid in enumerate(ids):
                if delay > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(job.abort.wait(), delay)
                if job.abort.is_set():
                    job.finish, job.state = "abort", "aborted"
                    return
                lp = answer.logprobs[i] if answer.logprobs is not None and i < len(answer.logprobs) else answer.logprob
                job.out.append(tid)
                job.lps.append(lp)
                yield tid, lp
                if tid in job.stop_ids and not job.ignore_eos:
                    job.finish, job.matched = "stop", tid
                    break
                if job.stop:
                    tail = self.tok.decode(job.out[-64:], skip_special_tokens=False)
                    hit = next((s for s in job.stop if s in tail), None)
                    if hit is not None:
                        job.finish, job.matched = "stop", hit
                        break
                if len(job.out) >= job.max_tokens:
                    job.finish = "length"
                    break
            else:
                job.finish = "length"  # the script ran out without a stop
            job.state = "done"
        except (asyncio.CancelledError, ConnectionError):
            job.finish, job.state = "abort", "aborted"  # the client left (vLLM's abort)
            raise
        finally:
            self.running.pop(job.rid, None)

    def stop_set(self, requested: list[int], ignore_eos: bool) -> set[int]:
        """The ids that end a request: its own stop ids and the model's eos ids (as vLLM and SGLang add them)."""
        return set() if ignore_eos else {*requested, *self.eos_ids}

    def text(self, job: Job, skip_special: bool = False) -> str:
        """The answer's text: the stop id's text left out, cut before a matched stop string."""
        ids = job.out[:-1] if job.finish == "stop" and isinstance(job.matched, int) else job.out
        text = str(self.tok.decode(ids, skip_special_tokens=skip_special))
        if isinstance(job.matched, str) and job.matched in text:
            text = text[: text.index(job.matched)]
        return text

    def piece(self, tid: int) -> str:
        """One token's text (special tokens kept)."""
        return str(self.tok.decode([tid], skip_special_tokens=False))


__all__ = ["Answer", "BadRequest", "Job", "Script", "int_list"]
