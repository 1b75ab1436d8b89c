"""``TraceStore`` (sync) and ``AsyncTraceStore`` (asyncio): the public entry points.

Both are thin: each public method is an operation from a domain module
(``run``, ``traces``, ``ownership``, ...) driven by the matching I/O layer,
so a method has the same name, arguments and docstring in both classes.
"""

from __future__ import annotations

from typing import Any

from . import checkpoint as ckpt_ops
from . import gc as gc_ops
from . import ownership as own_ops
from . import purge as purge_ops
from . import replay as replay_ops
from . import run as run_ops
from . import traces as trace_ops
from ._io import AsyncIO, SyncIO, async_op, sync_op
from .connection import ConnectionOptions, async_client, sync_client
from .context import Context, StoreConfig
from .keys import Keys


def _split_opts(opts: dict[str, Any]) -> tuple[ConnectionOptions, StoreConfig]:
    conn_fields = set(ConnectionOptions.__dataclass_fields__)
    store_fields = set(StoreConfig.__dataclass_fields__)
    unknown = set(opts) - conn_fields - store_fields
    if unknown:
        from .errors import ConfigError

        raise ConfigError(
            f"unknown option(s) {sorted(unknown)}; connection options: {sorted(conn_fields)}, "
            f"store options: {sorted(store_fields)}"
        )
    return (
        ConnectionOptions(**{k: v for k, v in opts.items() if k in conn_fields}),
        StoreConfig(**{k: v for k, v in opts.items() if k in store_fields}),
    )


class _Base:
    _ctx: Context
    url: str

    @property
    def run(self) -> str:
        """The run id this store works on."""
        return self._ctx.keys.run

    @property
    def keys(self) -> Keys:
        """The key builder of this run (for operators and tests)."""
        return self._ctx.keys

    @property
    def cluster(self) -> bool:
        """True when connected to a Redis Cluster."""
        return self._ctx.cluster

    @property
    def config(self) -> StoreConfig:
        """This client's store configuration."""
        return self._ctx.config


class TraceStore(_Base):
    """Synchronous client of one run. Create it with :meth:`TraceStore.connect`.

    Thread-safe: the connection pool and the node cache may be shared by threads.
    """

    def __init__(self, io: SyncIO, ctx: Context, url: str) -> None:
        self._io = io
        self._ctx = ctx
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
        (``retries``, ``socket_timeout_s``, ...) and
        :class:`~tracestore.context.StoreConfig` fields (``store_text``,
        ``cache_bytes``, ...). Raises ConfigError (bad URL/option), InvalidId
        (bad run or prefix), StorageError (unreachable). Two round trips:
        cluster detection and the run's meta record (skipped with
        ``create_run=False``, for tools that only inspect a server).
        """
        keys = Keys(prefix, run)
        copts, config = _split_opts(opts)
        client, cluster, display = sync_client(url, copts)
        store = cls(SyncIO(client, cluster=cluster), Context(keys, cluster, config), display)
        try:
            store.init_run() if create_run else store.ping()
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        """Close the connection pool."""
        self._io.close()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def redis(self) -> Any:
        """The underlying redis-py client (operators and tests; not needed for the API)."""
        return self._io.client

    # -- run ------------------------------------------------------------------------
    init_run = sync_op(run_ops.init_run)
    ping = sync_op(run_ops.ping)
    session_states = sync_op(run_ops.session_states)
    server_info = sync_op(run_ops.server_info)

    # -- data plane (traces.py, purge.py) -------------------------------------------
    lookup = sync_op(trace_ops.lookup)
    record_turn = sync_op(trace_ops.record_turn)
    insert = sync_op(trace_ops.insert)
    search = sync_op(trace_ops.search)
    export_training_trace = sync_op(trace_ops.export_training_trace)
    drop_session_data = sync_op(purge_ops.drop_session_data)
    drop_sessions_data = sync_op(purge_ops.drop_sessions_data)
    # (end data plane)

    # -- control plane: ownership and release (ownership.py) ------------------------
    open_session = sync_op(own_ops.open_session)
    open_sessions = sync_op(own_ops.open_sessions)
    owner_of = sync_op(own_ops.owner_of)
    transfer = sync_op(own_ops.transfer)
    release = sync_op(own_ops.release)
    release_owner = sync_op(own_ops.release_owner)
    sessions = sync_op(own_ops.sessions)
    owners = sync_op(own_ops.owners)
    heartbeat = sync_op(own_ops.heartbeat)
    gc = sync_op(gc_ops.gc)
    # (end control plane)

    # -- gate and router (gate.py, router.py) ---------------------------------------
    @property
    def gate(self) -> Any:
        """The run's request gate (:class:`~tracestore.gate.Gate`): admit, settle, weight_update..."""
        from .gate import Gate

        gate = self._ctx.caches.get("gate")
        if gate is None:
            gate = self._ctx.caches["gate"] = Gate(self._io, self._ctx)
        return gate

    def router(self, entrypoints: Any, *, retention_s: float = 86400.0) -> Any:
        """Session affinity over ``entrypoints`` (:class:`~tracestore.router.Router`).

        ``retention_s``: lifetime of the tombstones ``retire`` writes. Raises
        InvalidInput (empty list, duplicates) or InvalidId before any I/O.
        """
        from .router import Router

        return Router(self._io, self._ctx, entrypoints, retention_s)

    # (end gate)

    # -- replay buffer and checkpoint (replay.py, checkpoint.py) --------------------
    @property
    def replay(self) -> replay_ops.Replay:
        """The run's replay buffer (:class:`~tracestore.replay.Replay`): put, take, claim_retry, expire..."""
        rb = self._ctx.caches.get("replay")
        if rb is None:
            rb = self._ctx.caches["replay"] = replay_ops.Replay(self._io, self._ctx)
        return rb

    checkpoint = sync_op(ckpt_ops.checkpoint)
    restore = sync_op(ckpt_ops.restore)
    # (end replay)


