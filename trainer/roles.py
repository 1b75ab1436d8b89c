"""The roles of the RL loop: rollout workers, producer, learner (plain classes, run as Ray actors).

Ownership of a rollout session, end to end (DESIGN s5):

``rollout:<worker>.<incarnation>`` (opened by the producer for the worker the
router picked) -> ``producer.<incarnation>`` (transferred back when the worker
returns) -> ``replay``
(``replay.put``; failed and filtered groups are released there and then) ->
``train:<step>`` (``replay.take``) -> released by ``release_owner("train:<step>")``
after the optimiser step. Evaluation sessions are owned by ``eval:<step>``
and released in a ``finally``. Aborted groups (a weight update sealed the gate
mid-episode) go back to the buffer as retryable ``aborted`` groups and are
claimed back (``claim_retry``) and continued on the same worker (sticky route).

Owner tags of long-lived roles carry the process incarnation and heartbeat:
if the whole trainer dies and nobody resumes it, ``tracestore gc`` releases
what they held (reason ``owner-lost``); a resumed trainer uses new tags, so
an owner that gc declared lost never blocks it.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from tracestore import GateSealed, TraceStore
from tracestore.session import TurnRecorder

from . import deps
from .chat import render, strip_stop
from .config import TASK, TrainConfig
from .grpo import IGNORE, TrainSample, collate, group_advantages, train_step
from .policy import load_numpy_state, new_policy, replay_logprobs, set_determinism, state_to_numpy
from .task import Episode, Problem, make_problem
from .tokenizer import TOKENIZER as TOK

Sample = dict[str, Any]
HEARTBEAT_TTL_S = 120.0


class Clock:
    """Seconds spent inside tracestore calls (summed by :class:`Timed`)."""

    def __init__(self) -> None:
        self.s = 0.0
        self.calls = 0


class Timed:
    """Proxy that times every method call of a tracestore object (store, gate, router)."""

    _SUB = frozenset({"gate", "replay"})

    def __init__(self, target: Any, clock: Clock) -> None:
        self._t = target
        self._c = clock

    def __getattr__(self, name: str) -> Any:
        v = getattr(self._t, name)
        if name in self._SUB:
            return Timed(v, self._c)
        if not callable(v):
            return v
        clock = self._c

        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return v(*a, **kw)
            finally:
                clock.s += time.perf_counter() - t0
                clock.calls += 1

        return call


def connect(cfg: TrainConfig) -> TraceStore:
    return TraceStore.connect(cfg.url, run=cfg.run)


def final_key(messages: Sequence[dict[str, str]]) -> str:
    """Key of a finished episode's last response node (conversation up to its last answer)."""
    return render(messages, False).rstrip()


# -- rollout worker ---------------------------------------------------------------------------


class _Aborted(Exception):
    """The engine aborted the request (a weight update is coming)."""


