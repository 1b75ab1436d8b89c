"""Prometheus metrics of one gateway (``GET /metrics``), in a registry of their own.

Every name starts with ``tracestore_gateway_``:

==============================  =========  ==============================================
metric                          type       labels / meaning
==============================  =========  ==============================================
``requests_total``              counter    ``route``, ``status``: requests answered
``in_flight``                   gauge      requests being served now
``sealed_total``                counter    ``reason``: 503s (``gate_sealed`` refused at
                                           admission, ``weight_update`` aborted in flight)
``gone_total``                  counter    ``reason``: 410s (``retired``, ``released``)
``aborted_total``               counter    ``reason``: turns not recorded because
                                           ``client_disconnect`` or ``weight_update``
``engine_errors_total``         counter    ``kind``: ``refused``, ``lost``, ``rejected``
``latency_seconds``             histogram  ``part``: ``engine`` (engine call),
                                           ``tracestore`` (store calls on the request's
                                           path), ``total`` (request in, answer out),
                                           the own time's parts (:data:`PARTS`) and
                                           ``other`` (turns with an engine call)
``tokens_total``                counter    ``kind``: ``prompt``, ``prompt_new`` (tokenised
                                           this turn, the rest came from the trie),
                                           ``completion``, ``discarded`` (generated, then
                                           thrown away by an aborted turn)
``turns_recorded_total``        counter    turns written with ``record_turn``
``forks_total``                 counter    ``reason``: turns recorded on a new branch
                                           (``client_edit``, ``template``)
``held_total``                  counter    ``event``: generations a weight update stopped
                                           and the gateway ``held`` (tokens kept), then
                                           ``continued`` (recorded as one turn) or
                                           ``timed_out`` (past ``--hold-timeout``)
``retries_total``               counter    ``outcome``: retried turns answered without a
                                           new generation (``joined`` a running attempt,
                                           ``replayed`` from the recorded turn)
``gate_polls_total``            counter    gate status reads of the seal watcher
==============================  =========  ==============================================

A registry per gateway keeps several gateways in one process (tests,
benchmarks) apart.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)


#: The parts of a turn's own time (``latency_seconds{part}`` and the report's overhead split):
#: ``parse`` body read and parse, ``admit`` the admission round trip (gate lease, route,
#: prepare; with the wait for its coalesced batch), ``experts`` decoding routed experts and
#: putting them into the holder, ``record`` open and ``record_turn``, ``respond`` the answer
#: built and written; ``other`` is what is left of total minus the engine call.
PARTS = ("parse", "admit", "experts", "record", "respond")


class _Memo:
    """``labels()`` memoised per label values: prometheus_client validates and formats the
    values and takes a lock on every call, a dozen times a turn. Label children are never
    removed here, so a memoised child stays the one the metric exports."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        """The child of ``labelvalues`` (keywords: not memoised)."""
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]
        memo: dict[tuple[Any, ...], Any] | None = self.__dict__.get("_memo")
        if memo is None:
            memo = self.__dict__["_memo"] = {}
        child = memo.get(labelvalues)
        if child is None:
            child = memo[labelvalues] = super().labels(*labelvalues)  # type: ignore[misc]
        return child


class Counter(_Memo, prometheus_client.Counter):
    """A Prometheus counter whose label children are memoised."""


class Histogram(_Memo, prometheus_client.Histogram):
    """A Prometheus histogram whose label children are memoised."""


@dataclass
class Timing:
    """Where one request's time went: ``engine_s`` in engine calls, ``store_s`` in store calls on
    its path, ``parts`` the gateway's own time by part (:data:`PARTS`; ``start``:
    ``perf_counter`` when the handler began)."""

    start: float = field(default_factory=time.perf_counter)
    engine_s: float = 0.0
    store_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, since: float) -> float:
        """Count the time from ``since`` (a ``perf_counter``) to now in ``part``; returns now."""
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - since
        return now


class Metrics:
    """The gateway's metrics (attributes are prometheus_client collectors)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ns = "tracestore_gateway"
        r = self.registry
        self.requests = Counter(f"{ns}_requests", "Requests answered.", ["route", "status"], registry=r)
        self.in_flight = Gauge(f"{ns}_in_flight", "Requests being served.", registry=r)
        self.sealed = Counter(f"{ns}_sealed", "503 answers: the gate was sealed.", ["reason"], registry=r)
        self.gone = Counter(f"{ns}_gone", "410 answers: the session was retired or released.", ["reason"], registry=r)
        self.aborted = Counter(f"{ns}_aborted", "Turns aborted, nothing recorded.", ["reason"], registry=r)
        self.engine_errors = Counter(f"{ns}_engine_errors", "Failed engine calls.", ["kind"], registry=r)
        self.latency = Histogram(
            f"{ns}_latency_seconds", "Request latency by part.", ["part"], buckets=_BUCKETS, registry=r
        )
        self.tokens = Counter(f"{ns}_tokens", "Tokens in and out.", ["kind"], registry=r)
        self.turns = Counter(f"{ns}_turns_recorded", "Turns recorded.", registry=r)
        self.forks = Counter(f"{ns}_forks", "Turns that left the stored path they matched, by why.", ["reason"], registry=r)
        self.held = Counter(
            f"{ns}_held", "Generations a weight update stopped, by what became of them.", ["event"], registry=r
        )
        self.engine_waits = Counter(
            f"{ns}_engine_waits", "Turns that waited for their engine to come back, by how it ended.", ["event"], registry=r
        )
        self.retries = Counter(
            f"{ns}_retries", "Retried turns answered without a new generation, by how.", ["outcome"], registry=r
        )
        self.gate_polls = Counter(f"{ns}_gate_polls", "Gate status reads of the seal watcher.", registry=r)

    def observe(self, timing: Timing, total: float, recent: Recent) -> None:
        """A turn's latency by part into the histograms and ``recent`` (total and engine always;
        ``overhead``, its parts and ``other`` when an engine was called)."""
        lat = self.latency
        lat.labels("total").observe(total)
        recent.add("total", total)
        if timing.store_s:
            lat.labels("tracestore").observe(timing.store_s)
        if not timing.engine_s:
            return
        lat.labels("engine").observe(timing.engine_s)
        recent.add("engine", timing.engine_s)
        own = total - timing.engine_s
        recent.add("overhead", own)
        for part in PARTS:
            x = timing.parts.get(part, 0.0)
            lat.labels(part).observe(x)
            recent.add(part, x)
        other = max(0.0, own - sum(timing.parts.values()))
        lat.labels("other").observe(other)
        recent.add("other", other)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))


