"""Lua script registry and the requests that operations yield (pure core, no I/O).

Each ``lua/<name>.lua`` file opens with a contract header::

    #!lua flags=no-writes          (optional; read-only scripts)
    -- script: <name>
    -- KEYS: 3                      (exact count) or 2+ (2 fixed, then a variadic tail)
    -- CHUNK: 4000                  (optional: max variadic items per call)
    -- KEYS[1] = ...                (one line per key, free text)
    -- ARGV[1] = ...
    -- returns: ...
    -- errors: CODE (fields), ...

Every script returns a flat array whose first element is an integer status:
``0`` then the result, or ``1`` then an error code and its fields (mapped
to exceptions by :func:`tracestore.errors.raise_for_code`). The executor
strips the status, so an operation sees only the result.

Operations are written once as generators that yield requests
(:class:`Eval`, :class:`Batch`, :class:`Cmd`, :class:`ScanAll`,
:class:`ServerTime`, :class:`Blocking`) and receive their replies; the sync
and asyncio runners (:mod:`tracestore.twin`) drive the same generator.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

from .errors import InvalidInput, ScriptError, TracestoreError
from .keys import same_slot

#: Lua's ``unpack`` fails somewhere above 8000 values; stay well below it.
LUA_UNPACK_LIMIT = 7999
DEFAULT_CHUNK = 4000

_KEYS_RE = re.compile(r"^--\s*KEYS:\s*(\d+)(\+?)\s*$", re.M)
_CHUNK_RE = re.compile(r"^--\s*CHUNK:\s*(\d+)\s*$", re.M)
_NAME_RE = re.compile(r"^--\s*script:\s*([a-z0-9_]+)\s*$", re.M)


def new_op_id() -> str:
    """A fresh operation id: the idempotency token of one mutating call.

    Generated once per call, before the first attempt, so redis-py's retries
    of the same command carry the same id and the script replays its reply.
    """
    return os.urandom(16).hex()  # (as uuid4().hex: 32 hex characters, without building a UUID)


@dataclass(frozen=True)
class Script:
    """One loaded Lua script and its contract."""

    name: str
    source: str
    sha: str
    nkeys: int
    variadic: bool
    chunk: int
    readonly: bool

    def check_keys(self, keys: Sequence[str]) -> None:
        """Raise ScriptError unless ``keys`` matches the declared KEYS count."""
        n = len(keys)
        if (self.variadic and n < self.nkeys) or (not self.variadic and n != self.nkeys):
            want = f"{self.nkeys}{'+' if self.variadic else ''}"
            raise ScriptError(self.name, f"called with {n} KEYS, contract declares {want}")


def parse_script(name: str, source: str) -> Script:
    """Parse a script's contract header; raise ScriptError if it is missing or wrong."""
    m_name = _NAME_RE.search(source)
    if not m_name or m_name.group(1) != name:
        raise ScriptError(name, "contract header must contain '-- script: <file name>'")
    m_keys = _KEYS_RE.search(source)
    if not m_keys:
        raise ScriptError(name, "contract header must declare '-- KEYS: <n>' or '<n>+'")
    m_chunk = _CHUNK_RE.search(source)
    chunk = int(m_chunk.group(1)) if m_chunk else DEFAULT_CHUNK
    if not 0 < chunk <= LUA_UNPACK_LIMIT:
        raise ScriptError(name, f"CHUNK must be in 1..{LUA_UNPACK_LIMIT}")
    first = source.split("\n", 1)[0]
    return Script(
        name=name,
        source=source,
        sha=hashlib.sha1(source.encode()).hexdigest(),
        nkeys=int(m_keys.group(1)),
        variadic=m_keys.group(2) == "+",
        chunk=chunk,
        readonly=first.startswith("#!lua") and "no-writes" in first,
    )


def lua_dir() -> Path:
    """Directory holding the ``*.lua`` files.

    A built wheel carries them as package data (``tracestore/lua``); an
    editable install or a source checkout reads the top-level ``lua/``.
    """
    packaged = resources.files("tracestore").joinpath("lua")
    if packaged.is_dir():
        return Path(str(packaged))
    source = Path(__file__).resolve().parent.parent / "lua"
    if source.is_dir():
        return source
    raise ScriptError("*", f"no lua/ directory found (looked in {packaged} and {source})")


_INCLUDE_RE = re.compile(r"^--\s*include:\s*([a-z0-9_]+)\s*$", re.M)


def expand_includes(name: str, source: str, lib: Path) -> str:
    """Inline ``-- include: <lib>`` lines with ``lua/_lib/<lib>.lua`` (one level).

    Shared Lua helpers (idempotent replies, session moves and releases) live
    once in ``lua/_lib``; the SHA of a script is taken over the expanded text.
    """

    def sub(m: re.Match[str]) -> str:
        path = lib / f"{m.group(1)}.lua"
        if not path.is_file():
            raise ScriptError(name, f"include {m.group(1)!r} not found in {lib}")
        return f"-- begin include {m.group(1)}\n{path.read_text(encoding='utf-8').rstrip()}\n-- end include {m.group(1)}"

    return _INCLUDE_RE.sub(sub, source)


