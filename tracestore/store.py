"""``TraceStore`` (sync) and ``AsyncTraceStore`` (asyncio): the public entry points.

Both are thin: :class:`StoreMethods` lists every public method once, each an
operation of a domain module (``run``, ``traces``, ``ownership``, ...); the
two classes differ only in the runner they are (:mod:`tracestore.twin`), so
a method has the same name, arguments and docstring in both, and the async
one is typed as a coroutine of the sync one's result.

Any operation runs on either store: ``store.run(op(store.context, ...))``
(``await astore.run(...)`` on the async one); :meth:`TraceStore.execute`
runs one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterable
from typing import Any, Literal, TypeVar, overload

from . import checkpoint as ckpt_ops
from . import gc as gc_ops
from . import ownership as own_ops
from . import purge as purge_ops
from . import run as run_ops
from . import runs as runs_ops
from . import traces as trace_ops
from .connection import ConnectionOptions, async_client, sync_client
from .context import Context, StoreConfig
from .durability import OPTION_NAMES as DURABILITY_OPTIONS
from .durability import Durability
from .errors import ConfigError, DurabilityUnconfirmed, NotEnoughReplicas, TracestoreError
from .gate import AsyncGate, Gate, GateOps
from .io import AsyncIO, SyncIO
from .keys import Keys
from .replay import AsyncReplay, Replay, ReplayMethods
from .router import AsyncRouter, Router, RouterOps, route_scope
from .scripts import Op, Request, gather, registry
from .twin import AsyncRunner, OpBuilder, SyncRunner, op, part, part_factory

R1 = TypeVar("R1")
R2 = TypeVar("R2")
R3 = TypeVar("R3")
R4 = TypeVar("R4")
R = TypeVar("R")
#: An operation's result in a gather with ``errors_in_place=True``: its value or its error.
E = TracestoreError


def _split_opts(opts: dict[str, Any]) -> tuple[ConnectionOptions, StoreConfig, Durability]:
    conn_fields = set(ConnectionOptions.__dataclass_fields__)
    store_fields = set(StoreConfig.__dataclass_fields__)
    unknown = set(opts) - conn_fields - store_fields - set(DURABILITY_OPTIONS)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {sorted(unknown)}; connection options: {sorted(conn_fields)}, "
            f"store options: {sorted(store_fields)}, durability options: {list(DURABILITY_OPTIONS)}"
        )
    durability = Durability.from_options(opts := dict(opts))
    return (
        ConnectionOptions(**{k: v for k, v in opts.items() if k in conn_fields}),
        StoreConfig(**{k: v for k, v in opts.items() if k in store_fields}),
        durability,
    )


class ReplayOps(ReplayMethods, OpBuilder[Context]):
    """The replay buffer's operations built and not run (``store.ops.replay``): ``.put(group, owner)``."""


