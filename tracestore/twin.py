"""One definition, two clients: how operations become sync methods and coroutines.

Every operation of tracestore is written once, as a generator that yields
requests (:mod:`tracestore.scripts`) and returns its result (an :data:`Op`).
A *runner* drives it: :class:`SyncRunner` executes each request and sends
the reply back, :class:`AsyncRunner` does the same with ``await``. The
stores (:class:`~tracestore.store.TraceStore`, :class:`~tracestore.store.AsyncTraceStore`)
are runners; so are their parts (gate, replay buffer, router) and the turn
recorders, which execute through the store they belong to.

A class body lists its methods once with the descriptors of this module:

* :class:`op` — ``lookup = op(traces.lookup)``: on a sync runner the
  attribute is ``Callable[P, R]``, on an async runner
  ``Callable[P, Coroutine[Any, Any, R]]``; the operation receives the
  runner's *scope* (the store's :class:`~tracestore.context.Context`, or the
  part's own state) as its first argument;
* :class:`scoped` — a generator that yields :class:`Body` once: a context
  manager on a sync runner, an async context manager on an async one
  (``weight_update``);
* :class:`part` and :class:`part_factory` — ``store.gate`` and
  ``store.router(...)``: the sync or async class of a part, whichever
  matches the store.

The sync class and the async class then only differ by their base
(``class Gate(GateMethods, SyncPart[Context])``), and mypy sees precise
types on both: ``await astore.lookup(...)`` is a ``PrefixMatch``. A third
base, :class:`OpBuilder`, gives the same list as methods that build the
operation without running it (``store.ops.lookup(...) -> Op[PrefixMatch]``),
to batch several with ``store.gather``.

A bound method carries a real ``__signature__`` (:func:`signature_of`): the
operation's parameters without the scope, and the caller's return type
(``PrefixMatch``; ``Coroutine[Any, Any, PrefixMatch]`` on an async runner),
so ``help()``, ``inspect.signature`` and IDEs show what the caller passes
and gets.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    Literal,
    ParamSpec,
    TypeVar,
    get_args,
    get_origin,
    get_type_hints,
    overload,
)

from .scripts import Op, Request

if TYPE_CHECKING:
    from typing_extensions import Self

C = TypeVar("C")  # the scope an operation receives first
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
S = TypeVar("S")
A = TypeVar("A")
X = TypeVar("X")
B = TypeVar("B")


@dataclass(frozen=True)
class Body(Generic[T]):
    """Yielded once by a :class:`scoped` operation: the ``with`` block runs here with ``value``.

    An exception of the block is thrown into the operation at this yield;
    the operation's ``finally`` clauses then run their requests too.
    """

    value: T


#: A scoped operation: yields requests and one :class:`Body`, returns nothing.
Scoped = Generator[Request | Body[T], Any, None]


class _BodyMissing(RuntimeError):
    pass


class SyncRunner(Generic[C]):
    """Runs operations synchronously, one request at a time, through :meth:`execute`.

    ``_scope`` is what the operations bound with :class:`op` receive first.
    """

    _scope: C

    def execute(self, request: Request) -> Any:
        """Execute one request (a script call, a pipeline, a command) and return its reply."""
        raise NotImplementedError

    def run(self, operation: Op[R]) -> R:
        """Drive ``operation`` to completion and return its result.

        Errors of a request are thrown into the operation at its yield (it
        may react); whatever it raises propagates. Round trips: those of the
        operation.
        """
        paused, value = self._advance(operation, None)
        if paused:
            err = _BodyMissing("a scoped operation cannot be run(); use it as a context manager")
            self._advance(operation, err)  # its cleanup runs (and normally re-raises err)
            raise err
        return value  # type: ignore[no-any-return]

    def _advance(self, gen: Generator[Any, Any, Any], exc: BaseException | None) -> tuple[bool, Any]:
        """Resume ``gen`` (throwing ``exc`` into it, if given) until it yields a Body or returns.

        ``(True, body value)`` or ``(False, result)``.
        """
        execute = self.execute
        try:
            req = gen.throw(exc) if exc is not None else gen.send(None)
            while not isinstance(req, Body):
                try:
                    reply = execute(req)
                except BaseException as err:  # the operation may react to it
                    req = gen.throw(err)
                else:
                    req = gen.send(reply)
            return True, req.value
        except StopIteration as stop:
            return False, stop.value

    @contextmanager
    def _scoped(self, gen: Scoped[T]) -> Iterator[T]:
        paused, value = self._advance(gen, None)
        if not paused:
            raise _BodyMissing("the scoped operation ended before its body")
        try:
            yield value
        except BaseException as exc:
            self._advance(gen, exc)  # normally re-raises exc, after the operation's cleanup
            raise
        else:
            if self._advance(gen, None)[0]:
                err = _BodyMissing("a scoped operation yielded its body twice")
                self._advance(gen, err)
                raise err


class AsyncRunner(Generic[C]):
    """Runs operations under asyncio: :class:`SyncRunner` with ``await`` at each request."""

    _scope: C

    async def execute(self, request: Request) -> Any:
        """Execute one request (a script call, a pipeline, a command) and return its reply."""
        raise NotImplementedError

    async def run(self, operation: Op[R]) -> R:
        """Drive ``operation`` to completion and return its result (see :meth:`SyncRunner.run`)."""
        paused, value = await self._advance(operation, None)
        if paused:
            err = _BodyMissing("a scoped operation cannot be run(); use it as a context manager")
            await self._advance(operation, err)
            raise err
        return value  # type: ignore[no-any-return]

    async def _advance(
        self, gen: Generator[Any, Any, Any], exc: BaseException | None
    ) -> tuple[bool, Any]:
        execute = self.execute
        try:
            req = gen.throw(exc) if exc is not None else gen.send(None)
            while not isinstance(req, Body):
                try:
                    reply = await execute(req)
                except BaseException as err:
                    req = gen.throw(err)
                else:
                    req = gen.send(reply)
            return True, req.value
        except StopIteration as stop:
            return False, stop.value

    @asynccontextmanager
    async def _scoped(self, gen: Scoped[T]) -> AsyncIterator[T]:
        paused, value = await self._advance(gen, None)
        if not paused:
            raise _BodyMissing("the scoped operation ended before its body")
        try:
            yield value
        except BaseException as exc:
            await self._advance(gen, exc)
            raise
        else:
            if (await self._advance(gen, None))[0]:
                err = _BodyMissing("a scoped operation yielded its body twice")
                await self._advance(gen, err)
                raise err


class OpBuilder(Generic[C]):
    """Builds the operations of a runner without running them: ``store.ops``.

    A class that lists its methods with :class:`op` (``StoreMethods``,
    ``GateMethods``...) and this base gets, for each method ``x``, a
    ``x(*args) -> Op[R]``: the operation ``x`` would run, to batch with
    others (``store.gather(store.ops.release_owner(...), store.ops.gate.settle(...))``)
    or to run later with ``store.run``. Nothing is validated or sent until
    the operation is run.
    """

    def __init__(self, scope: C) -> None:
        self._scope = scope


class SyncPart(SyncRunner[C]):
    """A part of a sync store (gate, replay buffer, router): executes through the store."""

    def __init__(self, store: SyncRunner[Any], scope: C) -> None:
        self._store = store
        self._scope = scope

    def execute(self, request: Request) -> Any:
        """Execute one request through the store (see :meth:`SyncRunner.execute`)."""
        return self._store.execute(request)


class AsyncPart(AsyncRunner[C]):
    """A part of an async store: executes through the store."""

    def __init__(self, store: AsyncRunner[Any], scope: C) -> None:
        self._store = store
        self._scope = scope

    async def execute(self, request: Request) -> Any:
        """Execute one request through the store (see :meth:`AsyncRunner.execute`)."""
        return await self._store.execute(request)


def _named(method: Callable[..., Any], f: Callable[..., Any], name: str, signature: inspect.Signature) -> Any:
    method.__name__ = name
    method.__qualname__ = name
    method.__doc__ = f.__doc__
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


#: How a bound operation returns its result: run (``R``), awaited (a coroutine of ``R``),
#: or built and not run (``Op[R]``, from ``store.ops``).
_Kind = Literal["sync", "async", "ops"]


def _hints(f: Callable[..., Any]) -> dict[str, Any]:
    """``f``'s annotations evaluated (they are strings under ``from __future__ import annotations``).

    An annotation that cannot be evaluated (a name imported only for type
    checking) leaves all of them as the strings they are.
    """
    try:
        return get_type_hints(f)
    except Exception:  # noqa: BLE001 - any failure to evaluate: keep the strings
        return dict(getattr(f, "__annotations__", {}))


def _result(annotation: Any, *, scoped: bool) -> Any:
    """``R`` of ``Op[R]``, or ``T`` of a scoped ``Scoped[T]``; the annotation itself if neither."""
    if isinstance(annotation, str):  # unevaluated: "Op[PrefixMatch]" -> "PrefixMatch"
        head = "Scoped[" if scoped else "Op["
        return annotation[len(head) : -1] if annotation.startswith(head) and annotation.endswith("]") else annotation
    args = get_args(annotation)
    if get_origin(annotation) is not Generator or len(args) != 3:
        return annotation
    if not scoped:
        return args[2]
    for arm in get_args(args[0]):
        if get_origin(arm) is Body:
            return get_args(arm)[0]
    return annotation


@functools.cache
def signature_of(f: Callable[..., Any], kind: _Kind, scoped: bool = False) -> inspect.Signature:
    """The public signature of operation ``f`` bound to a runner: no scope, the caller's return type.

    ``f(scope, *args) -> Op[R]`` becomes ``(*args) -> R`` on a sync runner,
    ``-> Coroutine[Any, Any, R]`` on an async one and ``-> Op[R]`` from an
    :class:`OpBuilder`; a scoped ``f`` (``Scoped[T]``) becomes a context
    manager of ``T`` (an async one on an async runner). Annotations are
    evaluated where they can be.
    """
    sig = inspect.signature(f)
    hints = _hints(f)
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in list(sig.parameters.values())[1:]]
    declared = hints.get("return", sig.return_annotation)
    result = _result(declared, scoped=scoped)
    returns: Any
    if kind == "ops":
        returns = declared
    elif isinstance(result, str):
        wrap = {
            ("sync", False): "{}",
            ("async", False): "Coroutine[Any, Any, {}]",
            ("sync", True): "AbstractContextManager[{}]",
            ("async", True): "AbstractAsyncContextManager[{}]",
        }[(kind, scoped)]
        returns = wrap.format(result)
    elif scoped:
        returns = (AbstractAsyncContextManager if kind == "async" else AbstractContextManager)[result]
    else:
        coroutine: Any = Coroutine  # subscripted with a value known at run time only
        returns = coroutine[Any, Any, result] if kind == "async" else result
    return sig.replace(parameters=params, return_annotation=returns)


class _Binding:
    """What :class:`op` and :class:`scoped` share: the operation and the name it is bound under."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self.f = f
        self.name = f.__name__
        self.__doc__ = f.__doc__

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.name = name


