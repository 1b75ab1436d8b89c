"""Admission: the gate leases of one gateway process, and the requests they cover.

* Admissions and settlements of one event-loop iteration go to Redis as one
  call each (:class:`Coalescer`): a thousand turns starting together cost one
  ``admit_many``, not a thousand round trips.
* Every request being served is a :class:`Flight` (its engine request id, its
  lease, where it is); :meth:`Admission.abort_all` stops the leased ones at
  their engines.
* **Held turns** (``--on-weight-update continue``) wait in :meth:`Admission.wait_open`
  for the watcher to see the gate open again, then are admitted anew.
* **Learning of a seal.** One watcher task, running only while leased
  requests are in flight, reads ``gate.status()`` every ``gate_poll_s``
  (default 50 ms): one small script call per interval per gateway, not per
  request. When it sees the gate sealed it aborts every leased request in
  flight at its engine. A refused admission (GateSealed) does the same at
  once. Latency from seal to the engine's abort call: at most
  ``gate_poll_s`` plus one round trip. The watcher also renews leases older
  than half their ttl.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import SessionReleased, StorageError, TracestoreError
from ..gate import AdmitRequest, Lease
from ..scripts import Op, new_op_id
from ..store import AsyncTraceStore
from .engines import Engine
from .metrics import Metrics

log = logging.getLogger(__name__)

#: How long a settlement is sent again when its reply is lost (a failover): the lease is settled
#: once it lands, never twice (its id is the idempotency key).
SETTLE_RETRY_S = 60.0

T = TypeVar("T")
X = TypeVar("X")
Y = TypeVar("Y")


@dataclass(eq=False)
class Flight:
    """A request being served: what the seal watcher and the cleanup need of it.

    ``rid``: the engine request id (``X-Request-Id``); ``engine``: where it
    runs; ``abort_reason``: set when the gateway decided to stop it;
    ``record_task``: the turn's write, once started (the commit point: a
    recorded turn is not aborted any more).
    """

    rid: str
    sid: str | None
    engine: Engine
    lease: Lease | None = None
    renewed: float = field(default_factory=time.monotonic)
    abort_reason: str | None = None
    engine_started: bool = False
    engine_done: bool = False
    record_task: asyncio.Task[Any] | None = None
    settled: bool = False

    @property
    def generating(self) -> bool:
        """True while the engine works on it."""
        return self.engine_started and not self.engine_done


@dataclass
class Admitted:
    """An admission with riders (:meth:`Admission.admit_with`): the lease, or why there is none,
    and each rider's result or error, in order."""

    lease: Lease | BaseException
    results: list[Any]


class _Rider:
    """An operation riding in an admission's round trip; its result or error kept in place (an
    error never stops the batch's other operations, whatever its type)."""

    def __init__(self, op: Op[Any]) -> None:
        self._op = op
        self.result: Any = None
        self._done = False

    def run(self) -> Op[None]:
        try:
            self.result = yield from self._op
        except Exception as exc:
            self.result = exc
        self._done = True

    def failed(self, exc: BaseException) -> None:
        """The batch's round trip failed as a whole: a rider it cut short has that error."""
        if not self._done:
            self.result, self._done = exc, True


class Coalescer(Generic[X, Y]):
    """Gathers the calls made during one event-loop iteration into one batch call.

    ``flush(items)`` returns one result (or exception) per item, in order;
    an exception it raises goes to every item of the batch. No timer: a batch
    is sent on the loop's next iteration, so a lone call waits for nothing.
    """

    def __init__(self, flush: Callable[[list[X]], Awaitable[list[Y | BaseException]]], limit: int) -> None:
        self._flush = flush
        self._limit = limit
        self._items: list[tuple[X, asyncio.Future[Y]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, item: X) -> Y:
        """Queue ``item`` for the next batch and wait for its result."""
        return await self.enqueue(item)

    def enqueue(self, item: X) -> asyncio.Future[Y]:
        """Queue ``item`` for the next batch; the future of its result (no task of the caller's).

        The first item of a batch starts the batch's task, whose first step (on the loop's
        next iteration) takes every item queued by then.
        """
        fut: asyncio.Future[Y] = asyncio.get_running_loop().create_future()
        if not self._items:
            self._spawn(self._start())
        self._items.append((item, fut))
        return fut

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self) -> None:
        items, self._items = self._items, []
        for i in range(self._limit, len(items), self._limit):
            self._spawn(self._run(items[i : i + self._limit]))
        await self._run(items[: self._limit])

    async def _run(self, items: list[tuple[X, asyncio.Future[Y]]]) -> None:
        try:
            results = await self._flush([x for x, _ in items])
        except BaseException as exc:  # every caller of the batch gets it
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (_, fut), res in zip(items, results, strict=True):
            if fut.done():
                continue
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)


