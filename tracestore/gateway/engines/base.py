"""The engine contract: what the gateway needs of an inference engine, engine-neutral (DESIGN section 13).

An engine adapter speaks one engine's HTTP protocol (``sglang``: SGLang's
native ``/generate``; ``vllm``: vLLM's OpenAI-compatible ``/v1/completions``
with token ids) and gives the gateway the same things back:

* :class:`EngineRequest` in: token ids, :class:`Sampling` parameters, whether
  routed experts are wanted, and the request id (``rid``) to abort it by;
* :class:`Chunk` out, one per piece of a stream (``stream``), or their sum,
  :class:`EngineOutput` (``generate``): token ids, one logprob per id, the
  finish reason (``stop``, ``length``, ``abort``) and the matched stop (a
  token id or a stop string), the engine's weight version when it has one,
  and the routed experts when asked and available;
* ``abort(rid)`` ends one request: its ``generate`` returns (its stream
  ends) with finish reason ``abort`` and the ids generated before the abort,
  so a caller can continue the generation later (partial rollouts);
* ``info()``: what the engine reports about itself (:class:`EngineInfo`:
  vocabulary size and context length where it reports them), for the
  gateway's start-up checks.

Failures are told apart because the gate settles them differently:
:class:`EngineRefused` (the connection was never made: the engine never saw
the request), :class:`EngineLost` (the connection broke, or timed out, after
the request was sent: outcome unknown), :class:`EngineRejected` (the engine
answered with an error status; 4xx means the request was bad).

Adapters register by name (:func:`register`); :func:`engine_class` finds
one (``--engine-api``). Adding an engine is one module of this package, named
as its ``api``, with one class and one ``@register`` line: the module is
found by its file (:func:`adapter_modules`) and nothing above this contract
changes. (``tracestore gc`` stops a dead gateway's requests with the
standard library only: an engine whose abort call
:mod:`tracestore.gate.aborts` does not know is stopped only when it is gone.)
"""

from __future__ import annotations

import functools
import weakref
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import aiohttp
import orjson

from ...traces import TokenIds