class op(_Binding, Generic[C, P, R]):  # noqa: N801 - used like a decorator/function
    """Bind an operation ``f(scope, *args) -> Op[R]`` as a method of sync and async runners.

    On an instance the attribute is made once and cached in the instance
    (so a hot path pays for the binding once). The method keeps ``f``'s
    docstring.
    """

    def __init__(self, f: Callable[Concatenate[C, P], Op[R]]) -> None:
        super().__init__(f)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: SyncRunner[C], owner: type[Any]) -> Callable[P, R]: ...
    @overload
    def __get__(
        self, obj: AsyncRunner[C], owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __get__(self, obj: OpBuilder[C], owner: type[Any]) -> Callable[P, Op[R]]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        f = self.f
        method: Callable[..., Any]
        kind: _Kind
        if isinstance(obj, AsyncRunner):
            arun, ascope = obj.run, obj._scope

            async def amethod(*args: Any, **kwargs: Any) -> Any:
                return await arun(f(ascope, *args, **kwargs))

            method, kind = amethod, "async"
        elif isinstance(obj, OpBuilder):
            bscope = obj._scope

            def build(*args: Any, **kwargs: Any) -> Any:
                return f(bscope, *args, **kwargs)

            method, kind = build, "ops"
        else:
            run, scope = obj.run, obj._scope

            def smethod(*args: Any, **kwargs: Any) -> Any:
                return run(f(scope, *args, **kwargs))

            method, kind = smethod, "sync"
        obj.__dict__[self.name] = _named(method, f, self.name, signature_of(f, kind))
        return method


class scoped(_Binding, Generic[C, P, T]):  # noqa: N801
    """Bind a scoped operation ``f(scope, *args)`` (yields one :class:`Body`) as a context manager.

    Sync runners get ``with x.f(...) as value:``, async runners
    ``async with x.f(...) as value:``, from the one generator.
    """

    def __init__(self, f: Callable[Concatenate[C, P], Scoped[T]]) -> None:
        super().__init__(f)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(
        self, obj: SyncRunner[C], owner: type[Any]
    ) -> Callable[P, AbstractContextManager[T]]: ...
    @overload
    def __get__(
        self, obj: AsyncRunner[C], owner: type[Any]
    ) -> Callable[P, AbstractAsyncContextManager[T]]: ...
    @overload
    def __get__(self, obj: OpBuilder[C], owner: type[Any]) -> Callable[P, Scoped[T]]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        f = self.f
        if isinstance(obj, OpBuilder):  # the scoped operation itself (a ``with`` runs it, not gather)

            def build(*args: Any, **kwargs: Any) -> Any:
                return f(obj._scope, *args, **kwargs)

            return _named(build, f, self.name, signature_of(f, "ops", scoped=True))

        def method(*args: Any, **kwargs: Any) -> Any:
            return obj._scoped(f(obj._scope, *args, **kwargs))

        kind: _Kind = "async" if isinstance(obj, AsyncRunner) else "sync"
        return _named(method, f, self.name, signature_of(f, kind, scoped=True))


class part(Generic[S, A, B]):  # noqa: N801
    """A part of a store made once per store: ``sync(store, scope)`` or ``async_(store, scope)``.

    ``store.gate`` is ``part(Gate, AsyncGate, GateOps, doc)``: a :class:`Gate`
    on a sync store, an :class:`AsyncGate` on an async one, and on the
    store's :class:`OpBuilder` (``store.ops.gate``) the part's builder
    ``ops(scope)``.
    """

    def __init__(
        self,
        sync: Callable[[Any, Any], S],
        async_: Callable[[Any, Any], A],
        ops: Callable[[Any], B],
        doc: str,
    ) -> None:
        self.sync = sync
        self.async_ = async_
        self.ops = ops
        self.name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: SyncRunner[Any], owner: type[Any]) -> S: ...
    @overload
    def __get__(self, obj: AsyncRunner[Any], owner: type[Any]) -> A: ...
    @overload
    def __get__(self, obj: OpBuilder[Any], owner: type[Any]) -> B: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        value: Any
        if isinstance(obj, OpBuilder):
            value = self.ops(obj._scope)
        else:
            make = self.async_ if isinstance(obj, AsyncRunner) else self.sync
            value = make(obj, obj._scope)
        obj.__dict__[self.name] = value
        return value