class Admission:
    """The gate leases of one gateway process (see the module docstring).

    ``db(coro)`` runs a store call once a pooled connection is free (the
    gateway's connection budget); ``spawn(coro)`` runs a background task the
    gateway waits for at shutdown.
    """

    def __init__(
        self,
        store: AsyncTraceStore,
        holder: str,
        ttl_s: float,
        poll_s: float,
        metrics: Metrics,
        db: Callable[[Awaitable[Any]], Awaitable[Any]],
        spawn: Callable[[Awaitable[Any]], None],
    ) -> None:
        self.store = store
        self.holder = holder
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.metrics = metrics
        self._db = db
        self._spawn = spawn
        self.flights: dict[str, Flight] = {}
        self._leased = 0
        self._held = 0
        self._busy = asyncio.Event()
        self._open = asyncio.Event()  # set while the watcher last saw the gate open
        self._open.set()
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False  # set by close(): the watcher ends even if a call swallowed its cancellation
        self._admits: Coalescer[tuple[AdmitRequest, tuple[Op[Any], ...]], Admitted] = Coalescer(self._admit_batch, 1000)
        self._settles: Coalescer[tuple[Lease, str], None] = Coalescer(self._settle_batch, 1000)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the seal watcher (inside the running loop)."""
        self._watcher = asyncio.create_task(self._watch(), name="gateway-gate-watcher")

    async def close(self) -> None:
        """Stop the seal watcher."""
        if self._watcher is not None:
            self._closing = True
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None

    # -- flights ----------------------------------------------------------------------------

    def register(self, flight: Flight) -> None:
        """``flight`` is being served (the watcher runs while any leased flight is)."""
        self.flights[flight.rid] = flight
        if flight.lease is not None:
            self._leased += 1
            self._busy.set()

    def unregister(self, flight: Flight) -> None:
        """``flight`` is done (idempotent)."""
        if self.flights.pop(flight.rid, None) is not None and flight.lease is not None:
            self._leased -= 1
            self._busy_now()

    def abort_all(self, reason: str) -> int:
        """Mark every leased flight not yet recording aborted and stop those generating; how many."""
        if reason == "weight_update":
            self._open.clear()
        n = 0
        for f in list(self.flights.values()):
            if f.lease is None or f.abort_reason is not None or f.record_task is not None:
                continue
            f.abort_reason = reason
            n += 1
            if f.generating:
                self._spawn(f.engine.abort(f.rid))
        return n

    # -- held turns -------------------------------------------------------------------------

    def _busy_now(self) -> None:
        if self._leased or self._held:
            self._busy.set()
        else:
            self._busy.clear()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """A turn waits for the gate to reopen (the watcher keeps reading it meanwhile)."""
        self._held += 1
        self._busy_now()
        try:
            yield
        finally:
            self._held -= 1
            self._busy_now()

    @property
    def held(self) -> int:
        """Turns waiting for the gate to reopen now."""
        return self._held

    async def wait_open(self, timeout_s: float) -> bool:
        """Wait until the watcher sees the gate open (at most ``timeout_s``); False on timeout.
        Call it inside :meth:`holding`."""
        try:
            await asyncio.wait_for(self._open.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return False
        return True

    def sealed(self) -> None:
        """Learnt of a seal elsewhere (an admission refused): held turns wait for the next open."""
        self._open.clear()

    # -- admit and settle -------------------------------------------------------------------

    async def admit(self, sid: str, engine: str | None = None, rid: str | None = None) -> Lease:
        """A lease for ``sid`` (coalesced with the admissions of this loop iteration).

        ``engine`` and ``rid`` are recorded on the lease, so that if this gateway dies anyone can
        abort the request at its engine and resolve the lease (``gate.dead_holder_leases``).
        Raises what ``gate.admit`` raises (GateSealed, SessionReleased...).
        """
        got = await self.admit_with(sid, engine, rid)
        if isinstance(got.lease, BaseException):
            raise got.lease
        return got.lease

    async def admit_with(self, sid: str, engine: str | None, rid: str | None, *riders: Op[Any]) -> Admitted:
        """:meth:`admit`, with ``riders`` (operations that only read: a turn's prepare and route)
        sent in the same pipelined round trip as the admissions of this loop iteration.

        Never raises for one request's failure: the lease, or why there is none, and each
        rider's result, or its error, come back in place (:class:`Admitted`). A round trip that
        fails as a whole is every rider's error; the batch's admission is then sent again alone
        with its op id (the first reply if it ran), its leases settled if that is unknown too.
        """
        return await self.admit_phase(sid, engine, rid, *riders)

    def admit_phase(self, sid: str, engine: str | None, rid: str | None, *riders: Op[Any]) -> asyncio.Future[Admitted]:
        """:meth:`admit_with` as a future, queued now (a caller that shields it needs no task)."""
        return self._admits.enqueue((AdmitRequest(sid, self.holder, engine, rid), riders))

    async def settle(self, lease: Lease, outcome: str) -> None:
        """Settle ``lease`` (coalesced); a failure is logged, and the lease then expires into
        the poison set: loud, not lost."""
        try:
            await self._settles.submit((lease, outcome))
        except Exception as exc:
            log.warning("gateway: could not settle lease %s as %s: %s", lease.id, outcome, exc)

    async def settle_flight(self, flight: Flight, outcome: str) -> None:
        """Settle ``flight``'s lease once (later calls do nothing) and unregister it."""
        if flight.settled:
            return
        flight.settled = True
        self.unregister(flight)
        if flight.lease is not None:
            await self.settle(flight.lease, outcome)

    def completed(self, flight: Flight) -> Awaitable[None] | None:
        """The answer is out: the settlement ``completed``, to run in the background (None: no lease).

        Not awaited by the handler: a client that closes its connection right
        after reading the answer must not cancel the settlement.
        """
        flight.settled = True
        self.unregister(flight)
        return self.settle(flight.lease, "completed") if flight.lease is not None else None

    async def _admit_batch(self, items: list[tuple[AdmitRequest, tuple[Op[Any], ...]]]) -> list[Admitted | BaseException]:
        """One pipelined round trip for the admissions of one loop iteration and their riders:
        ``admit_many`` (all or nothing) and every rider's first request.

        When one session of the batch was released, each is admitted alone so that only that
        one is refused. An admission whose reply is unknown is sent again alone with its op id
        and ``on_unconfirmed="settle"``, so nothing is left to expire into the poison set.
        """
        reqs = [r for r, _ in items]
        op_id = new_op_id()
        admitted: list[list[Lease]] = []
        riders = [_Rider(op) for _, ops in items for op in ops]

        def admit() -> Op[list[Lease]]:
            leases = yield from self.store.ops.gate.admit_many(reqs, self.ttl_s, op_id=op_id)
            admitted.append(leases)
            return leases

        leases: list[Lease] | list[Lease | BaseException] | BaseException
        try:
            got = await self._db(self.store.gather(admit(), *(r.run() for r in riders), errors_in_place=True))
            leases = got[0]
        except TracestoreError as exc:  # the round trip failed as a whole
            leases = admitted[0] if admitted else exc
            for r in riders:
                r.failed(exc)
        if isinstance(leases, BaseException):
            leases = await self._admit_again(reqs, leases, op_id)
        out: list[Admitted | BaseException] = []
        at = 0
        for i, (_, ops) in enumerate(items):
            lease = leases[i] if isinstance(leases, list) else leases
            out.append(Admitted(lease, [r.result for r in riders[at : at + len(ops)]]))
            at += len(ops)
        return out

    async def _admit_again(
        self, reqs: list[AdmitRequest], exc: BaseException, op_id: str
    ) -> list[Lease | BaseException] | BaseException:
        """After a batch's admission failed with ``exc``: each admitted alone when one session was
        released; sent again with its op id when its outcome is unknown; else ``exc`` for all."""
        if isinstance(exc, SessionReleased) and len(reqs) > 1:
            alone = await asyncio.gather(
                *(self._db(self.store.gate.admit_many([r], self.ttl_s, on_unconfirmed="settle")) for r in reqs),
                return_exceptions=True,
            )
            return [x[0] if isinstance(x, list) else x for x in alone]
        if isinstance(exc, StorageError):  # OutcomeUnknown, a lost connection
            try:
                return list(await self._db(
                    self.store.gate.admit_many(reqs, self.ttl_s, op_id=op_id, on_unconfirmed="settle")
                ))
            except Exception as again:
                return again
        return exc

    async def _settle_batch(self, items: list[tuple[Lease, str]]) -> list[None | BaseException]:
        """Settle the leases of one loop iteration: one pipelined ``settle_many`` per outcome."""
        by: dict[str, list[Lease]] = {}
        for lease, outcome in items:
            by.setdefault(outcome, []).append(lease)
        t0 = time.perf_counter()
        try:
            # a settlement whose reply a failover lost is sent again with its lease ids until it lands
            await asyncio.gather(
                *(self._db(self.store.gate.settle_many(ls, o, retry_until_s=SETTLE_RETRY_S)) for o, ls in by.items())
            )
        finally:
            self.metrics.latency.labels("settle").observe(time.perf_counter() - t0)
        return [None] * len(items)

    # -- the seal watcher -------------------------------------------------------------------

    async def _watch(self) -> None:
        while not self._closing:
            await self._busy.wait()
            try:
                st = await self.store.gate.status()
                self.metrics.gate_polls.inc()
                if st.sealed:
                    self.abort_all("weight_update")
                else:
                    self._open.set()
                now = time.monotonic()
                for f in list(self.flights.values()):
                    if f.lease is not None and not f.settled and now - f.renewed > self.ttl_s / 2:
                        f.renewed = now
                        await self.store.gate.renew(f.lease, self.ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep watching: a dead watcher would miss the next seal
                log.warning("gateway: gate watcher: %s", exc)
            if not self._closing:
                await asyncio.sleep(self.poll_s)


__all__ = ["Admission", "Admitted", "Coalescer", "Flight"]
