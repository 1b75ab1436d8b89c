"""The run's lock: one holder (one trainer) per run, kept in the run's control plane.

``ts:{R}:lock`` (a hash in the run's slot ``{R}``, README key table) names
its holder: a token unique per process and lock, the host, the machine's
boot id, the pid, what it is, and since when (server clock). It expires
``ttl_s`` after the holder's last renewal (``lua/run_lock.lua``);
:class:`RunLockKeeper` takes it, renews it from a thread every third of
its ttl and releases it on exit. A second process is refused with
:class:`~tracestore.errors.RunLocked`, which names the first, unless the
first is provably gone: its lock expired (the key is absent), or it ran on
this machine (same host and boot id) and its pid is dead; then the lock is
taken over (``RunLock.taken_over``). A pid that is alive, or a holder on
another machine, is never presumed dead: its lock is waited out.

The lock is advisory: the store's other calls do not consult it. The
reference trainer takes it before it starts any role (``tracestore train``).

The keeper also watches the run's record (``ts:{R}:meta``): when it is gone
(the server restarted without its data, or was flushed), the keeper stops
renewing and :meth:`RunLockKeeper.check` raises :class:`RunLost`, so a
trainer stops at its next step with one line instead of writing orphan keys
into a run that no longer exists.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from .context import Context
from .errors import RunLocked, StorageError, TracestoreError
from .replies import Reply, field_map, stored, text
from .scripts import Batch, Cmd, Eval, Op, script
from .validate import duration_ms

if TYPE_CHECKING:
    from .store import TraceStore

#: Default ttl of the lock (s): how long a holder that stopped renewing (killed, its machine
#: gone) blocks another one that cannot prove it gone.
LOCK_TTL_S = 30.0
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This machine's boot id (Linux; '' elsewhere): two hosts of one name, or one host
    rebooted, have different ones, so a pid is only judged on the machine that ran it."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True unless no process ``pid`` exists on this machine (one of another user counts as alive)."""
    if pid <= 0:
        return True  # unknown: never presumed dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """Who takes a lock: a fresh ``token`` and where it runs (:meth:`this_process`)."""

    token: str
    host: str
    boot: str
    pid: int
    what: str

    @classmethod
    def this_process(cls, what: str) -> Holder:
        """This process, with a new token (``what``: shown to whoever is refused)."""
        return cls(uuid.uuid4().hex, socket.gethostname(), boot_id(), os.getpid(), what)

    def proves_gone(self, other: RunLocked) -> bool:
        """True when ``other``'s holder ran on this machine (same host, same known boot id)
        and its pid is dead here; False whenever that cannot be proved."""
        return (
            other.host == self.host
            and bool(other.boot)
            and other.boot == self.boot
            and other.pid != self.pid
            and not pid_alive(other.pid)
        )


@dataclass(frozen=True)
class RunLock:
    """The run's lock as held: by ``holder`` (a token) of ``host``/``boot``/``pid``, ``what``,
    since ``since_ms``, until ``deadline_ms`` unless renewed (server clock, ms).

    ``taken_over`` is True when taking it replaced a holder proved gone.
    """

    run: str
    holder: str
    host: str
    boot: str
    pid: int
    what: str
    since_ms: int
    deadline_ms: int
    taken_over: bool = False


class RunLost(TracestoreError):
    """The run's record (``ts:{R}:meta``) disappeared while this process held the run's lock:
    the server restarted without its data or was flushed. Nothing more is written to the run."""

    def __init__(self, run: str) -> None:
        self.run = run
        #: What happened, without the advice (the CLI adds the exact resume command).
        self.what = f"the trace store lost run {run!r} (its record is gone: the server restarted or was flushed)"
        super().__init__(f"{self.what}; stopped here: restore it from a checkpoint (tracestore train --resume --out OUT)")


def record_exists(ctx: Context) -> Op[bool]:
    """True while the run's record ``ts:{R}:meta`` exists. One round trip; reads only."""
    meta = ctx.keys.meta
    return bool(int((yield Cmd(("EXISTS", meta), key=meta))))


def lock_run(ctx: Context, holder: Holder, ttl_s: float = LOCK_TTL_S, *, takeover: str = "") -> Op[RunLock]:
    """Take (or renew, with the same token) the run's lock for ``ttl_s`` from now.

    ``takeover`` is the token of a holder the caller proved gone: that holder
    is replaced if it still holds the lock. Raises RunLocked naming the
    holder when another token holds it, InvalidInput for a bad ``ttl_s``
    (before I/O), StorageError. Naturally idempotent under retry (the token
    names the call). One round trip.
    """
    k = ctx.keys
    ttl_ms = duration_ms("ttl_s", ttl_s)
    args = (holder.token, ttl_ms, holder.host, holder.boot, holder.pid, holder.what, takeover)
    try:
        reply = yield Eval(script("run_lock"), (k.lock,), args)
    except RunLocked as exc:  # the script does not know the run's id: name it here
        raise RunLocked(
            k.run, exc.holder, exc.host, exc.boot, exc.pid, exc.what, exc.since_ms, exc.deadline_ms
        ) from None
    r = Reply(reply, "run_lock")
    since, deadline, taken = r.int(), r.int(), r.flag()
    return RunLock(k.run, holder.token, holder.host, holder.boot, holder.pid, holder.what, since, deadline, taken)