class AsyncTraceStore(_Base):
    """asyncio client of one run; same methods as :class:`TraceStore`, as coroutines.

    Create it with ``await AsyncTraceStore.connect(...)``.
    """

    def __init__(self, io: AsyncIO, ctx: Context, url: str) -> None:
        self._io = io
        self._ctx = ctx
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
        copts, config = _split_opts(opts)
        client, cluster, display = async_client(url, copts)
        store = cls(AsyncIO(client, cluster=cluster), Context(keys, cluster, config), display)
        try:
            await (store.init_run() if create_run else store.ping())
        except BaseException:
            await store.close()
            raise
        return store

    async def close(self) -> None:
        """Close the connection pool."""
        await self._io.close()

    async def __aenter__(self) -> AsyncTraceStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def redis(self) -> Any:
        """The underlying redis-py asyncio client."""
        return self._io.client

    # -- run ------------------------------------------------------------------------
    init_run = async_op(run_ops.init_run)
    ping = async_op(run_ops.ping)
    session_states = async_op(run_ops.session_states)
    server_info = async_op(run_ops.server_info)

    # -- data plane (traces.py, purge.py) -------------------------------------------
    lookup = async_op(trace_ops.lookup)
    record_turn = async_op(trace_ops.record_turn)
    insert = async_op(trace_ops.insert)
    search = async_op(trace_ops.search)
    export_training_trace = async_op(trace_ops.export_training_trace)
    drop_session_data = async_op(purge_ops.drop_session_data)
    drop_sessions_data = async_op(purge_ops.drop_sessions_data)
    # (end data plane)

    # -- control plane: ownership and release (ownership.py) ------------------------
    open_session = async_op(own_ops.open_session)
    open_sessions = async_op(own_ops.open_sessions)
    owner_of = async_op(own_ops.owner_of)
    transfer = async_op(own_ops.transfer)
    release = async_op(own_ops.release)
    release_owner = async_op(own_ops.release_owner)
    sessions = async_op(own_ops.sessions)
    owners = async_op(own_ops.owners)
    heartbeat = async_op(own_ops.heartbeat)
    gc = async_op(gc_ops.gc)
    # (end control plane)

    # -- gate and router (gate.py, router.py) ---------------------------------------
    @property
    def gate(self) -> Any:
        """The run's request gate (:class:`~tracestore.gate.AsyncGate`): admit, settle, weight_update..."""
        from .gate import AsyncGate

        gate = self._ctx.caches.get("gate")
        if gate is None:
            gate = self._ctx.caches["gate"] = AsyncGate(self._io, self._ctx)
        return gate

    def router(self, entrypoints: Any, *, retention_s: float = 86400.0) -> Any:
        """Session affinity over ``entrypoints`` (:class:`~tracestore.router.AsyncRouter`).

        ``retention_s``: lifetime of the tombstones ``retire`` writes. Raises
        InvalidInput (empty list, duplicates) or InvalidId before any I/O.
        """
        from .router import AsyncRouter

        return AsyncRouter(self._io, self._ctx, entrypoints, retention_s)

    # (end gate)

    # -- replay buffer and checkpoint (replay.py, checkpoint.py) --------------------
    @property
    def replay(self) -> replay_ops.AsyncReplay:
        """The run's replay buffer (:class:`~tracestore.replay.AsyncReplay`): put, take, claim_retry, expire..."""
        rb = self._ctx.caches.get("replay")
        if rb is None:
            rb = self._ctx.caches["replay"] = replay_ops.AsyncReplay(self._io, self._ctx)
        return rb

    checkpoint = async_op(ckpt_ops.checkpoint)
    restore = async_op(ckpt_ops.restore)
    # (end replay)


def connect(url: str | None = None, run: str = "default", **opts: Any) -> TraceStore:
    """Shorthand for :meth:`TraceStore.connect`."""
    return TraceStore.connect(url, run, **opts)
