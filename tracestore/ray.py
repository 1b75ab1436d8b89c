"""Ray side of ownership (DESIGN section 5): :class:`RefHolder` and :data:`RefHolderActor`.

A rollout worker or session server keeps the routed-expert arrays of its
sessions in the Ray object store and stores only their *expert keys* in the
trace. The holder owns the ``ObjectRef`` of every value it was given, lends
refs to the trainer, and drops them when Redis says the session is gone.
:meth:`RefHolder.put` stores one value per ``ray.put`` (key
``rx:<holder>:<n>``); :meth:`RefHolder.put_many` stores the values of many
turns and sessions (a rollout round) in ONE ``ray.put`` of a list (key
``rx:<holder>:<n>.<i>``: item ``i`` of object ``n``), and keeps that shared
ref until the last session using it is released. :meth:`RefHolder.keep` puts
nothing yet: the value stays in the holder's process until :meth:`RefHolder.get`
lends it, and the kept values one ``get`` lends go into one object (the
gateway keeps its turns' experts so: no ``ray.put`` on a turn's path). A
consumer turns lent refs into values with :func:`expert_values` (one
``ray.get`` for the distinct refs); the holder drops refs:

* a background thread reads ``ts:{R}:events`` with the holder's own consumer
  group (``XREADGROUP ... BLOCK``), drops every ref of each released session
  it holds and acknowledges the entries (its own pending entries are read
  again after a restart, so an event read but not yet handled is not lost);
* every ``reconcile_s`` seconds (and when it starts, and when its group was
  removed by ``gc``) it asks the control plane for the state of every session
  it holds and drops the released ones, and the unknown ones older than
  ``grace_s``, so a missed event cannot leak.

Ray 2.60 has no explicit free: an object leaves the store when its last
reference goes. Dropping the holder's ref frees it, unless a borrower (the
trainer, another actor) still holds a ref it was lent; then it goes when the
borrower drops it. Values may be numpy arrays, torch tensors or anything
``ray.put`` accepts; numpy and torch are never imported here.

Only this module imports Ray; the core library imports without it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from .errors import InvalidId, InvalidInput, TracestoreError

# the event-stream operations stay importable from here (they lived in this module)
from .events import ack_events as ack_events
from .events import destroy_events_group as destroy_events_group
from .events import ensure_events_group as ensure_events_group
from .events import events_groups as events_groups
from .events import read_events as read_events
from .store import TraceStore
from .validate import duration_ms, validate_id, validate_ids

log = logging.getLogger(__name__)

#: Holder names: they appear in expert keys, which live in the trace index
#: (comma-separated records), so they are stricter than other ids.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,100}\Z")
#: How many released sids a holder remembers, to refuse late puts at once.
_RECENT_RELEASED = 100_000
#: ``rx:<holder>:<n>`` (a value of its own) or ``rx:<holder>:<n>.<i>`` (item ``i`` of a shared list).
_KEY_RE = re.compile(r"rx:[A-Za-z0-9._-]{1,100}:[0-9]+(?:\.([0-9]+))?\Z")


class ExpertRefMissing(TracestoreError, KeyError):
    """The holder has no ref for an expert key: its session was released, or another holder made it."""

    def __init__(self, key: str, holder: str) -> None:
        self.key = key
        self.holder = holder
        super().__init__(
            f"expert key {key!r} is not held by holder {holder!r} (session released, "
            "or the key belongs to another holder)"
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True)
class HolderStats:
    """What a holder keeps right now, and what it has done since it started."""

    #: Sessions with at least one held ref.
    sessions: int
    #: Values held: ObjectRefs (a ref shared by the sessions of a :meth:`RefHolder.put_many`
    #: counts once) and values kept in this process until lent (:meth:`RefHolder.keep`).
    refs: int
    #: Bytes of the held values (``nbytes`` of arrays and tensors; 0 when unknown).
    bytes: int
    #: Release events read from the stream (including those for sessions it did not hold).
    events: int
    #: ObjectRefs dropped because their sessions were released (events, reconcile, ``drop``);
    #: a shared ref counts once, when the last session using it goes.
    dropped: int
    #: Reconcile passes run.
    reconciles: int
    #: Expert keys held (one per value put; several keys may name one shared ref).
    keys: int = 0
    #: Values put for a session this holder had already seen released (a key, no ref kept).
    late: int = 0
    #: Of ``refs``: values kept in this process (:meth:`RefHolder.keep`) that were not lent yet.
    kept: int = 0


def _nbytes(value: Any) -> int:
    n = getattr(value, "nbytes", None)  # numpy arrays, and torch tensors since 2.1
    if isinstance(n, int):
        return n
    try:
        return int(value.element_size() * value.nelement())  # older torch tensors
    except (AttributeError, TypeError):
        return 0


def expert_index(key: str) -> int | None:
    """The list index an expert key names in its shared object (``rx:<holder>:<n>.<i>`` -> ``i``).

    None for the key of a value stored on its own (``rx:<holder>:<n>``).
    Raises InvalidInput for a string that is not a holder's expert key.
    """
    m = _KEY_RE.match(key) if isinstance(key, str) else None
    if m is None:
        raise InvalidInput("expert key", f"not a RefHolder expert key: {key!r:.120}")
    return None if m.group(1) is None else int(m.group(1))


def expert_values(keys: Sequence[str], refs: Sequence[Any]) -> list[Any]:
    """The values of expert ``keys`` from the refs a holder lent for them (``RefHolder.get``), in order.

    One ``ray.get`` for the distinct refs (the keys of a ``put_many`` share
    one), then item ``i`` of a shared list for a key ``...<n>.<i>``. The
    values may be read-only views of the object store (numpy): copy before
    writing. Raises InvalidInput (a key that is not an expert key, or a
    length mismatch), and what ``ray.get`` raises for a lost object.
    """
    if isinstance(keys, str):
        raise InvalidInput("keys", "expected a list of expert keys, got a single string")
    if len(keys) != len(refs):
        raise InvalidInput("refs", f"{len(refs)} refs for {len(keys)} keys")
    index = [expert_index(k) for k in keys]
    distinct: dict[Any, int] = {}
    for r in refs:
        distinct.setdefault(r, len(distinct))
    got = ray.get(list(distinct)) if distinct else []
    return [
        _value(got[distinct[r]], k, i) for k, r, i in zip(keys, refs, index, strict=True)
    ]


class _Lent(dict):  # type: ignore[type-arg]
    """The object a lend of kept values puts (:meth:`RefHolder.get`): ``{expert key: value}``."""


def _value(obj: Any, key: str, index: int | None) -> Any:
    """Key ``key``'s value in the object ``obj`` its lent ref names."""
    if isinstance(obj, _Lent):
        return obj[key]
    return obj if index is None else obj[index]