def acquire_run_lock(ctx: Context, holder: Holder, ttl_s: float = LOCK_TTL_S) -> Op[RunLock]:
    """:func:`lock_run`, taking the lock over when its holder is provably gone (see the module).

    Raises RunLocked naming the holder when it may still be running. One
    round trip, two on a takeover.
    """
    try:
        return (yield from lock_run(ctx, holder, ttl_s))
    except RunLocked as exc:
        if not holder.proves_gone(exc):
            raise
        return (yield from lock_run(ctx, holder, ttl_s, takeover=exc.holder))


def unlock_run(ctx: Context, token: str) -> Op[bool]:
    """Release the run's lock if ``token`` holds it; True when the lock is free of it now.

    True also when it was free already (released before, or expired: a
    retry whose first reply was lost answers the same); False when another
    holder has it (it expired and was taken), which is left alone. One round
    trip. Raises StorageError.
    """
    reply = yield Eval(script("run_unlock"), (ctx.keys.lock,), (token,))
    return Reply(reply, "run_unlock").flag()


def read_run_lock(ctx: Context) -> Op[RunLock | None]:
    """The run's lock as it is now, or None when it is free. One round trip; reads only.

    Raises CorruptData when the hash does not decode, StorageError.
    """
    k = ctx.keys
    raw, left, now = yield Batch(
        (
            Cmd(("HGETALL", k.lock), key=k.lock),
            Cmd(("PTTL", k.lock), key=k.lock),
            Cmd(("TIME",), key=k.lock),
        )
    )
    with stored(k.lock):
        fields = {f: text(v) for f, v in field_map(raw).items()}
        if not fields:
            return None
        now_ms = int(text(now[0])) * 1000 + int(text(now[1])) // 1000
        return RunLock(
            k.run,
            fields["holder"],
            fields.get("host", ""),
            fields.get("boot", ""),
            int(fields.get("pid", -1)),
            fields.get("what", ""),
            int(fields["since_ms"]),
            now_ms + int(left) if int(left) >= 0 else -1,
        )


class RunLockKeeper:
    """Hold the run's lock while a ``with`` block runs: take it, renew it, release it.

    ``with RunLockKeeper(store, "tracestore train") as lock:`` takes the lock
    (:func:`acquire_run_lock`; raises RunLocked naming the holder), renews it
    from a daemon thread every third of ``ttl_s`` and releases it when the
    block ends, however it ends. A renewal that finds another holder (the
    lock expired while this process could not reach the store, and another
    took it) stops renewing: :meth:`check` then raises that RunLocked, for
    the holder's loop to stop at its next step; a renewal that finds the
    run's record gone stops too, and :meth:`check` raises :class:`RunLost`.
    A store that does not answer is retried at the next renewal (the lock
    lasts ``ttl_s``).
    """

    def __init__(self, store: TraceStore, what: str, ttl_s: float = LOCK_TTL_S) -> None:
        duration_ms("ttl_s", ttl_s)
        self.store = store
        self.holder = Holder.this_process(what)
        self.ttl_s = ttl_s
        #: The lock as taken (set by ``__enter__``).
        self.lock: RunLock | None = None
        self._lost: RunLocked | RunLost | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.lock = self.store.run(acquire_run_lock(self.store.context, self.holder, self.ttl_s))
        self._thread = threading.Thread(target=self._renew, name="tracestore-run-lock", daemon=True)
        self._thread.start()
        return self.lock

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.store.run(record_exists(self.store.context)):
                    self._lost = RunLost(self.store.run_id)
                    return
                self.store.run(lock_run(self.store.context, self.holder, self.ttl_s))
            except RunLocked as exc:
                self._lost = exc
                return
            except StorageError:
                continue  # the store is away: the run notices; the lock lasts its ttl meanwhile

    def check(self) -> None:
        """Raise the RunLocked of the holder that took the lock from this one, if one did, or
        RunLost when the run's record disappeared."""
        if self._lost is not None:
            raise self._lost

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost is None:
            with contextlib.suppress(StorageError):  # unreachable: the lock expires on its own
                self.store.run(unlock_run(self.store.context, self.holder.token))