class part_factory(Generic[C, P, X, S, A, B]):  # noqa: N801
    """A method making a part of a store from arguments: ``store.router(entrypoints)``.

    ``scope(store scope, *args)`` validates the arguments (before any I/O)
    and returns the part's scope; the part is ``sync(store, scope)`` or
    ``async_(store, scope)``, and ``ops(scope)`` on the store's
    :class:`OpBuilder` (``store.ops.router(entrypoints)``).
    """

    def __init__(
        self,
        scope: Callable[Concatenate[C, P], X],
        sync: Callable[[SyncRunner[C], X], S],
        async_: Callable[[AsyncRunner[C], X], A],
        ops: Callable[[X], B],
        doc: str,
    ) -> None:
        self.scope = scope
        self.sync = sync
        self.async_ = async_
        self.ops = ops
        self.name = scope.__name__
        self.__doc__ = doc

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: SyncRunner[C], owner: type[Any]) -> Callable[P, S]: ...
    @overload
    def __get__(self, obj: AsyncRunner[C], owner: type[Any]) -> Callable[P, A]: ...
    @overload
    def __get__(self, obj: OpBuilder[C], owner: type[Any]) -> Callable[P, B]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        scope = self.scope
        made: Any
        if isinstance(obj, OpBuilder):
            ops = self.ops

            def method(*args: Any, **kwargs: Any) -> Any:
                return ops(scope(obj._scope, *args, **kwargs))

            made = ops
        else:
            make = self.async_ if isinstance(obj, AsyncRunner) else self.sync

            def method(*args: Any, **kwargs: Any) -> Any:
                return make(obj, scope(obj._scope, *args, **kwargs))

            made = make
        sig = inspect.signature(scope)
        hints = _hints(scope)
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in list(sig.parameters.values())[1:]]
        returns = made if isinstance(made, type) else sig.empty
        method.__name__ = method.__qualname__ = self.name
        method.__doc__ = self.__doc__
        method.__signature__ = sig.replace(parameters=params, return_annotation=returns)  # type: ignore[attr-defined]
        return method


__all__ = [
    "AsyncPart",
    "AsyncRunner",
    "Body",
    "OpBuilder",
    "Scoped",
    "SyncPart",
    "SyncRunner",
    "op",
    "part",
    "part_factory",
    "scoped",
    "signature_of",
]