class StoreMethods:
    """The public methods of both stores, listed once (see :mod:`tracestore.twin`)."""

    _scope: Context
    url: str

    @property
    def run_id(self) -> str:
        """The run id this store works on."""
        return self._scope.keys.run

    @property
    def keys(self) -> Keys:
        """The key builder of this run (for operators and tests)."""
        return self._scope.keys

    @property
    def cluster(self) -> bool:
        """True when connected to a Redis Cluster."""
        return self._scope.cluster

    @property
    def config(self) -> StoreConfig:
        """This client's store configuration."""
        return self._scope.config

    @property
    def context(self) -> Context:
        """What every operation receives first: ``store.run(op(store.context, ...))``."""
        return self._scope

    # -- run ------------------------------------------------------------------------
    init_run = op(run_ops.init_run)
    ping = op(run_ops.ping)
    server_info = op(run_ops.server_info)
    run_ids = op(runs_ops.run_ids)
    list_runs = op(runs_ops.list_runs)
    delete_run = op(runs_ops.delete_run)
    stats = op(run_ops.stats)

    # -- data plane (traces, purge.py) ----------------------------------------------
    lookup = op(trace_ops.lookup)
    record_turn = op(trace_ops.record_turn)
    insert = op(trace_ops.insert)
    search = op(trace_ops.search)
    export_training_trace = op(trace_ops.export_training_trace)
    export_many = op(trace_ops.export_many)
    export_node = op(trace_ops.export_node)
    trace_keys = op(trace_ops.trace_keys)
    keep_partial = op(trace_ops.keep_partial)
    read_partial = op(trace_ops.read_partial)
    drop_partial = op(trace_ops.drop_partial)
    keep_answer = op(trace_ops.keep_answer)
    read_answer = op(trace_ops.read_answer)
    keep_response = op(trace_ops.keep_response)
    read_responses = op(trace_ops.read_responses)
    drop_session_data = op(purge_ops.drop_session_data)
    drop_sessions_data = op(purge_ops.drop_sessions_data)
    # (end data plane)

    # -- control plane: ownership and release (ownership.py) ------------------------
    open_session = op(own_ops.open_session)
    open_sessions = op(own_ops.open_sessions)
    owner_of = op(own_ops.owner_of)
    session_states = op(own_ops.session_states)
    transfer = op(own_ops.transfer)
    release = op(own_ops.release)
    release_owner = op(own_ops.release_owner)
    sessions = op(own_ops.sessions)
    owners = op(own_ops.owners)
    heartbeat = op(own_ops.heartbeat)
    heartbeat_many = op(own_ops.heartbeat_many)
    deregister = op(own_ops.deregister)
    gc = op(gc_ops.gc)
    # (end control plane)

    # -- gate and router (gate/, router.py) ----------------------------------------
    gate = part(
        Gate,
        AsyncGate,
        GateOps,
        """The run's request gate (:class:`~tracestore.gate.Gate`, or
        :class:`~tracestore.gate.AsyncGate` on an async store): admit, settle, weight_update...""",
    )
    router = part_factory(
        route_scope,
        Router,
        AsyncRouter,
        RouterOps,
        """``router(entrypoints, *, retention_s=86400.0)``: session affinity over ``entrypoints``.

        A :class:`~tracestore.router.Router` (an :class:`~tracestore.router.AsyncRouter`
        on an async store). ``retention_s``: lifetime of the tombstones ``retire``
        writes. Raises InvalidInput (empty list, duplicates) or InvalidId before any I/O.
        """,
    )
    # (end gate)

    # -- replay buffer and checkpoint (replay/, checkpoint.py) --------------------
    replay = part(
        Replay,
        AsyncReplay,
        ReplayOps,
        """The run's replay buffer (:class:`~tracestore.replay.Replay`, or
        :class:`~tracestore.replay.AsyncReplay` on an async store): put, take, claim_retry, expire...""",
    )
    checkpoint = op(ckpt_ops.checkpoint)
    restore = op(ckpt_ops.restore)
    # (end replay)


class StoreOps(StoreMethods, OpBuilder[Context]):
    """Every operation of a store, built and not run: ``store.ops`` (see :meth:`TraceStore.gather`).

    ``store.ops.lookup(sid, prompt)`` is the operation ``store.lookup(sid,
    prompt)`` runs, with the same arguments; so are ``store.ops.gate.X``,
    ``store.ops.replay.X`` and ``store.ops.router(entrypoints).X``. Run
    several at once, sharing round trips, with ``store.gather(...)``, or one
    with ``store.run(...)``; the same operation runs on the sync and the
    async store. Arguments are checked when the operation runs (before any
    I/O), not when it is built.
    """


def _gathered(operations: Iterable[Op[Any]], errors_in_place: bool) -> Op[list[Any]]:
    if errors_in_place:
        return (yield from gather(operations, errors_in_place=True))
    return (yield from gather(operations))


_GATHER_DOC = """Run ``operations`` (from :attr:`ops`, or any operation) at once, sharing round trips.

        ``store.gather(store.ops.release_owner("train:3", "trained"),
        store.ops.router(eps).retire(sids))`` returns their results as a
        tuple, in order (typed per position up to four operations). Each
        round trip carries the next request of every unfinished operation
        (one round trip per node on a cluster), so N one-round-trip calls
        cost one round trip. Not atomic together: each operation keeps its
        own guarantees. Errors: one raised before any request (validation)
        fails the whole call before any I/O; otherwise every operation runs
        to its end and the first error (in the order given) is raised, or,
        with ``errors_in_place=True``, each failed operation's
        TracestoreError stands in its place in the result. A round trip lost
        as a whole (StorageError) raises even then, as the OutcomeUnknown of
        the first mutating operation it carried. See
        :func:`tracestore.scripts.gather`.
        """