@dataclass
class _Held:
    """One ObjectRef the holder keeps (or one value kept in process: ``ref`` None), and the
    sessions whose keys still name it."""

    seq: int
    ref: Any
    nbytes: int
    users: set[str] = field(default_factory=set)
    value: Any = None  # a kept value (:meth:`RefHolder.keep`) until it is lent


class RefHolder:
    """Keeps the ``ObjectRef`` of each value put for a session until the session is released.

    ``store``: a :class:`~tracestore.TraceStore` of the run (shared, thread-safe).
    ``name``: the holder's consumer group on ``ts:{R}:events`` and the prefix of
    its expert keys (``[A-Za-z0-9._-]{1,100}``); give a stable name to resume
    after a restart, or None for a fresh random one whose group is destroyed on
    :meth:`close`. ``reconcile_s``: period of the reconcile pass. ``grace_s``:
    how long a session may be unknown to the control plane (put before it was
    opened) before reconcile drops it (default: ``reconcile_s``).
    ``block_s``: XREADGROUP block time (also the worst-case :meth:`close` delay).
    ``start``: start the background consumer now (else call :meth:`start`).

    Lifetime of a shared ref (:meth:`put_many`): it is kept while at least
    one session whose value it holds is not released; each release (event,
    reconcile or :meth:`drop`) removes that session's keys and its use of
    the ref, and the ref is dropped (once) with its last user.

    Raises InvalidId for a bad name. Thread-safe.
    """

    def __init__(
        self,
        store: TraceStore,
        name: str | None = None,
        *,
        reconcile_s: float = 30.0,
        grace_s: float | None = None,
        block_s: float = 0.5,
        batch: int = 1000,
        start: bool = True,
    ) -> None:
        if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name)):
            raise InvalidId("holder name", name, "must match [A-Za-z0-9._-]{1,100}")
        duration_ms("reconcile_s", reconcile_s)
        duration_ms("block_s", block_s)
        self.store = store
        self.name = name or f"holder-{uuid.uuid4().hex[:12]}"
        self.ephemeral = name is None
        self.reconcile_s = float(reconcile_s)
        self.grace_s = float(self.reconcile_s if grace_s is None else grace_s)
        self.block_s = float(block_s)
        self.batch = int(batch)
        self._consumer = self.name
        self._lock = threading.Lock()
        self._seq = 0
        self._keys: dict[str, tuple[str, _Held]] = {}  # expert key -> (sid, the ref it names)
        self._held: dict[int, _Held] = {}  # object seq -> held ref (one per ray.put kept)
        self._by_sid: dict[str, list[str]] = {}
        self._late = 0
        self._since: dict[str, float] = {}  # sid -> monotonic time of its first put
        self._bytes = 0
        self._released: OrderedDict[str, None] = OrderedDict()
        self._events = 0
        self._dropped = 0
        self._reconciles = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # -- the holder's API ---------------------------------------------------------------

    def put(self, sid: str, value: Any) -> str:
        """``ray.put(value)`` and keep its ref under session ``sid``; returns the expert key.

        The key (``rx:<holder>:<n>``) has no whitespace, braces or commas, so it
        can be stored in the trace index (``record_turn(..., *_expert_key=key)``).
        A session this holder already saw released gets a key but no ref (the
        value is not put: it would never be read). Raises InvalidId (sid). No
        Redis round trip. For many values at once use :meth:`put_many`.
        """
        validate_id("session id", sid)
        with self._lock:
            late = sid in self._released
        ref = None if late else ray.put(value)
        with self._lock:
            self._seq += 1
            key = f"rx:{self.name}:{self._seq}"
            if ref is not None and sid not in self._released:
                self._keep(_Held(self._seq, ref, _nbytes(value)), [(sid, key)])
            else:
                self._late += 1
        return key

    def put_many(self, items: Sequence[tuple[str, Any]]) -> list[str]:
        """Keep many values in ONE ``ray.put`` (a list); returns each item's expert key, in order.

        ``items`` are ``(sid, value)`` pairs, of any sessions (a session may
        have several). The values of sessions not seen released go into one
        object, a list; item ``i`` of it gets the key ``rx:<holder>:<n>.<i>``
        (no whitespace, braces or commas, ready for the trace index). The
        shared ref is kept until every session with a value in it is released
        (events, reconcile, :meth:`drop`), then dropped once: one session's
        release does not free the others' values, and :meth:`get` lends the
        shared ref for each of its keys (resolve with :func:`expert_values`).
        A session already seen released gets a key but no ref, as with
        :meth:`put`. Raises InvalidInput / InvalidId before anything is put.
        No Redis round trip.
        """
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise InvalidInput("items", f"expected a list of (sid, value) pairs, got {type(items).__name__}")
        for pair in items:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidInput("items", f"each item must be a (sid, value) pair, got {pair!r:.80}")
            validate_id("session id", pair[0])
        if not items:
            return []
        with self._lock:
            live = [j for j, (sid, _v) in enumerate(items) if sid not in self._released]
        ref = ray.put([items[j][1] for j in live]) if live else None
        nbytes = sum(_nbytes(items[j][1]) for j in live)
        keys: list[str] = [""] * len(items)
        with self._lock:
            if live:
                self._seq += 1
                seq = self._seq
                users: list[tuple[str, str]] = []
                for i, j in enumerate(live):
                    keys[j] = f"rx:{self.name}:{seq}.{i}"
                    sid = items[j][0]
                    if sid in self._released:  # released while the object was put
                        self._late += 1
                    else:
                        users.append((sid, keys[j]))
                if users:
                    self._keep(_Held(seq, ref, nbytes), users)
            for j, k in enumerate(keys):
                if not k:
                    self._seq += 1
                    keys[j] = f"rx:{self.name}:{self._seq}"
                    self._late += 1
        return keys

    def keep(self, sid: str, value: Any) -> str:
        """Keep ``value`` for session ``sid`` in this process until it is lent; its expert key.

        No ``ray.put`` now: :meth:`get` puts the kept values it lends, those
        of one call in ONE object, so a value costs the object store only if
        someone reads it, and a batch of them one put. Meant for a caller on
        a latency path (the gateway: a put is ~0.5 ms of CPU and ~1 ms of
        wall time however small the value). Once lent, the value lives in the
        object store as a ``put_many`` value does (kept until every session
        of that lend is released); until then in this process's memory, so
        keep owned data (a copy, not a view of a larger array). A session
        already seen released gets a key and nothing is kept, as with
        :meth:`put`. Raises InvalidId (sid). No Redis round trip.
        """
        validate_id("session id", sid)
        with self._lock:
            self._seq += 1
            key = f"rx:{self.name}:{self._seq}"
            if sid in self._released:
                self._late += 1
            else:
                self._keep(_Held(self._seq, None, _nbytes(value), value=value), [(sid, key)])
        return key

    def get(self, keys: Sequence[str]) -> list[Any]:
        """The ``ObjectRef`` of each expert key, in order (lend them; Ray counts the borrow).

        The kept values among ``keys`` (:meth:`keep`) are put now, in one
        object for the call, which replaces them in the holder.

        A key of :meth:`put_many` (``...<n>.<i>``) gets the shared ref, whose
        value is a list: item ``i`` is the key's value. :func:`expert_values`
        turns ``(keys, refs)`` into values with one ``ray.get`` for the
        distinct refs. Raises ExpertRefMissing for a key this holder does not hold.
        """
        if isinstance(keys, str):
            raise InvalidInput("keys", "expected a list of expert keys, got a single string")
        out: list[Any] = []
        lend: dict[str, tuple[str, _Held]] = {}
        with self._lock:
            for k in keys:
                item = self._keys.get(k)
                if item is None:
                    raise ExpertRefMissing(k, self.name)
                if item[1].ref is None:
                    lend[k] = item
                out.append(item[1].ref)
        if lend:
            ref = self._lend(lend)
            out = [ref if r is None else r for r in out]
        return out

    def values(self, keys: Sequence[str]) -> list[Any]:
        """The values of expert ``keys``, in order: :meth:`get` then :func:`expert_values`.

        One ``ray.get`` for the distinct refs. Raises ExpertRefMissing.
        """
        return expert_values(keys, self.get(keys))

    def drop(self, sids: Sequence[str]) -> int:
        """Drop the keys of ``sids`` now (what the event consumer does); returns the refs dropped.

        A ref shared with sessions not in ``sids`` stays (it is not counted).
        """
        sids = validate_ids("session id", sids)
        return sum(self._drop_session(s, remember=False) for s in sids)

    def stats(self) -> HolderStats:
        """Sessions, refs and bytes held, plus event, drop and reconcile counters."""
        with self._lock:
            return HolderStats(
                sessions=len(self._by_sid),
                refs=len(self._held),
                bytes=self._bytes,
                events=self._events,
                dropped=self._dropped,
                reconciles=self._reconciles,
                keys=len(self._keys),
                late=self._late,
                kept=sum(1 for h in self._held.values() if h.ref is None),
            )

    def held_sessions(self) -> list[str]:
        """Session ids with at least one held ref (sorted)."""
        with self._lock:
            return sorted(self._by_sid)

    def reconcile(self) -> int:
        """Drop the keys of held sessions that are released (or unknown for ``grace_s``).

        Returns the number of refs dropped (a shared ref when its last
        session goes). One pipelined round trip per 4,000 held sessions.
        Raises StorageError.
        """
        with self._lock:
            since = dict(self._since)
        if not since:
            with self._lock:
                self._reconciles += 1
            return 0
        states = self.store.session_states(sorted(since))
        now = time.monotonic()
        dropped = 0
        for sid, st in states.items():
            if (st is not None and st[1] == "released") or (st is None and now - since[sid] >= self.grace_s):
                dropped += self._drop_session(sid, remember=st is not None)
        with self._lock:
            self._reconciles += 1
        return dropped

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Create the consumer group (if needed), reconcile once, start the consumer thread."""
        if self._thread is not None:
            return
        self.store.run(ensure_events_group(self.store.context, self.name, self._consumer))
        self.reconcile()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"RefHolder-{self.name}", daemon=True)
        self._thread.start()

    def close(self, *, destroy_group: bool | None = None) -> None:
        """Stop the consumer (within ``block_s``) and drop every ref this holder keeps.

        ``destroy_group`` (default: True for a holder without a given name)
        removes the consumer group, so it does not hold back event trimming.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.block_s + 10)
            self._thread = None
        with self._lock:
            self._keys.clear()
            self._held.clear()
            self._by_sid.clear()
            self._since.clear()
            self._bytes = 0
        if self.ephemeral if destroy_group is None else destroy_group:
            try:
                self.store.run(destroy_events_group(self.store.context, self.name))
            except TracestoreError as exc:  # the group may be gone already; nothing leaks
                log.warning("holder %s: could not destroy its group: %s", self.name, exc)

    def __enter__(self) -> RefHolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _keep(self, held: _Held, users: list[tuple[str, str]]) -> None:
        """Register ``held`` and its ``(sid, key)`` users (under the lock)."""
        now = time.monotonic()
        self._held[held.seq] = held
        self._bytes += held.nbytes
        for sid, key in users:
            held.users.add(sid)
            self._keys[key] = (sid, held)
            self._by_sid.setdefault(sid, []).append(key)
            self._since.setdefault(sid, now)

    def _lend(self, items: dict[str, tuple[str, _Held]]) -> Any:
        """Put the kept values of ``items`` (key -> (sid, held)) in one object; its ref.

        The object replaces them: each key still held names it afterwards (a
        key released meanwhile does not; a concurrent lend of the same keys
        puts its own copy, which its caller alone keeps).
        """
        ref = ray.put(_Lent({k: h.value for k, (_sid, h) in items.items()}))
        with self._lock:
            self._seq += 1
            shared = _Held(self._seq, ref, 0)
            for k, (sid, h) in items.items():
                cur = self._keys.get(k)
                if cur is None or cur[1] is not h:  # released, or lent by a concurrent call
                    continue
                self._keys[k] = (sid, shared)
                shared.users.add(sid)
                shared.nbytes += h.nbytes
                if self._held.pop(h.seq, None) is not None:
                    self._bytes -= h.nbytes
            if shared.users:
                self._held[shared.seq] = shared
                self._bytes += shared.nbytes
        return ref

    def _drop_session(self, sid: str, *, remember: bool) -> int:
        """Forget ``sid``'s keys; drop each ref it was the last user of. Returns the refs dropped."""
        with self._lock:
            keys = self._by_sid.pop(sid, [])
            self._since.pop(sid, None)
            used = {h.seq: h for h in (self._keys.pop(k)[1] for k in keys if k in self._keys)}
            gone: list[_Held] = []
            for seq, h in used.items():
                h.users.discard(sid)
                if not h.users:  # its last session: drop it (once: it leaves _held here)
                    gone.append(self._held.pop(seq))
            for h in gone:
                self._bytes -= h.nbytes
            self._dropped += len(gone)
            if remember:
                self._released[sid] = None
                if len(self._released) > _RECENT_RELEASED:
                    self._released.popitem(last=False)
        n = len(gone)
        del gone, used  # the refs go here; Ray frees each object once no borrower holds it
        return n

    def _handle(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        for _eid, fields in entries:
            sid = fields.get("sid")
            if sid:
                self._drop_session(sid, remember=True)
        with self._lock:
            self._events += len(entries)
        if entries:
            self.store.run(ack_events(self.store.context, self.name, [eid for eid, _f in entries]))

    def _loop(self) -> None:
        own_pending = True  # first re-read what this consumer was given but did not ack
        next_reconcile = time.monotonic() + self.reconcile_s
        backoff = 0.05
        while not self._stop.is_set():
            try:
                start_id = "0" if own_pending else ">"
                entries = self.store.run(
                    read_events(self.store.context, self.name, self._consumer, start_id, self.batch, self.block_s)
                )
                if own_pending and not entries:
                    own_pending = False
                self._handle(entries)
                if time.monotonic() >= next_reconcile:
                    self.reconcile()
                    next_reconcile = time.monotonic() + self.reconcile_s
                backoff = 0.05
            except Exception as exc:  # keep consuming: a dead consumer would leak every ref
                if self._stop.is_set():
                    break
                log.warning("holder %s: event consumer error (retrying): %s", self.name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                try:
                    # The group may have been removed (gc: holder idle too long);
                    # re-create it, and reconcile since its events were missed.
                    if self.store.run(ensure_events_group(self.store.context, self.name, self._consumer)):
                        self.reconcile()
                        own_pending = False
                except Exception as exc2:
                    log.warning("holder %s: cannot restore its group yet: %s", self.name, exc2)


class _RefHolderActor:
    """A ready Ray actor around a :class:`RefHolder` (use :data:`RefHolderActor`).

    ``RefHolderActor.remote(url, run, name=None, **holder_options)``; methods
    ``put``, ``put_many``, ``get`` (returns the refs: the caller borrows them
    and resolves them with :func:`expert_values`), ``drop``,
    ``stats``, ``reconcile``, ``held_sessions``, ``close``.
    """

    def __init__(self, url: str | None, run: str = "default", name: str | None = None, **options: Any) -> None:
        self._store = TraceStore.connect(url, run=run)
        self._holder = RefHolder(self._store, name=name, **options)

    def put(self, sid: str, value: Any) -> str:
        return self._holder.put(sid, value)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> list[str]:
        return self._holder.put_many(items)

    def get(self, keys: Sequence[str]) -> list[Any]:
        return self._holder.get(keys)

    def drop(self, sids: Sequence[str]) -> int:
        return self._holder.drop(sids)

    def stats(self) -> HolderStats:
        return self._holder.stats()

    def reconcile(self) -> int:
        return self._holder.reconcile()

    def held_sessions(self) -> list[str]:
        return self._holder.held_sessions()

    def close(self) -> None:
        self._holder.close()
        self._store.close()


#: ``RefHolderActor.remote(url, run, name=None, **holder_options)``: a RefHolder in its own actor.
RefHolderActor = ray.remote(max_concurrency=4)(_RefHolderActor)  # type: ignore[call-overload]