@cache
def registry() -> dict[str, Script]:
    """All scripts by name (``lua/*.lua``, includes expanded), loaded once per process."""
    out: dict[str, Script] = {}
    root = lua_dir()
    for path in sorted(root.glob("*.lua")):
        text = expand_includes(path.stem, path.read_text(encoding="utf-8"), root / "_lib")
        out[path.stem] = parse_script(path.stem, text)
    return out


def script(name: str) -> Script:
    """The script called ``name``."""
    try:
        return registry()[name]
    except KeyError:
        raise ScriptError(name, "no such script in lua/") from None


# -- requests yielded by operations ------------------------------------------------------


@dataclass(frozen=True)
class Eval:
    """Run ``script`` with ``keys`` and ``args`` (EVALSHA, reloaded on NOSCRIPT).

    ``op_id``: the idempotency token of a mutating call (its op key is in
    ``keys``), so that an error whose outcome is unknown can name it; None
    for scripts without one.
    """

    script: Script
    keys: tuple[str, ...]
    args: tuple[Any, ...] = ()
    op_id: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.script.check_keys(self.keys)
        # A script must touch keys of one slot only (cluster-safe by construction);
        # checked here, before any I/O, on standalone servers too.
        if not same_slot(self.keys):
            raise ScriptError(self.script.name, f"KEYS span several hash slots: {list(self.keys)[:4]}")


@dataclass(frozen=True)
class Cmd:
    """A plain Redis command; ``key`` routes it on a cluster (None: any primary).

    ``block_s`` marks a blocking command (BLPOP, XREADGROUP BLOCK) that may wait
    that many seconds: the I/O layer runs it on a connection whose read timeout
    allows for it.
    """

    args: tuple[Any, ...]
    key: str | None = None
    block_s: float | None = None


@dataclass(frozen=True)
class ScanAll:
    """SCAN ``pattern`` on every primary; the reply is a list of key names (str)."""

    pattern: str
    count: int = 1000
    type: str | None = None


@dataclass(frozen=True)
class Batch:
    """Several Eval/Cmd requests pipelined (grouped by node on a cluster).

    The reply is the list of their replies in order. Requests in a batch are
    not atomic together; each script is atomic on its own. A failed request
    raises its typed error after the whole batch ran (the first one), or,
    with ``errors_in_place``, stands in the reply list in its place.
    """

    requests: tuple[Eval | Cmd, ...] = field(default_factory=tuple)
    errors_in_place: bool = False


@dataclass(frozen=True)
class ServerTime:
    """The server clock in milliseconds (``TIME`` on the node of ``key``)."""

    key: str | None = None


@dataclass(frozen=True)
class Blocking:
    """Call ``fn()`` (local file I/O) and reply with its result.

    The sync runner calls it in place; the asyncio runner in a worker
    thread, so an operation never blocks the event loop.
    """

    fn: Callable[[], Any]


Request = Eval | Cmd | ScanAll | Batch | ServerTime | Blocking
R = TypeVar("R")
#: An operation: a generator yielding requests and returning its result.
Op = Generator[Request, Any, R]
_REQUESTS = (Eval, Cmd, ScanAll, Batch, ServerTime, Blocking)


@overload
def gather(operations: Iterable[Op[R]], *, errors_in_place: Literal[False] = False) -> Op[list[R]]: ...
@overload
def gather(
    operations: Iterable[Op[R]], *, errors_in_place: Literal[True]
) -> Op[list[R | TracestoreError]]: ...