class TraceStore(StoreMethods, SyncRunner[Context]):
    """Synchronous client of one run. Create it with :meth:`TraceStore.connect`.

    Thread-safe: the connection pool and the node cache may be shared by threads.
    """

    def __init__(self, io: SyncIO, ctx: Context, url: str) -> None:
        self._io = io
        self._scope = ctx
        self.url = url

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        run: str = "default",
        *,
        prefix: str = "ts",
        create_run: bool = True,
        **opts: Any,
    ) -> TraceStore:
        """Connect to ``url`` (else ``$TRACESTORE_URL``, else the embedded server).

        ``opts`` are :class:`~tracestore.connection.ConnectionOptions` fields
        (``retries``, ``socket_timeout_s``, ...),
        :class:`~tracestore.context.StoreConfig` fields (``store_text``,
        ``cache_bytes``, ...) and the durability level
        (:class:`~tracestore.durability.Durability`): ``durability="none"|
        "replicas"|"aof"|"replicas+aof"`` (default ``$TRACESTORE_DURABILITY``,
        else ``"none"``), ``durability_replicas`` (default
        ``$TRACESTORE_DURABILITY_REPLICAS``, else 1), ``durability_timeout_s``
        (default ``$TRACESTORE_DURABILITY_TIMEOUT_S``, else 1.0);
        see docs/durability.md. Raises ConfigError (bad URL/option; a
        durability level the server cannot give: too few replicas, no AOF),
        InvalidId (bad run or prefix), StorageError (unreachable). Two round
        trips: cluster detection and the run's meta record (skipped with
        ``create_run=False``, for tools that only inspect a server), plus one
        per primary to check a durability level other than ``"none"``.
        """
        keys = Keys(prefix, run)
        copts, config, durability = _split_opts(opts)
        client, cluster, display = sync_client(url, copts)
        io = SyncIO(client, cluster=cluster, durability=durability, opts=copts)
        store = cls(io, Context(keys, cluster, config), display)
        try:
            io.check_durability()
            if not create_run:
                store.ping()
            else:
                with contextlib.suppress(DurabilityUnconfirmed, NotEnoughReplicas):
                    # A replica that is down must not stop a connect: the run's meta
                    # record is written again, idempotently, by any later connect.
                    store.init_run()
        except BaseException:
            store.close()
            raise
        return store

    @functools.cached_property
    def ops(self) -> StoreOps:
        """Every operation of this store, built and not run (see :class:`StoreOps`); no I/O."""
        return StoreOps(self._scope)

    @overload
    def gather(self, o1: Op[R1], /, *, errors_in_place: Literal[False] = False) -> tuple[R1]: ...
    @overload
    def gather(
        self, o1: Op[R1], o2: Op[R2], /, *, errors_in_place: Literal[False] = False
    ) -> tuple[R1, R2]: ...
    @overload
    def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], /, *, errors_in_place: Literal[False] = False
    ) -> tuple[R1, R2, R3]: ...
    @overload
    def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], o4: Op[R4], /, *, errors_in_place: Literal[False] = False
    ) -> tuple[R1, R2, R3, R4]: ...
    @overload
    def gather(self, *operations: Op[R], errors_in_place: Literal[False] = False) -> tuple[R, ...]: ...
    @overload
    def gather(self, o1: Op[R1], /, *, errors_in_place: Literal[True]) -> tuple[R1 | E]: ...
    @overload
    def gather(self, o1: Op[R1], o2: Op[R2], /, *, errors_in_place: Literal[True]) -> tuple[R1 | E, R2 | E]: ...
    @overload
    def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], /, *, errors_in_place: Literal[True]
    ) -> tuple[R1 | E, R2 | E, R3 | E]: ...
    @overload
    def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], o4: Op[R4], /, *, errors_in_place: Literal[True]
    ) -> tuple[R1 | E, R2 | E, R3 | E, R4 | E]: ...
    @overload
    def gather(self, *operations: Op[R], errors_in_place: Literal[True]) -> tuple[R | E, ...]: ...

    def gather(self, *operations: Op[Any], errors_in_place: bool = False) -> tuple[Any, ...]:
        return tuple(self.run(_gathered(operations, errors_in_place)))

    gather.__doc__ = _GATHER_DOC

    def execute(self, request: Request) -> Any:
        """Execute one request of an operation and return its decoded reply.

        Script errors become typed errors; redis-py errors StorageError or
        ScriptError. One round trip (a Batch: one per node).
        """
        return self._io.execute(request)

    def close(self) -> None:
        """Deregister the owner tags this store heart-beat for, then close the connection pool.

        A tag that still owns sessions keeps its heartbeat (gc releases them
        if its process does not come back); the others are dropped, so gc
        never declares a cleanly closed client lost. A server that cannot be
        reached at close is not an error here.
        """
        try:
            self.run(own_ops.deregister_all(self._scope))
        except TracestoreError:
            pass
        self._io.close()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def redis(self) -> Any:
        """The underlying redis-py client (operators and tests; not needed for the API)."""
        return self._io.client

    @property
    def durability(self) -> Durability:
        """What this store's mutating calls wait for (see docs/durability.md)."""
        return self._io.durability


