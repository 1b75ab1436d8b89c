"""Producer: turns prompts into replay groups of ``group_size`` samples, rolled out on the workers.

Each round claims aborted groups back from the buffer (``claim_retry``),
adds new prompts, places every unfinished session on a worker (sticky),
hands the sessions to that worker's owner tag, runs the samples there, takes
the sessions back and puts each group into the buffer with its status
(one ``replay.put_many`` per round: failed and filtered groups are released
there and then).

Each worker heartbeats its own owner tag (``keep_alive``). When a worker
dies (its node is lost), the groups it had a part in are dropped: their
sessions the producer holds are released (reason ``worker-lost``), those the
dead worker's tag holds are left to gc, which declares the tag lost once its
heartbeat expires (the learner sees to it); groups claimed back that it
had served go the same way (their routed experts died with it).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracestore import Group, TraceStore
from tracestore.gate import status as gate_status
from tracestore.ownership import heartbeat_many, open_sessions, transfer
from tracestore.replay import claim_retry
from tracestore.replay import put_many as rb_put_many
from tracestore.scripts import Op, gather

from .actors import Workers, bulk_idle, lower_priority, node_id
from .clock import Backoff, Stopwatch
from .config import TASK, TrainConfig
from .dispatch import WorkerPool
from .http_agents import HttpStats, gateway_of
from .sample import Sample, from_payload, group_status, to_payload
from .task import make_problem

#: The rollout "worker" of HTTP agents: their sessions are owned by ``rollout:http.<nonce>``.
HTTP = "http"
#: Owner tags of long-lived roles heartbeat: gc reclaims them when a dead trainer is not resumed.
HEARTBEAT_TTL_S = 120.0
#: Status counted for a group dropped because a worker that served it died.
LOST = "lost"


@dataclass(frozen=True)
class Job:
    """A group being rolled out: its id and its samples."""

    gid: str
    samples: list[Sample]


@dataclass(frozen=True)
class ProducerStats:
    """Groups put by status, sessions opened, groups claimed back, time in tracestore and busy.

    ``groups`` counts dropped groups under ``lost`` (a worker that served them
    died); ``lost_workers`` are the workers the producer found dead.
    """

    groups: dict[str, int]
    opened: int
    claimed: int
    store_s: float
    busy_s: float
    #: HTTP agents: what the SDK clients saw (None with local agents).
    http: HttpStats | None = None
    lost_workers: tuple[str, ...] = ()


class Producer:
    """A Ray actor (two threads: :meth:`run_forever` and :meth:`stop` run at once)."""

    def __init__(
        self, cfg: TrainConfig, workers: Workers, start_step: int, gateway_urls: dict[str, str] | None = None
    ) -> None:
        lower_priority(idle=bulk_idle(cfg))  # bulk work: the gateway's event loop goes first (actors.BULK_NICENESS)
        self.cfg = cfg
        #: With --agents http: the session gateways the agents call, by name (else workers run them).
        self.gateway_urls = gateway_urls
        self.http = HttpStats()
        self.store = TraceStore.connect(cfg.url, run=cfg.run)
        self.pool = WorkerPool(self.store, workers)
        self.rng = random.Random(cfg.seed * 7919 + start_step)
        self.nonce = uuid.uuid4().hex[:6]
        self.tag = f"producer.{self.nonce}"
        self.n = 0
        self.counts: dict[str, int] = {}
        self.opened = 0
        self.claimed = 0
        self.store_time = Stopwatch()
        self.busy = Stopwatch()
        self._stop = threading.Event()
        if gateway_urls is None:  # every worker vouches for its own tag: when it dies, gc reclaims it
            self.pool.gather(
                {w: h.keep_alive.remote(self._rollout_tag(w), cfg.owner_ttl_s) for w, h in workers.items()}
            )

    def node_id(self) -> str:
        """The Ray node the producer runs on."""
        return node_id()

    # -- modes -----------------------------------------------------------------------------

    def produce(self, n_completed: int) -> dict[str, int]:
        """Rounds until ``n_completed`` completed groups are in the buffer (colocated mode)."""
        for _ in range(50):
            if self._ready() >= n_completed:
                break
            self.round()
        return dict(self.counts)

    def run_forever(self) -> dict[str, int]:
        """Keep ``max_buffer`` completed groups ready until :meth:`stop` (disaggregated mode).

        Under ``update_mid_generation_s`` (tests) the producer does not pause
        on a full buffer: a round is in flight at every weight update, which
        the knob stops mid-generation (a paused producer made such an update
        stop nothing when the learner was slower than a round). The take
        expires groups past ``max_staleness``, so the buffer stays bounded.
        """
        pause = Backoff()
        always = self.cfg.update_mid_generation_s > 0
        while not self._stop.is_set():
            if not always and self._ready() >= self.cfg.max_buffer:
                pause.sleep()  # the buffer is full until the learner takes: poll less as it lasts
                continue
            pause.reset()
            self.round()
        return dict(self.counts)

    def stop(self) -> None:
        """Make :meth:`run_forever` return after its current round."""
        self._stop.set()

    # -- one round -------------------------------------------------------------------------

    def round(self) -> dict[str, int]:
        """Claim aborted groups back, add new prompts, roll out, put every group; counts by status."""
        with self.busy():
            jobs, version = self._start_round()
            while len(jobs) < self.cfg.prompts_per_step:
                jobs.append(self._new_job())
            done, lost, back = self._roll_out([s for j in jobs for s in j.samples if not s.done], version)
            put = self._put(jobs, done, lost, version, back)
            if put.get("aborted"):  # a weight update is under way: let it finish first
                self._wait_gate_open()
        return put

    def _start_round(self) -> tuple[list[Job], int]:
        """Heartbeat, claim aborted groups back, read the weight version: one round trip.

        Returns the jobs claimed back (those a lost worker served are dropped)
        and the gate's version.
        """
        ctx = self.store.context
        # the workers heartbeat their own tags (keep_alive): when one dies, gc reclaims its tag;
        # HTTP agents' sessions have no worker to vouch for them, so the producer does
        tags = [self.tag, *([self._rollout_tag(HTTP)] if self.gateway_urls is not None else [])]
        with self.store_time():
            calls: list[Op[Any]] = [
                heartbeat_many(ctx, tags, HEARTBEAT_TTL_S),
                claim_retry(ctx, TASK, self.cfg.prompts_per_step, self.tag),
                gate_status(ctx),
            ]
            _beats, groups, gate = self.store.run(gather(calls))
        return self._claimed(groups), int(gate.version)

    def _claimed(self, groups: Sequence[Group]) -> list[Job]:
        """Jobs of the groups claimed back; those a lost worker served are dropped."""
        self.claimed += len(groups)
        jobs = [Job(g.gid, from_payload(g.payload)) for g in groups]
        lost = set(self.pool.lost)
        for job in [j for j in jobs if any(s.worker in lost for s in j.samples)]:
            self._drop(job)  # a worker that served it died: its routed experts are gone
            jobs.remove(job)
        return jobs

    def _new_job(self) -> Job:
        self.n += 1
        gid = f"g-{self.nonce}-{self.n}"
        prob = make_problem(self.rng, f"p{self.n}")
        n = self.cfg.group_size
        return Job(gid, [Sample.new(f"{gid}-{j}", prob, self.cfg.max_calls) for j in range(n)])

    def _roll_out(
        self, samples: Sequence[Sample], version: int
    ) -> tuple[dict[str, Sample], set[str], list[Op[Any]]]:
        """Run ``samples`` on their workers, each owned by the worker's tag meanwhile.

        Returns the samples that came back, the ids of those whose worker
        died meanwhile (their sessions stay with its tag, for gc), and the
        calls that settle the workers' last leases and take the sessions back
        (for :meth:`_put` to run with the put: they share its first round trip).
        """
        if self.gateway_urls is not None:
            over_http, back_http = self._roll_out_http(samples, version)
            return over_http, set(), back_http
        with self.store_time():
            by_worker = self.pool.route(samples)
            ops = [op for w, ss in by_worker.items() for op in self._hand_over_ops(w, ss, version)]
            self.store.run(gather(ops))  # every worker's hand-over: one round trip
        # the workers hand back their last round's leases: settled with the transfers below
        results, settles = self.pool.run_unsettled(by_worker)
        ctx = self.store.context
        back: list[Op[Any]] = [
            *settles,
            *(transfer(ctx, [s.sid for s in out], self._rollout_tag(w), self.tag) for w, out in results.items()),
        ]
        lost = {s.sid for w, ss in by_worker.items() if w not in results for s in ss}
        return {s.sid: s for out in results.values() for s in out}, lost, back

    def _roll_out_http(self, samples: Sequence[Sample], version: int) -> tuple[dict[str, Sample], list[Op[Any]]]:
        """Run ``samples`` as HTTP agents through the gateway, owned by ``rollout:http.<nonce>`` meanwhile.

        Each session goes to one gateway, the same every step (``gateway_of``); the gateway
        routes it to an engine (sticky) and keeps its routed experts, so the samples carry that
        gateway's holder as ``worker``.
        Returns them and the transfer that takes them back (run by :meth:`_put`).
        """
        from .http_agents import run_over_http

        assert self.gateway_urls is not None
        names = list(self.gateway_urls)
        placed = [dataclasses.replace(s, worker=gateway_of(s.sid, names)) for s in samples]
        with self.store_time():
            self._hand_over(HTTP, placed, version)
        out, seen = run_over_http(self.gateway_urls, placed, self.cfg, self._rollout_tag(HTTP))
        self.http.add(seen)
        back: list[Op[Any]] = [transfer(self.store.context, [s.sid for s in out], self._rollout_tag(HTTP), self.tag)]
        return {s.sid: s for s in out}, back

    def _hand_over(self, worker: str, samples: Sequence[Sample], version: int) -> None:
        """Open new sessions for the worker's tag; move continued ones to it from ours (one round trip)."""
        self.store.run(gather(self._hand_over_ops(worker, samples, version)))

    def _hand_over_ops(self, worker: str, samples: Sequence[Sample], version: int) -> list[Op[object]]:
        """The calls of :meth:`_hand_over` (to gather with other workers'); counts the opened sessions."""
        ctx, tag = self.store.context, self._rollout_tag(worker)
        fresh = [s.sid for s in samples if s.status == "new"]
        resumed = [s.sid for s in samples if s.status != "new"]
        calls: list[Op[object]] = []
        if fresh:
            calls.append(open_sessions(ctx, fresh, tag, version=version))
        if resumed:
            calls.append(transfer(ctx, resumed, self.tag, tag))
        self.opened += len(fresh)
        return calls

    def _put(
        self, jobs: Sequence[Job], done: dict[str, Sample], lost: set[str], version: int, back: list[Op[Any]]
    ) -> dict[str, int]:
        """Take the sessions back (``back``) and put every job's group into the buffer with its
        status (one ``put_many``): gathered, two round trips (the transfers share the put's reads,
        and have run before its writes); counts by status.

        A group a dead worker served is dropped instead (counted ``lost``); then the
        sessions are taken back first, so that the drop releases those the live workers served.
        """
        if lost and back:
            with self.store_time():
                self.store.run(gather(back))
            back = []
        counts: dict[str, int] = {}
        groups = []
        for job in jobs:
            if any(s.sid in lost for s in job.samples):
                self._drop(job)
                counts[LOST] = counts.get(LOST, 0) + 1
                continue
            samples = [done.get(s.sid, s) for s in job.samples]
            status = group_status(samples)
            # min_version: put reads it from the sessions' traces (each member's oldest
            # generated token); a group none of whose samples ran a turn gets `version`
            groups.append(
                Group(
                    gid=job.gid,
                    task=TASK,
                    sids=tuple(s.sid for s in samples),
                    status=status,
                    retryable=status == "aborted",
                    payload=to_payload(samples),
                )
            )
        with self.store_time():
            self.store.run(gather([*back, rb_put_many(self.store.context, groups, self.tag, current_version=version)]))
        for g in groups:
            counts[g.status] = counts.get(g.status, 0) + 1
            self.counts[g.status] = self.counts.get(g.status, 0) + 1
        return counts

    def _drop(self, job: Job) -> None:
        """Give up a group a dead worker served: release what we hold of it, retire its routes.

        Its sessions still held by the dead worker's tag are not ours to
        release: gc releases them once the tag's heartbeat expires.
        """
        sids = [s.sid for s in job.samples]
        with self.store_time():
            self.store.release(sids, self.tag, "worker-lost")
            self.pool.router.retire(sids)
        self.counts[LOST] = self.counts.get(LOST, 0) + 1

    # -- store plumbing --------------------------------------------------------------------

    def _rollout_tag(self, worker: str) -> str:
        return f"rollout:{worker}.{self.nonce}"

    def _ready(self) -> int:
        with self.store_time():
            return self.store.replay.count(task=TASK, status="completed")

    def _wait_gate_open(self, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        pause = Backoff()
        while time.monotonic() < end and not self._stop.is_set():
            with self.store_time():
                if self.store.gate.status().state == "open":
                    return
            pause.sleep()

    # -- report ----------------------------------------------------------------------------

    def stats(self) -> ProducerStats:
        """Counters for the report."""
        return ProducerStats(
            groups=dict(self.counts),
            opened=self.opened,
            claimed=self.claimed,
            store_s=self.store_time.seconds,
            busy_s=self.busy.seconds,
            http=self.http if self.gateway_urls is not None else None,
            lost_workers=tuple(self.pool.lost),
        )

    def close(self) -> None:
        """Close the store (the producer's sessions are released by the driver's drain)."""
        self.store.close()