def gather(operations: Iterable[Op[Any]], *, errors_in_place: bool = False) -> Op[list[Any]]:
    """Run several operations at once, sharing round trips; their results in order.

    Each step takes the next request of every unfinished operation: script
    calls and commands (and the requests of their batches) go out as one
    pipelined :class:`Batch`, one round trip (per node on a cluster);
    anything else (scans, server time, local file work, blocking commands)
    runs alone. So N independent one-round-trip calls cost one round trip,
    and a call that needs two shares both with the others. Not atomic
    together: each operation keeps its own guarantees. A round trip's
    requests reach each node in the order given, except that one sent
    again (NOSCRIPT on a script's first call there, a cluster redirect)
    runs after the others: an operation that reads what another one of
    the same round trip writes must check that it saw it.

    Errors: an operation that fails before its first request (validation)
    fails the whole call before any I/O; later errors of one operation do
    not stop the others. Then the first error (in the order given) is
    raised once all have finished, or, with ``errors_in_place``, each
    failed operation's TracestoreError stands in the result list. A round
    trip that fails as a whole (StorageError: connection lost) is thrown
    into each operation it carried (so a mutating one turns it into its
    OutcomeUnknown, naming its op id), and the first of theirs is raised,
    even with ``errors_in_place``: it is not one operation's failure.
    Run it like any operation: ``store.run(gather([...]))``.
    """
    gens = list(operations)
    out: list[Any] = [None] * len(gens)
    errors: dict[int, TracestoreError] = {}
    pending: dict[int, Request] = {}

    def advance(i: int, value: Any = None, exc: BaseException | None = None) -> None:
        try:
            req = gens[i].throw(exc) if exc is not None else gens[i].send(value)
        except StopIteration as stop:
            out[i] = stop.value
            pending.pop(i, None)
            return
        except TracestoreError as err:
            errors[i] = err
            pending.pop(i, None)
            return
        if not isinstance(req, _REQUESTS):
            gens[i].close()
            raise ScriptError("gather", f"operation {i} yielded {type(req).__name__}, not a request")
        pending[i] = req

    for i in range(len(gens)):
        advance(i)
    if errors and not errors_in_place:  # refused before any I/O: send nothing
        for g in gens:
            g.close()
        raise errors[min(errors)]
    while pending:
        flat: list[Eval | Cmd] = []
        spans: list[tuple[int, int, int]] = []  # (operation, first request, count)
        alone: list[int] = []
        for i, req in pending.items():
            if isinstance(req, Batch):
                spans.append((i, len(flat), len(req.requests)))
                flat.extend(req.requests)
            elif isinstance(req, Eval) or (isinstance(req, Cmd) and req.block_s is None):
                spans.append((i, len(flat), 1))
                flat.append(req)
            else:
                alone.append(i)
        for i in alone:
            try:
                reply = yield pending[i]
            except TracestoreError as alone_err:
                advance(i, exc=alone_err)
            else:
                advance(i, reply)
        try:
            replies: list[Any] = (yield Batch(tuple(flat), errors_in_place=True)) if flat else []
        except TracestoreError as whole:
            # The round trip itself failed (connection lost, reply unknown...): it is every
            # operation's error (a mutating one names its own op id), and the call's.
            hit = []
            for i, _, _ in spans:
                advance(i, exc=whole)
                if i in errors:
                    hit.append(i)
            for g in gens:  # (any operation still waiting for a request: it will not get it)
                g.close()
            raised = errors[min(hit)] if hit else whole
            if raised is whole:
                raise
            raise raised from raised.__cause__
        for i, start, count in spans:
            req = pending[i]
            part = replies[start : start + count]
            if isinstance(req, Batch):
                first = next((r for r in part if isinstance(r, TracestoreError)), None)
                if first is not None and not req.errors_in_place:
                    advance(i, exc=first)
                else:
                    advance(i, list(part))
            elif isinstance(part[0], TracestoreError):
                advance(i, exc=part[0])
            else:
                advance(i, part[0])
    if errors_in_place:
        for i, failed in errors.items():
            out[i] = failed
    elif errors:
        raise errors[min(errors)]
    return out

T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Split ``items`` into consecutive slices of at most ``size`` (none if empty)."""
    if size <= 0:
        raise InvalidInput("size", "chunk size must be positive")
    for i in range(0, len(items), size):
        yield items[i : i + size]


def variadic_evals(
    name: str,
    fixed_keys: Sequence[str],
    item_keys: Sequence[str],
    fixed_args: Sequence[Any] = (),
    item_args: Sequence[Any] = (),
    *,
    args_per_item: int = 1,
) -> list[Eval]:
    """Build the Evals of a variadic script, chunked below Lua's unpack limit.

    ``item_keys`` (one key per item, may be empty) and ``item_args``
    (``args_per_item`` values per item, may be empty) are split together into
    chunks of the script's CHUNK size. Each chunk is one atomic call.
    """
    sc = script(name)
    if not sc.variadic:
        raise ScriptError(name, "not a variadic script")
    n_items = len(item_keys) if item_keys else len(item_args) // max(args_per_item, 1)
    if item_keys and item_args and len(item_args) != n_items * args_per_item:
        raise ScriptError(name, "item_keys and item_args disagree in length")
    out: list[Eval] = []
    for start in range(0, n_items, sc.chunk):
        stop = min(start + sc.chunk, n_items)
        ks = tuple(fixed_keys) + tuple(item_keys[start:stop])
        a = tuple(fixed_args) + tuple(item_args[start * args_per_item : stop * args_per_item])
        out.append(Eval(sc, ks, a))
    return out


def group_by_slot(keys_of: Iterable[tuple[int, T]]) -> dict[int, list[T]]:
    """Group items by hash slot: ``[(slot, item), ...] -> {slot: [item, ...]}``."""
    out: dict[int, list[T]] = {}
    for slot, item in keys_of:
        out.setdefault(slot, []).append(item)
    return out
