"""What every operation receives: the run's keys, its configuration, its caches."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import orjson

from .errors import (
    ConfigError,
    NotEnoughReplicas,
    OutcomeUnknown,
    ScriptError,
    StateRolledBack,
    StorageError,
)
from .keys import Keys
from .scripts import Batch, Eval, Op, chunks, new_op_id, script
from .validate import validate_op_id

P = ParamSpec("P")
R = TypeVar("R")

#: Key layout version of a run (in ``ts:{R}:meta``; a client refuses a run of another one).
#: 2: node ids of 16 hex characters, ``tok``/``txt`` keyed by node number (docs/traces.md).
SCHEMA_VERSION = 2


@dataclass(frozen=True)
class StoreConfig:
    """Per-client configuration of a store; every field has a safe default.

    ``store_text``: keep each node's text in ``ts:{R/sid}:txt`` (diagnostics,
    ``redis-cli``, PromptMismatch windows); off saves memory.
    ``max_payload_bytes``: refuse a single node payload above this size.
    ``cache_bytes``: bound of the client-side cache of immutable nodes.
    ``op_ttl_s``: how long the reply of a mutating script (and a settled
    lease's receipt) is kept for retries: 60 s covers redis-py's retries
    (3, backoff up to 0.5 s, 1 s socket timeout) and a caller's retry after
    a failover, and bounds what a run leaves behind (docs/capacity.md).
    ``replay_payload_bytes``: refuse a replay group whose payload JSON is larger.
    ``replay_declared_keys``: replay scripts get every key they touch in KEYS
    (a take or claim costs two round trips: plan, then commit), for servers
    that refuse undeclared keys in scripts (e.g. Dragonfly without
    ``allow-undeclared-keys``); off, they reach the group and session keys
    of their own slot by id (one round trip; docs/replay.md).
    """

    store_text: bool = True
    max_payload_bytes: int = 32 * 1024 * 1024
    cache_bytes: int = 64 * 1024 * 1024
    op_ttl_s: int = 60
    replay_payload_bytes: int = 64 * 1024
    replay_declared_keys: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.store_text, bool):
            raise ConfigError(f"store_text must be a bool, got {self.store_text!r:.80}")
        _int_option("max_payload_bytes", self.max_payload_bytes, 1, 2**31 - 1)
        _int_option("cache_bytes", self.cache_bytes, 0, 2**48)
        _int_option("replay_payload_bytes", self.replay_payload_bytes, 1, 2**31 - 1)
        _int_option("op_ttl_s", self.op_ttl_s, 1, 366 * 86400)
        if not isinstance(self.replay_declared_keys, bool):
            raise ConfigError(f"replay_declared_keys must be a bool, got {self.replay_declared_keys!r:.80}")

    def to_json(self) -> bytes:
        """The configuration as JSON (stored, informational, in ``ts:{R}:meta``)."""
        return orjson.dumps(self.__dict__)


class Fence:
    """The highest gate version one store has seen: a lower one means the run was rolled back.

    The gate's weight version only grows (DESIGN section 11). Every reply
    that carries it passes through :meth:`observe`, which raises
    StateRolledBack when it is lower than one seen before (a failover to a
    replica that lacked the install, or older data restored). Thread-safe.
    """

    def __init__(self) -> None:
        self._seen = 0
        self._lock = threading.Lock()

    @property
    def seen(self) -> int:
        """The highest version observed (0 before any)."""
        return self._seen

    def observe(self, version: int) -> None:
        """Record ``version``; raise StateRolledBack if it is below the highest one seen."""
        with self._lock:
            if version < self._seen:
                raise StateRolledBack("gate version", self._seen, version)
            self._seen = version

    def reset(self, version: int) -> None:
        """Make ``version`` the highest one seen, lower or not (accept a rolled-back state)."""
        with self._lock:
            self._seen = version


def _int_option(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(f"{name} must be an integer in {lo}..{hi}, got {shown}")


@dataclass
class Context:
    """Shared by the sync and async layers of one store; holds no connection."""

    keys: Keys
    cluster: bool
    config: StoreConfig
    #: Client-side caches keyed by name (the data plane keeps its node cache here).
    caches: dict[str, Any] = field(default_factory=dict)
    #: The highest gate version this store saw (rollback detection, :class:`Fence`).
    fence: Fence = field(default_factory=Fence)

    def op(self, op_id: str | None, kind: str) -> OpId:
        """The :class:`OpId` of one ``kind`` of mutating call: the caller's ``op_id`` (validated), else a fresh one.

        The one place an operation gets its op id. Drawn once per call, before
        the first attempt, so a retry of the same request carries the same id
        and the script replays its first reply. ``kind`` (``"release"``,
        ``"take"``...) scopes the op keys, so an op id reused for another
        kind of call never replays a reply of the wrong shape. Raises
        InvalidId for a bad ``op_id`` (before any I/O).
        """
        if op_id is None:
            return OpId(new_op_id(), self.keys, kind, given=False)
        return OpId(validate_op_id(op_id), self.keys, kind, given=True)

    def op_evals(
        self,
        name: str,
        items: Sequence[str],
        keys: Callable[[str, Sequence[str]], tuple[str, ...]],
        args: Callable[[Sequence[str]], tuple[Any, ...]],
        *,
        op: OpId,
        at_least_one: bool = False,
        start: int = 0,
    ) -> list[Eval]:
        """The calls of a mutating variadic script: one per chunk of ``items``, each with its op key.

        ``keys(op_key, chunk)`` and ``args(chunk)`` build one call's KEYS and
        ARGV; chunk ``i`` gets the op key ``op.key_of(i)``, so the same
        ``op_id`` and the same items give the same keys and every chunk
        replays. ``at_least_one``: one call with an empty chunk when
        ``items`` is empty. ``start``: the index of the first chunk (asking
        for the replay of chunk ``start`` onwards). Each chunk is one atomic
        script call.
        """
        sc = script(name)
        parts: list[Sequence[str]] = list(chunks(items, sc.chunk))
        if not parts and at_least_one:
            parts = [[]]
        return [
            Eval(sc, keys(op.key_of(i), part), args(part), op_id=op.id)
            for i, part in enumerate(parts, start)
        ]

    @property
    def op_ttl_ms(self) -> int:
        """How long (ms) a mutating script keeps its reply for retries (``StoreConfig.op_ttl_s``)."""
        return self.config.op_ttl_s * 1000


@dataclass(frozen=True)
class OpId:
    """The idempotency key of one mutating call, and the op keys of its parts.

    ``id`` is the caller's ``op_id=`` (``given``), or one drawn for the call;
    it is what an :class:`~tracestore.errors.OutcomeUnknown` carries. Op keys
    are ``ts:{R}:op:<kind>:<id>``. A call
    made of several atomic script calls (the chunks of a variadic call, the
    rounds of an expiry) gives each part the id ``<id>#<part>``: calling
    again with the same ``op_id`` and arguments makes the same parts, and
    each replays its recorded reply (``#`` is not allowed in a caller's id,
    so the parts of one call never meet another call's id).
    """

    id: str
    keys: Keys
    kind: str
    given: bool = True

    def part(self, *names: int | str) -> str:
        """The op id of a part of the call (``<id>#<name>#...``); the call's own id without names."""
        return "#".join((self.id, *(str(n) for n in names)))

    @property
    def key(self) -> str:
        """``ts:{R}:op:<kind>:<id>``: the op key of a call made of one script call."""
        return self.keys.op(f"{self.kind}:{self.id}")

    def key_of(self, *names: int | str) -> str:
        """The op key of a part; chunk 0 of a chunked call uses the call's own key."""
        if names == (0,):
            return self.key
        return self.keys.op(f"{self.kind}:{self.part(*names)}")

    def sub(self, *names: int | str) -> OpId:
        """The OpId of a nested call (its parts are named under this call's part)."""
        return OpId(self.part(*names), self.keys, self.kind, given=self.given)


def outcome_unknown(exc: StorageError, op_id: str, lease_ids: Sequence[str] = ()) -> OutcomeUnknown:
    """``exc`` as the OutcomeUnknown of call ``op_id`` (itself, renamed, when it already is one)."""
    if isinstance(exc, OutcomeUnknown):
        exc.op_id = op_id
        if lease_ids:
            exc.lease_ids = tuple(lease_ids)
            exc.lease_id = exc.lease_ids[0]
        return exc
    err = OutcomeUnknown(str(exc), op_id=op_id, lease_ids=lease_ids)
    err.__cause__ = exc.__cause__ or exc
    return err


def guarded(op: OpId | str, gen: Op[R], lease_ids: Sequence[str] = ()) -> Op[R]:
    """Run ``gen``; a StorageError escaping it becomes the OutcomeUnknown of ``op``.

    ScriptError (a script failed; nothing it wrote is relied on) passes
    unchanged; an OutcomeUnknown of a nested call is renamed to ``op``. So
    does NotEnoughReplicas: ``gen`` is one script, which the primary refused
    without running it.
    """
    op_id = op.id if isinstance(op, OpId) else op
    try:
        return (yield from gen)
    except (ScriptError, NotEnoughReplicas):
        raise
    except StorageError as exc:
        err = outcome_unknown(exc, op_id, lease_ids)
        if err is exc:
            raise
        raise err from err.__cause__


def _op_id_of(req: Any) -> str | None:
    if isinstance(req, Eval):
        return req.op_id
    if isinstance(req, Batch):
        return next((r.op_id for r in req.requests if isinstance(r, Eval) and r.op_id), None)
    return None


def mutating(f: Callable[P, Op[R]]) -> Callable[P, Op[R]]:
    """Decorate a mutating operation (it takes ``op_id: str | None = None``): its errors name its op id.

    Once the operation has sent a request that carries an op id (an
    :class:`~tracestore.scripts.Eval` with ``op_id``), a StorageError that
    escapes it (a broken connection, a timeout, a failure of a later step
    such as the purge after a release) becomes an
    :class:`~tracestore.errors.OutcomeUnknown` naming that op id; before
    that, nothing was written and the error stays a plain StorageError.
    ScriptError passes unchanged, and so does NotEnoughReplicas when the
    call's first mutating request, a single script, was refused (the primary
    ran nothing). The operation itself gets its op id from
    :meth:`Context.op` (the caller's, or a fresh one).
    """

    @functools.wraps(f)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Op[R]:
        gen = f(*args, **kwargs)
        op_id: str | None = None
        reply: Any = None
        exc: BaseException | None = None
        # True while nothing this call sent can have written: a refusal of its first
        # single-script request (NotEnoughReplicas: the primary ran nothing) is then known.
        untouched = True
        while True:
            try:
                req = gen.send(reply) if exc is None else gen.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            except ScriptError:
                raise
            except StorageError as err:
                if op_id is None or (untouched and isinstance(err, NotEnoughReplicas)):
                    raise
                unknown = outcome_unknown(err, op_id)
                if unknown is err:
                    raise
                raise unknown from unknown.__cause__
            if op_id is not None:
                untouched = False  # an earlier mutating request went through
            elif isinstance(req, Batch) and _op_id_of(req) and len(req.requests) > 1:
                untouched = False  # several scripts: some may have run before the refusal
            op_id = op_id or _op_id_of(req)
            try:
                reply, exc = (yield req), None
            except BaseException as thrown:  # thrown into the operation at its yield
                reply, exc = None, thrown

    return wrapper