class RolloutWorker:
    """A policy copy plus a session server: gate lease per request, TurnRecorder, RefHolder."""

    def __init__(self, cfg_json: dict[str, Any], name: str) -> None:
        self.cfg = TrainConfig.from_json(cfg_json)
        self.name = name
        set_determinism(self.cfg.seed)
        self.clock = Clock()
        self.raw_store = connect(self.cfg)
        self.store: Any = Timed(self.raw_store, self.clock)
        self.holder = deps.new_holder(self.raw_store, f"holder-{name}")
        self.recorder = TurnRecorder(cast(TraceStore, self.store), render, TOK.encode, self.holder)
        self.policy = new_policy(TOK.vocab_size, seed=self.cfg.seed, max_len=256)
        self.version = -1
        self.gen = torch.Generator().manual_seed(self.cfg.seed * 1000 + sum(map(ord, name)))
        self.turn_s: list[float] = []
        self.busy_s = 0.0
        self.aborted_requests = 0
        self._abort = threading.Event()

    def abort_requests(self) -> None:
        """Abort generation in flight (before a weight update); cleared by :meth:`set_weights`.

        An aborted request records nothing, its lease is settled ``aborted``
        and its episode returns as ``aborted``, to be claimed back and
        continued after the update. Safe to call from another thread (the
        actor is threaded).
        """
        self._abort.set()

    def set_weights(self, state: dict[str, np.ndarray], version: int) -> int:
        # the gate is sealed and drained here: no lease is live, so no generation runs
        load_numpy_state(self.policy, state)
        self.version = version
        self._abort.clear()
        return version

    def get_refs(self, keys: list[str]) -> list[Any]:
        """Lend the ObjectRefs of ``keys`` (the caller borrows them; Ray counts the borrow)."""
        return deps.holder_get(self.holder, keys)

    def stats(self) -> dict[str, Any]:
        st = deps.holder_stats(self.holder)
        return {
            "holder": st,
            "turn_s": list(self.turn_s),
            "store_s": self.clock.s + self.recorder.stats.holder_s,
            "busy_s": self.busy_s,
            "invalid": self.recorder.stats.invalid,
            "aborted_requests": self.aborted_requests,
        }

    def close(self) -> None:
        deps.close_holder(self.holder)
        self.raw_store.close()

    def run(self, samples: list[Sample], temperature: float = 1.0) -> list[Sample]:
        """Continue every unfinished sample until it ends, aborts (gate sealed) or fails."""
        t_start = time.perf_counter()
        try:
            return [self._episode(s, temperature) for s in samples]
        finally:
            self.busy_s += time.perf_counter() - t_start

    def _episode(self, s: Sample, temperature: float) -> Sample:
        s = dict(s)
        if s.get("done"):
            return s
        ep = Episode(
            Problem.from_json(s["problem"]),
            max_calls=self.cfg.max_calls,
            messages=[dict(m) for m in s["messages"]],
            value=s["value"],
            calls=s["calls"],
            turns=s["turns"],
        )
        sid = s["sid"]
        versions: list[int] = list(s.get("versions", []))
        s["status"] = "running"
        while not ep.done:
            try:
                lease = self.store.gate.admit(sid, self.name, self.cfg.lease_ttl_s)
            except GateSealed:
                s["status"] = "aborted"
                break
            t0 = time.perf_counter()
            try:
                ids = self.recorder.before_request(sid, ep.messages)
                gen = self.policy.generate(
                    ids,
                    max_new_tokens=self.cfg.max_new_tokens,
                    stop_id=TOK.stop_id,
                    generator=self.gen,
                    temperature=temperature,
                    should_abort=self._abort.is_set,
                )
                if gen.finish_reason == "abort":
                    raise _Aborted
                content, stopped = strip_stop(TOK.decode(gen.output_ids))
                assistant = {"role": "assistant", "content": content}
                self.recorder.after_response(
                    sid,
                    ep.messages,
                    assistant,
                    gen.output_ids,
                    gen.logprobs,
                    gen.routed_experts,
                    lease.version,
                )
            except _Aborted:  # nothing recorded: the turn is redone after the update
                self.recorder.forget(sid)
                self.store.gate.settle(lease, "aborted")
                self.aborted_requests += 1
                s["status"] = "aborted"
                break
            except Exception as exc:  # the request failed: its outcome is known, say so
                self.recorder.forget(sid)
                self.store.gate.settle(lease, "failed")
                s["status"], s["error"] = "failed", f"{type(exc).__name__}: {exc}"
                break
            self.store.gate.settle(lease, "completed")
            self.turn_s.append(time.perf_counter() - t0)
            versions.append(lease.version)
            obs = ep.step(content, stopped)
            ep.messages.append(assistant)
            if obs is not None:
                ep.messages.append(obs)
        s.update(
            messages=ep.messages,
            value=ep.value,
            calls=ep.calls,
            turns=ep.turns,
            done=ep.done,
            versions=versions,
            reward=ep.reward if ep.done else 0.0,
            finish=ep.finish,
        )
        if ep.done and s["status"] == "running":
            s["status"] = "completed"
        return s


# -- producer -------------------------------------------------------------------------------