def thread_sched(tid: int | None) -> tuple[float, float] | None:
    """Seconds thread ``tid`` of this process ran on a core and waited runnable for one (Linux
    ``schedstat``; None elsewhere): how much of a turn's wait is CPU contention."""
    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run_ns, wait_ns, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


class Recent:
    """The last ``keep`` samples of each series (seconds), for percentiles in reports.

    Each series is a ring of C doubles (8 bytes a sample, allocated as it fills): a deque of
    float objects took ~40 bytes a sample, ~5 MB for a gateway's dozen series.
    """

    def __init__(self, keep: int = 10_000) -> None:
        if keep <= 0:
            raise ValueError(f"keep must be positive, not {keep}")
        self._keep = keep
        self._series: dict[str, tuple[array[float], list[int]]] = {}  # name -> (ring, [next slot])

    def add(self, name: str, x: float) -> None:
        """Append ``x`` to series ``name`` (the oldest sample goes once ``keep`` are kept)."""
        got = self._series.get(name)
        if got is None:
            got = self._series[name] = (array("d"), [0])
        ring, at = got
        if len(ring) < self._keep:
            ring.append(x)
        else:
            ring[at[0]] = x
            at[0] = (at[0] + 1) % self._keep

    def pct(self, name: str, q: float) -> float | None:
        """The ``q`` quantile of series ``name`` (None: no sample)."""
        got = self._series.get(name)
        xs = sorted(got[0]) if got is not None else []
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


@dataclass(frozen=True)
class GatewayStats:
    """Chat requests answered (``by_status``: HTTP status -> count; 503s are the refusals and
    aborts clients retried), requests in flight, and the gateway's own time per request
    (``overhead``: total minus the engine call) and total time, in seconds (None: no sample)."""

    requests: int
    by_status: dict[str, int]
    in_flight: int
    overhead_p50_s: float | None
    overhead_p99_s: float | None
    total_p50_s: float | None
    #: p50 of each part of the overhead (:data:`.metrics.PARTS` and ``other``) and of the
    #: engine call, in seconds (empty: no sample).
    parts_p50_s: dict[str, float] = field(default_factory=dict)
    #: Seconds the event loop's thread ran on a core and waited runnable for one since start
    #: (None: not Linux): a wait above the run time means the loop queues for the CPU.
    loop_run_s: float | None = None
    loop_wait_s: float | None = None


__all__ = ["PARTS", "GatewayStats", "Metrics", "Recent", "Timing", "thread_sched"]