class AsyncTraceStore(StoreMethods, AsyncRunner[Context]):
    """asyncio client of one run; same methods as :class:`TraceStore`, as coroutines.

    Create it with ``await AsyncTraceStore.connect(...)``.
    """

    def __init__(self, io: AsyncIO, ctx: Context, url: str) -> None:
        self._io = io
        self._scope = ctx
        self.url = url

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        run: str = "default",
        *,
        prefix: str = "ts",
        create_run: bool = True,
        **opts: Any,
    ) -> AsyncTraceStore:
        """Async counterpart of :meth:`TraceStore.connect` (same arguments and errors)."""
        keys = Keys(prefix, run)
        copts, config, durability = _split_opts(opts)
        await asyncio.to_thread(registry)  # read lua/ once, off the event loop
        client, cluster, display = await async_client(url, copts)
        io = AsyncIO(client, cluster=cluster, durability=durability, opts=copts)
        store = cls(io, Context(keys, cluster, config), display)
        try:
            await io.check_durability()
            if not create_run:
                await store.ping()
            else:
                with contextlib.suppress(DurabilityUnconfirmed, NotEnoughReplicas):  # see TraceStore.connect
                    await store.init_run()
        except BaseException:
            await store.close()
            raise
        return store

    @functools.cached_property
    def ops(self) -> StoreOps:
        """Every operation of this store, built and not run (see :class:`StoreOps`); no I/O."""
        return StoreOps(self._scope)

    @overload
    async def gather(self, o1: Op[R1], /, *, errors_in_place: Literal[False] = False) -> tuple[R1]: ...
    @overload
    async def gather(
        self, o1: Op[R1], o2: Op[R2], /, *, errors_in_place: Literal[False] = False
    ) -> tuple[R1, R2]: ...
    @overload
    async def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], /, *, errors_in_place: Literal[False] = False
    ) -> tuple[R1, R2, R3]: ...
    @overload
    async def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], o4: Op[R4], /, *, errors_in_place: Literal[False] = False
    ) -> tuple[R1, R2, R3, R4]: ...
    @overload
    async def gather(self, *operations: Op[R], errors_in_place: Literal[False] = False) -> tuple[R, ...]: ...
    @overload
    async def gather(self, o1: Op[R1], /, *, errors_in_place: Literal[True]) -> tuple[R1 | E]: ...
    @overload
    async def gather(self, o1: Op[R1], o2: Op[R2], /, *, errors_in_place: Literal[True]) -> tuple[R1 | E, R2 | E]: ...
    @overload
    async def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], /, *, errors_in_place: Literal[True]
    ) -> tuple[R1 | E, R2 | E, R3 | E]: ...
    @overload
    async def gather(
        self, o1: Op[R1], o2: Op[R2], o3: Op[R3], o4: Op[R4], /, *, errors_in_place: Literal[True]
    ) -> tuple[R1 | E, R2 | E, R3 | E, R4 | E]: ...
    @overload
    async def gather(self, *operations: Op[R], errors_in_place: Literal[True]) -> tuple[R | E, ...]: ...

    async def gather(self, *operations: Op[Any], errors_in_place: bool = False) -> tuple[Any, ...]:
        return tuple(await self.run(_gathered(operations, errors_in_place)))

    gather.__doc__ = _GATHER_DOC

    async def execute(self, request: Request) -> Any:
        """Async counterpart of :meth:`TraceStore.execute`."""
        return await self._io.execute(request)

    async def close(self) -> None:
        """Async counterpart of :meth:`TraceStore.close` (deregisters, then closes)."""
        try:
            await self.run(own_ops.deregister_all(self._scope))
        except TracestoreError:
            pass
        await self._io.close()

    async def __aenter__(self) -> AsyncTraceStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def redis(self) -> Any:
        """The underlying redis-py asyncio client."""
        return self._io.client

    @property
    def durability(self) -> Durability:
        """What this store's mutating calls wait for (see docs/durability.md)."""
        return self._io.durability


def connect(url: str | None = None, run: str = "default", **opts: Any) -> TraceStore:
    """Shorthand for :meth:`TraceStore.connect`."""
    return TraceStore.connect(url, run, **opts)