class EngineError(Exception):
    """Base class of engine call failures (``url`` names the engine)."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"engine {url}: {message}")
        self.url = url


class EngineRefused(EngineError):
    """The engine could not be reached: it never received the request."""


class EngineLost(EngineError):
    """The connection broke, or timed out, after the request was sent: outcome unknown."""


class EngineRejected(EngineError):
    """The engine answered with an error status (``status``; 4xx means a bad request)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(url, f"HTTP {status}: {message}")
        self.status = status
        self.detail = message


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request, engine-neutral.

    ``max_tokens``: most new tokens; ``temperature`` 0 is greedy;
    ``top_k`` -1 is off; ``stop``: stop strings; ``stop_token_ids``: ids that
    end the answer (the tokenizer's end-of-turn ids); ``ignore_eos``: go on
    past them; ``seed``: per-request sampling seed (None: the engine's).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class EngineRequest:
    """One generation: ``input_ids`` (the whole context), ``sampling``, and ``rid``.

    ``rid`` is the gateway's request id: ``abort(rid)`` ends it.
    ``routed_experts``: ask for the routed experts (engines that have them).
    """

    rid: str
    input_ids: Sequence[int]
    sampling: Sampling
    routed_experts: bool = False


@dataclass(frozen=True)
class Chunk:
    """A piece of a generation: the ids (and their logprobs) new since the previous piece.

    The last piece has ``finish`` (``stop``, ``length`` or ``abort``) and
    ``matched`` (the stop token id or stop string that ended it, None
    otherwise); ``routed_experts`` (base64 of int32 little-endian rows, one
    per token fed through the model: ``prompt + output - 1`` rows) and
    ``experts_shape`` (``[rows, layers, top_k]``, or None: rows kept flat)
    come with it when asked and available.
    """

    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish: str | None = None
    matched: int | str | None = None
    weight_version: str | None = None
    routed_experts: str | None = None
    experts_shape: tuple[int, ...] | None = None


#: The finish reasons of :attr:`Chunk.finish`.
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class EngineOutput:
    """A whole generation (or the sum of a stream's chunks so far)."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    matched: int | str | None = None
    weight_version: str | None = None
    routed_experts: str | None = None
    experts_shape: tuple[int, ...] | None = None

    def add(self, chunk: Chunk) -> None:
        """Fold ``chunk`` into this output (ids and logprobs appended, the rest replaced when set)."""
        self.output_ids.extend(chunk.ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish is not None:
            self.finish = chunk.finish
            self.matched = chunk.matched
        if chunk.weight_version is not None:
            self.weight_version = chunk.weight_version
        if chunk.routed_experts is not None:
            self.routed_experts = chunk.routed_experts
            self.experts_shape = chunk.experts_shape


@dataclass(frozen=True)
class EngineInfo:
    """What an engine reports about itself; None where it does not say.

    ``model``: its model name or path; ``vocab_size``: ids it accepts are
    ``[0, vocab_size)``; ``max_context``: most tokens of prompt + answer;
    ``weight_version``: the weights it serves now.
    """

    model: str | None = None
    vocab_size: int | None = None
    max_context: int | None = None
    weight_version: str | None = None


class Engine(Protocol):
    """One engine process, behind its HTTP protocol (an adapter, see the module docstring).

    Built with ``cls(url, session, timeout)``: ``session`` is the gateway's
    shared :class:`aiohttp.ClientSession`, ``timeout`` bounds a whole
    generation (past it the call is :class:`EngineLost`).
    """

    #: The ``--engine-api`` name of this adapter.
    api: ClassVar[str]
    #: Base URL (``http://host:port``).
    url: str

    async def generate(self, req: EngineRequest) -> EngineOutput:  # pragma: no cover - protocol
        """The whole generation. Raises EngineRefused / EngineLost / EngineRejected.

        An aborted request returns with ``finish == "abort"`` and the ids
        generated before the abort.
        """
        ...

    def stream(self, req: EngineRequest) -> AsyncIterator[Chunk]:  # pragma: no cover - protocol
        """The generation piece by piece; the last chunk has ``finish``.

        Raises EngineRefused / EngineLost / EngineRejected; EngineLost too
        when the stream ends without a finish reason.
        """
        ...

    async def abort(self, rid: str) -> bool:  # pragma: no cover - protocol
        """End request ``rid`` (its generation returns with ``finish == "abort"``).

        False when the engine could not be told. An abort of a request the
        engine has not seen yet may be remembered or lost, as the engine
        does; the gateway never relies on either.
        """
        ...

    async def stopped(self, rid: str) -> bool:  # pragma: no cover - protocol
        """After a lost connection: True when request ``rid`` is known not to run any more (the
        engine confirmed an abort, or it is gone), False when that cannot be shown (never raises)."""
        ...

    async def info(self) -> EngineInfo:  # pragma: no cover - protocol
        """What the engine reports about itself. Raises EngineRefused / EngineLost / EngineRejected."""
        ...

    async def health(self) -> bool:  # pragma: no cover - protocol
        """True when the engine answers its health check now (never raises)."""
        ...


EngineFactory = Callable[[str, aiohttp.ClientSession, aiohttp.ClientTimeout], Engine]

_REGISTRY: dict[str, Any] = {}

#: Modules of this package that are not adapters; every other module holds one, named as its
#: module (imported on first lookup; each registers itself): a new engine is one module.
NOT_ADAPTERS = frozenset({"base", "http", "wire"})


def adapter_modules() -> list[str]:
    """The adapter modules of this package (their names are the ``--engine-api`` names), sorted;
    read from the package's files, nothing imported (the CLI lists them in its help)."""
    here = Path(__file__).resolve().parent
    return sorted(p.stem for p in here.glob("*.py") if not p.stem.startswith("_") and p.stem not in NOT_ADAPTERS)


def register(cls: Any) -> Any:
    """Class decorator: make an adapter available under its ``api`` name (``--engine-api``)."""
    name = getattr(cls, "api", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls!r} has no api name")
    _REGISTRY[name] = cls
    return cls


def close_engines(engines: Iterable[Any]) -> None:
    """Close what adapters keep open of their own (``close()``, optional in the contract: the
    built-in adapters keep their turn calls' connections), at the gateway's shutdown."""
    for engine in engines:
        closer = getattr(engine, "close", None)
        if callable(closer):
            closer()


def engine_apis() -> list[str]:
    """The ``--engine-api`` names available, sorted."""
    import importlib

    for name in adapter_modules():
        importlib.import_module(f"{__package__}.{name}")
    return sorted(_REGISTRY)


def engine_class(api: str) -> EngineFactory:
    """The adapter class registered as ``api``; KeyError naming the choices when there is none."""
    names = engine_apis()
    if api not in _REGISTRY:
        raise KeyError(f"unknown engine api {api!r}; choose one of {names}")
    factory: EngineFactory = _REGISTRY[api]
    try:  # ids_json's numpy, imported with the engines rather than on a first turn's engine call
        import numpy  # noqa: F401
    except ImportError:  # (the gateway extra has it; the package imports without it)
        pass
    return factory


class _SentIds:
    """The JSON text of the longest view of each shared id buffer sent lately (the stored paths
    of the sessions in flight), so a session's next turn writes only its new ids: a path's
    buffer only ever grows at its end (:meth:`TokenIds.extended`), so the text of its first
    ``count`` ids never changes. An entry lives while its buffer does (a weak reference) and
    while the texts fit in ``max_bytes`` (least recently sent dropped first): a cache of the
    turns in flight, not a copy of every idle session's path."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._texts: OrderedDict[int, tuple[weakref.ref[Any], int, bytes]] = OrderedDict()

    def text(self, buf: array, n: int) -> bytes:  # type: ignore[type-arg]
        """``buf[:n]`` as a JSON array's bytes; O(ids after the longest text kept for ``buf``)."""
        import numpy as np  # the gateway extra has numpy (imported by engine_class: not on a first turn)

        key = id(buf)
        got = self._texts.get(key)
        if got is not None and got[0]() is not buf:
            got = None
        count, text = (got[1], got[2]) if got is not None else (0, b"[]")
        if count == n:
            if got is not None:
                self._texts.move_to_end(key)
            return text
        if count > n:  # a shorter view (a fork back to an earlier prompt): not kept
            return orjson.dumps(np.frombuffer(buf[:n], dtype=np.int32), option=JSON_OPTS)
        more = orjson.dumps(np.frombuffer(buf[count:n], dtype=np.int32), option=JSON_OPTS)  # a copy of the new ids
        # kept: an exact-size copy (orjson's own bytes keep the capacity it reserved, 3-10x their
        # length for an id array: kept as they are, 8.6 MB of texts took ~90 MB)
        # (one copy of the kept text: ``text[:-1] + b"," + more[1:]`` made three, ~0.2 MB each at 32k)
        out = memoryview(more).tobytes() if count == 0 else b"".join((memoryview(text)[:-1], b",", memoryview(more)[1:]))
        self._drop(key, got[0] if got is not None else None)
        if len(out) <= self.max_bytes:
            ref = got[0] if got is not None else weakref.ref(buf, functools.partial(self._drop, key))
            self._texts[key] = (ref, n, out)
            self.nbytes += len(out)
            while self.nbytes > self.max_bytes:
                _, (_, _, old) = self._texts.popitem(last=False)
                self.nbytes -= len(old)
        return out

    def _drop(self, key: int, ref: weakref.ref[Any] | None) -> None:
        got = self._texts.get(key)
        if got is not None and (ref is None or got[0] is ref):
            del self._texts[key]
            self.nbytes -= len(got[2])


_SENT = _SentIds()


def ids_json(ids: Sequence[int]) -> Any:
    """``ids`` in the form the engines' JSON bodies take them (dumped with :data:`JSON_OPTS`):
    token ids held as int32 (``TokenIds``: a stored path extended by the turn's new ids) as an
    ``orjson.Fragment`` of their JSON text, kept per path buffer, so each turn writes only the
    ids added since the session's last turn (a 32k context: ~0.2 ms less than writing them all);
    an ``array('i')`` as a numpy view (no Python int per id); a list or tuple as it is."""
    if isinstance(ids, (list, tuple)):
        return ids
    if isinstance(ids, TokenIds):
        return orjson.Fragment(_SENT.text(*ids.shared()))
    if isinstance(ids, array) and ids.typecode == "i":
        import numpy as np

        return np.frombuffer(ids, dtype=np.int32)
    return list(ids)


#: orjson options of the engines' JSON bodies (:func:`ids_json`'s numpy views).
JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


def json_body(ids_field: str, ids: Sequence[int], rest: dict[str, Any]) -> bytes:
    """``{ids_field: ids, **rest}`` as the JSON bytes of an engine call (:data:`JSON_OPTS`).

    A stored path's ids (``TokenIds``) go in as :func:`ids_json`'s kept text, joined in one copy:
    orjson copies a ``Fragment`` into a buffer it grows by copies, and the text of a 32k context
    is ~0.2 MB. Other ids are dumped with ``rest``."""
    if not isinstance(ids, TokenIds):
        return orjson.dumps({ids_field: ids_json(ids), **rest}, option=JSON_OPTS)
    text = _SENT.text(*ids.shared())
    tail = orjson.dumps(rest, option=JSON_OPTS)  # b"{...}"
    return b"".join((b'{"%s":' % ids_field.encode(), text, b"," if len(tail) > 2 else b"", memoryview(tail)[1:]))


def extend_ids(ids: Sequence[int], more: Sequence[int]) -> Sequence[int]:
    """``ids`` followed by ``more``: a stored path's ``TokenIds`` extended in O(len(more)) (no
    Python int per id of the path), anything else as a new list."""
    if not more:
        return ids
    if isinstance(ids, TokenIds):
        return ids.extended(more)
    return [*ids, *more]


__all__ = [
    "NOT_ADAPTERS",
    "JSON_OPTS",
    "FINISH_REASONS",
    "Chunk",
    "Engine",
    "EngineError",
    "EngineFactory",
    "EngineInfo",
    "EngineLost",
    "EngineOutput",
    "EngineRefused",
    "EngineRejected",
    "EngineRequest",
    "Sampling",
    "adapter_modules",
    "engine_apis",
    "engine_class",
    "extend_ids",
    "ids_json",
    "json_body",
    "register",
]