def new_sample(sid: str, prob: Problem, cfg: TrainConfig) -> Sample:
    """A fresh episode of ``prob`` in session ``sid``, not started yet."""
    ep = Episode(prob, max_calls=cfg.max_calls)
    return {
        "sid": sid,
        "problem": prob.to_json(),
        "messages": ep.messages,
        "value": ep.value,
        "calls": 0,
        "turns": 0,
        "done": False,
        "status": "new",
        "versions": [],
    }


def group_status(samples: Sequence[Sample]) -> str:
    """XTuner's priority: failed > aborted > filtered (no reward spread) > completed."""
    st = [s["status"] for s in samples]
    if "failed" in st:
        return "failed"
    if any(x != "completed" for x in st):
        return "aborted"
    rewards = [s["reward"] for s in samples]
    if max(rewards) - min(rewards) < 1e-9:
        return "filtered"
    return "completed"


class Producer:
    """Groups ``group_size`` samples per prompt, runs them on the workers, fills the buffer."""

    def __init__(self, cfg_json: dict[str, Any], workers: dict[str, Any], start_step: int) -> None:
        import ray

        self._ray = ray
        self.cfg = TrainConfig.from_json(cfg_json)
        self.workers = workers
        self.clock = Clock()
        self.raw_store = connect(self.cfg)
        self.store: Any = Timed(self.raw_store, self.clock)
        self.router: Any = Timed(self.raw_store.router(sorted(workers)), self.clock)
        self.rng = random.Random(self.cfg.seed * 7919 + start_step)
        self.nonce = uuid.uuid4().hex[:6]
        self.tag = f"producer.{self.nonce}"
        self.n = 0
        self.counts: dict[str, int] = {}
        self.opened = 0
        self.claimed = 0
        self.busy_s = 0.0
        self._stop = threading.Event()

    def _new_group(self) -> tuple[str, list[Sample]]:
        self.n += 1
        gid = f"g-{self.nonce}-{self.n}"
        prob = make_problem(self.rng, f"p{self.n}")
        samples = [new_sample(f"{gid}-{j}", prob, self.cfg) for j in range(self.cfg.group_size)]
        return gid, samples

    def round(self) -> dict[str, int]:
        """One round: claim aborted groups back, add new prompts, roll out, put every group."""
        t0 = time.perf_counter()
        try:
            return self._round()
        finally:
            self.busy_s += time.perf_counter() - t0

    def _rollout_tag(self, worker: str) -> str:
        return f"rollout:{worker}.{self.nonce}"

    def _heartbeat(self) -> None:
        for tag in (self.tag, *(self._rollout_tag(w) for w in self.workers)):
            self.store.heartbeat(tag, HEARTBEAT_TTL_S)

    def _round(self) -> dict[str, int]:
        cfg = self.cfg
        self._heartbeat()
        jobs: list[tuple[str, list[Sample]]] = []
        for g in deps.replay_claim_retry(self.store, TASK, cfg.prompts_per_step, self.tag):
            jobs.append((g.gid, [dict(s) for s in g.payload["samples"]]))
            self.claimed += 1
        while len(jobs) < cfg.prompts_per_step:
            jobs.append(self._new_group())
        version = self.store.gate.status().version
        by_worker: dict[str, list[Sample]] = {}
        fresh: dict[str, list[str]] = {}
        resumed: dict[str, list[str]] = {}
        for _, samples in jobs:
            for s in samples:
                if s.get("done"):
                    continue
                w = self.router.acquire(s["sid"])  # sticky: a continued session keeps its worker
                s["worker"] = w
                by_worker.setdefault(w, []).append(s)
                (fresh if s["status"] == "new" else resumed).setdefault(w, []).append(s["sid"])
        for w, sids in fresh.items():
            self.store.open_sessions(sids, self._rollout_tag(w), version=version)
            self.opened += len(sids)
        for w, sids in resumed.items():
            self.store.transfer(sids, self.tag, self._rollout_tag(w))
        calls = {w: self.workers[w].run.remote(ss) for w, ss in by_worker.items()}
        done: dict[str, Sample] = {}
        for w, ref in calls.items():
            out = self._ray.get(ref)
            self.store.transfer([s["sid"] for s in out], self._rollout_tag(w), self.tag)
            done.update({s["sid"]: s for s in out})
        stats: dict[str, int] = {}
        for gid, samples in jobs:
            samples = [done.get(s["sid"], s) for s in samples]
            status = group_status(samples)
            vs = [v for s in samples for v in s.get("versions", [])]
            group = deps.make_group(
                gid,
                TASK,
                [s["sid"] for s in samples],
                status,
                min(vs) if vs else version,
                status == "aborted",
                {"samples": samples},
            )
            deps.replay_put(self.store, group, self.tag)
            stats[status] = stats.get(status, 0) + 1
            self.counts[status] = self.counts.get(status, 0) + 1
        if stats.get("aborted"):
            self._wait_gate_open()
        return stats

    def _wait_gate_open(self, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not self._stop.is_set():
            if self.store.gate.status().state == "open":
                return
            time.sleep(0.02)

    def produce(self, n_completed: int) -> dict[str, int]:
        """Rounds until ``n_completed`` completed groups are in the buffer (colocated mode)."""
        for _ in range(50):
            if deps.replay_count(self.store, TASK, "completed") >= n_completed:
                break
            self.round()
        return dict(self.counts)

    def run_forever(self) -> dict[str, int]:
        """Keep the buffer filled until :meth:`stop` (disaggregated mode)."""
        while not self._stop.is_set():
            if deps.replay_count(self.store, TASK, "completed") >= self.cfg.max_buffer:
                time.sleep(0.02)
                continue
            self.round()
        return dict(self.counts)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        return {
            "groups": dict(self.counts),
            "opened": self.opened,
            "claimed": self.claimed,
            "store_s": self.clock.s,
            "busy_s": self.busy_s,
        }

    def close(self) -> None:
        self.raw_store.close()


# -- learner ----------------------------------------------------------------------------------


class SimulatedCrash(RuntimeError):
    """Raised after the checkpoint of ``crash_after_step`` (tests of resume)."""


class Learner:
    """Takes ``train:<step>`` batches, trains with routing replay, syncs weights through the gate."""

    def __init__(self, cfg_json: dict[str, Any], workers: dict[str, Any]) -> None:
        import ray

        self._ray = ray
        self.cfg = TrainConfig.from_json(cfg_json)
        self.workers = workers
        set_determinism(self.cfg.seed)
        self.clock = Clock()
        self.raw_store = connect(self.cfg)
        self.store: Any = Timed(self.raw_store, self.clock)
        self.router: Any = Timed(self.raw_store.router(sorted(workers)), self.clock)
        self.model = new_policy(TOK.vocab_size, seed=self.cfg.seed, max_len=256)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.cfg.lr)
        self.version = 0
        self.history: list[dict[str, Any]] = []
        self.gate_cycles = 0
        self.busy_s = 0.0
        self.replay_fallbacks = 0
        self.baseline_eval: float | None = None

    # setup ---------------------------------------------------------------------------------

    def init(self, resume_state: dict[str, Any] | None, model_path: str | None) -> int:
        """Warm start (or load a checkpoint), push weights to the workers; returns the next step."""
        start = 1
        if resume_state is not None and model_path is not None:
            ck = torch.load(model_path, weights_only=True)
            self.model.load_state_dict(ck["model"])
            self.opt.load_state_dict(ck["optimizer"])
            self.history = list(resume_state["history"])
            self.gate_cycles = int(resume_state.get("gate_cycles", 0))
            self.baseline_eval = resume_state.get("baseline_eval")
            start = int(resume_state["step"]) + 1
        else:
            from .warmup import warm_start

            warm_start(self.model, TOK, steps=self.cfg.warmup_steps, seed=self.cfg.seed)
        self.version = int(self.store.gate.status().version)
        self._push(self.version)
        if start == 1:
            self.baseline_eval = self.evaluate(0)  # the warm-started policy, before RL
        return start

    def _push(self, version: int) -> None:
        ref = self._ray.put(state_to_numpy(self.model))
        self._ray.get([w.set_weights.remote(ref, version) for w in self.workers.values()])
        del ref

    # one step -------------------------------------------------------------------------------

    def step(self, step: int, wait_s: float = 60.0) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return self._step(step, wait_s)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _take(self, owner: str, wait_s: float) -> list[Any]:
        end = time.monotonic() + wait_s
        while True:
            groups = deps.replay_take(
                self.store,
                TASK,
                self.cfg.prompts_per_step,
                owner=owner,
                current_version=self.version,
                max_staleness=self.cfg.max_staleness,
            )
            if groups or time.monotonic() > end:
                return groups
            time.sleep(0.02)

    def _fetch_routing(self, wanted: list[tuple[str, list[str]]]) -> list[list[Any] | None]:
        """Routed-expert parts of each ``(worker, keys)``: one borrow call per worker, one get.

        None for a trace whose keys are lost (restored checkpoint) or whose
        holder no longer has them (worker restarted): that sample trains
        without routing replay.
        """
        by_worker: dict[str, list[str]] = {}
        for w, keys in wanted:
            if keys and not any(deps.expert_key_lost(k) for k in keys):
                by_worker.setdefault(w, []).extend(keys)
        lent: dict[str, Any] = {}
        for w, keys in by_worker.items():
            try:
                refs = self._ray.get(self.workers[w].get_refs.remote(keys))
                lent.update(zip(keys, self._ray.get(refs), strict=True))
                del refs
            except Exception:
                self.replay_fallbacks += 1
        return [
            [lent[k] for k in keys] if keys and all(k in lent for k in keys) else None
            for _, keys in wanted
        ]

    def _step(self, step: int, wait_s: float) -> dict[str, Any]:
        owner = f"train:{step}"
        t_take = time.perf_counter()
        groups = self._take(owner, wait_s)
        wait = time.perf_counter() - t_take
        if not groups:
            ready = deps.replay_count(self.store, TASK, "completed")
            raise RuntimeError(
                f"step {step}: no batch of {self.cfg.prompts_per_step} groups within {wait_s}s "
                f"({ready} ready; every group filtered, i.e. the policy collapsed, or the "
                "producer stalled)"
            )
        rewards: list[float] = []
        staleness: list[int] = []
        sids: list[str] = []
        rows: list[tuple[Any, float]] = []
        wanted: list[tuple[str, list[str]]] = []
        for g in groups:
            ss = g.payload["samples"]
            adv = group_advantages([s["reward"] for s in ss])
            staleness.append(self.version - int(g.min_version))
            for s, a in zip(ss, adv, strict=True):
                sids.append(s["sid"])
                rewards.append(float(s["reward"]))
                tr = self.store.export_training_trace(s["sid"], final_key(s["messages"]))
                rows.append((tr, a))
                wanted.append((s["worker"], list(tr.expert_keys or [])))
        samples: list[TrainSample] = []
        same_version: list[int] = []
        for (tr, a), parts in zip(rows, self._fetch_routing(wanted), strict=True):
            routing = None
            if parts is not None:
                routing = np.concatenate([np.asarray(p) for p in parts])[1:].astype(np.int64)
                if routing.shape[0] != len(tr.input_ids) - 1:
                    routing = None
            if routing is not None and min(tr.versions) == max(tr.versions) == self.version:
                same_version.append(len(samples))
            samples.append(
                TrainSample(
                    np.asarray(tr.input_ids, dtype=np.int64),
                    np.asarray(tr.labels, dtype=np.int64),
                    np.asarray(tr.logprobs, dtype=np.float32),
                    routing,
                    a,
                )
            )
        del rows, wanted
        align = self._alignment(samples, same_version)
        stats = train_step(self.model, self.opt, samples, TOK.pad_id)
        released = self.store.release_owner(owner, "trained")
        self.router.retire(sids)
        synced = False
        if step % self.cfg.sync_every == 0:
            new = self.version + 1
            # seal + drain before the body and install + reopen after it are tracestore time
            # like an engine pause: abort generation in flight, so the drain is short
            self._ray.get([w.abort_requests.remote() for w in self.workers.values()])
            t0 = time.perf_counter()
            with self.raw_store.gate.weight_update(new, self.cfg.drain_timeout_s):
                t1 = time.perf_counter()
                self._push(new)
                t2 = time.perf_counter()
            self.clock.s += (t1 - t0) + (time.perf_counter() - t2)
            self.version = new
            self.gate_cycles += 1
            synced = True
        rec: dict[str, Any] = {
            "step": step,
            "reward": float(np.mean(rewards)),
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": int(max(staleness)),
            "groups": len(groups),
            "samples": len(samples),
            "released": len(released),
            "taken": len(sids),
            "loss": stats["loss"],
            "approx_kl": stats["approx_kl"],
            "replay_max_abs_diff": align,
            "version": self.version,
            "synced": synced,
            "wait_s": wait,
        }
        if step % self.cfg.eval_every == 0 or step == self.cfg.steps:
            rec["eval_reward"] = self.evaluate(step)
        self.history.append(rec)
        return rec

    def _alignment(self, samples: list[TrainSample], idx: list[int]) -> float | None:
        """Max |replayed - rollout| logprob over generated tokens of samples made by these weights."""
        chosen = [samples[i] for i in idx if samples[i].routing is not None]
        if not chosen:
            return None
        batch = collate(chosen, TOK.pad_id)
        with torch.no_grad():
            lp = replay_logprobs(self.model, batch.input_ids, batch.routing)
        diff = (lp - batch.old_logprobs).abs() * batch.mask
        return float(diff.max())

    def evaluate(self, step: int) -> float:
        """The same ``eval_prompts`` problems each time, one sample each at ``eval_temperature``.

        Sessions are owned by ``eval:<step>`` and released in a ``finally``
        (only those: replay-owned sessions are never touched).
        """
        owner = f"eval:{step}"
        rng = random.Random(10_000 + self.cfg.seed)  # the same problems every time
        nonce = uuid.uuid4().hex[:6]
        samples: list[Sample] = []
        for i in range(self.cfg.eval_prompts):
            prob = make_problem(rng, f"e{i}")
            samples.append(new_sample(f"eval-{step}-{nonce}-{i}", prob, self.cfg))
        sids = [s["sid"] for s in samples]
        try:
            self.store.open_sessions(sids, owner, version=self.version)
            by_worker: dict[str, list[Sample]] = {}
            for s in samples:
                by_worker.setdefault(self.router.acquire(s["sid"]), []).append(s)
            calls = [
                self.workers[w].run.remote(ss, self.cfg.eval_temperature)
                for w, ss in by_worker.items()
            ]
            out = [s for ref in calls for s in self._ray.get(ref)]
            return float(np.mean([s["reward"] for s in out]))
        finally:
            self.store.release_owner(owner, "eval-done")
            self.router.retire(sids)

    # checkpoint --------------------------------------------------------------------------------

    def checkpoint(self, step: int, directory: str) -> dict[str, Any]:
        """Model + optimizer (torch.save of tensors only) and the store; state.json written last."""
        import json
        import os

        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, "model.pt.tmp")
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, tmp)
        os.replace(tmp, os.path.join(directory, "model.pt"))
        deps.checkpoint_store(self.raw_store, os.path.join(directory, "store.ckpt"))
        state = {
            "step": step,
            "version": self.version,
            "history": self.history,
            "gate_cycles": self.gate_cycles,
            "baseline_eval": self.baseline_eval,
            "cfg": self.cfg.to_json(),
        }
        tmp = os.path.join(directory, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(directory, "state.json"))
        return state

    def stats(self) -> dict[str, Any]:
        return {
            "store_s": self.clock.s,
            "busy_s": self.busy_s,
            "gate_cycles": self.gate_cycles,
            "version": self.version,
            "replay_fallbacks": self.replay_fallbacks,
            "baseline_eval": self.baseline_eval,
        }

    def close(self) -> None:
        self.raw_store.close()


__all__ = [
    "IGNORE",
    "Clock",
    "Learner",
    "Producer",
    "RolloutWorker",
    "SimulatedCrash",
    "Timed",
    "final_key",
    "group_status",
]
