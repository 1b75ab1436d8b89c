"""The run's lock (``tracestore/runlock.py``, ``lua/run_lock.lua``) on every backend.

One holder per run: a second is refused with the first's host, pid and
since when; the lock is renewed, released, and taken over only when its
holder is provably gone (expired, or a dead pid of this machine). The
holders that must look dead are real processes that exited.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tracestore import TraceStore
from tracestore.errors import InvalidInput, RunLocked
from tracestore.runlock import (
    Holder,
    RunLockKeeper,
    RunLost,
    acquire_run_lock,
    boot_id,
    lock_run,
    read_run_lock,
    unlock_run,
)


def _dead_pid() -> int:
    """The pid of a process of this machine that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _wait_until_free(store: TraceStore, limit_s: float = 30.0) -> None:
    end = time.monotonic() + limit_s
    while store.run(read_run_lock(store.context)) is not None:
        assert time.monotonic() < end, "the lock never expired"
        time.sleep(0.02)


def test_a_second_holder_is_refused_naming_the_first_until_it_releases(store: TraceStore) -> None:
    ctx = store.context
    first, second = Holder.this_process("trainer A"), Holder.this_process("trainer B")
    lock = store.run(lock_run(ctx, first, 30))
    assert (lock.holder, lock.pid, lock.host, lock.taken_over) == (first.token, os.getpid(), socket.gethostname(), False)
    seen = store.run(read_run_lock(ctx))
    assert seen is not None and (seen.holder, seen.what, seen.since_ms) == (first.token, "trainer A", lock.since_ms)
    assert seen.deadline_ms > seen.since_ms

    with pytest.raises(RunLocked) as err:
        store.run(acquire_run_lock(ctx, second, 30))  # same machine, but the first's pid is alive
    e = err.value
    assert (e.run, e.holder, e.pid, e.host, e.what, e.since_ms) == (
        store.run_id, first.token, os.getpid(), socket.gethostname(), "trainer A", lock.since_ms
    )
    assert f"pid {os.getpid()} on {socket.gethostname()}" in str(e) and "trainer A" in str(e)

    again = store.run(lock_run(ctx, first, 30))  # a renewal (or a retry): same since
    assert again.since_ms == lock.since_ms and again.deadline_ms >= lock.deadline_ms
    assert store.run(unlock_run(ctx, second.token)) is False  # not its lock: left alone
    assert store.run(read_run_lock(ctx)) is not None
    assert store.run(unlock_run(ctx, first.token)) is True
    assert store.run(unlock_run(ctx, first.token)) is True  # a retry answers the same
    assert store.run(read_run_lock(ctx)) is None
    assert store.run(acquire_run_lock(ctx, second, 30)).holder == second.token


def test_a_dead_holder_of_this_machine_is_taken_over_others_are_waited_out(store: TraceStore) -> None:
    ctx = store.context
    me = Holder.this_process("trainer B")
    if not me.boot:
        pytest.skip("no boot id on this system: a pid cannot be judged, only expiry frees a lock")
    dead = replace(Holder.this_process("trainer A"), pid=_dead_pid())
    store.run(lock_run(ctx, dead, 30))
    took = store.run(acquire_run_lock(ctx, me, 30))
    assert took.taken_over and took.holder == me.token
    store.run(unlock_run(ctx, me.token))

    # another machine (another host, or this host after a reboot) with that pid: not provable
    for far in (replace(dead, host="elsewhere"), replace(dead, boot="another-boot"), replace(dead, boot="")):
        store.run(lock_run(ctx, far, 30))
        with pytest.raises(RunLocked):
            store.run(acquire_run_lock(ctx, me, 30))
        store.run(unlock_run(ctx, far.token))
    # a takeover names the holder it proved gone: one that took the lock meanwhile stays
    store.run(lock_run(ctx, dead, 30))
    alive = Holder.this_process("trainer C")
    store.run(unlock_run(ctx, dead.token))
    store.run(lock_run(ctx, alive, 30))
    with pytest.raises(RunLocked) as err:
        store.run(lock_run(ctx, me, 30, takeover=dead.token))
    assert err.value.holder == alive.token


def test_an_expired_lock_is_free_and_its_keeper_learns_it_was_taken(store: TraceStore) -> None:
    ctx = store.context
    late = Holder.this_process("trainer A")
    store.run(lock_run(ctx, late, 0.3))  # stops renewing: the lock expires 0.3 s later
    _wait_until_free(store)
    other = Holder.this_process("trainer B")
    assert not store.run(acquire_run_lock(ctx, other, 30)).taken_over  # free: taken, not taken over
    with pytest.raises(RunLocked):  # the late holder's renewal finds the new holder
        store.run(lock_run(ctx, late, 0.3))


def test_the_keeper_renews_releases_and_reports_a_lost_lock(store: TraceStore) -> None:
    ctx = store.context
    # ttl 3 s: a keeper thread descheduled for a second on a loaded machine still renews in time
    # (with 0.6 s the lock could expire between two renewals and be taken again, since_ms new)
    with RunLockKeeper(store, "trainer A", ttl_s=3.0) as lock:
        first = store.redis.hget(store.keys.lock, "renewed_ms")
        end = time.monotonic() + 30
        while store.redis.hget(store.keys.lock, "renewed_ms") == first:  # renewed every ttl / 3
            assert time.monotonic() < end, "the keeper never renewed the lock"
            time.sleep(0.02)
        held = store.run(read_run_lock(ctx))
        assert held is not None and held.holder == lock.holder and held.since_ms == lock.since_ms
    assert store.run(read_run_lock(ctx)) is None  # released on exit

    keeper = RunLockKeeper(store, "trainer A", ttl_s=0.6)
    with keeper:
        thief = Holder.this_process("trainer B")
        store.run(unlock_run(ctx, keeper.holder.token))  # as if it had expired ...
        store.run(lock_run(ctx, thief, 30))  # ... and another trainer took it
        end = time.monotonic() + 30
        while True:
            try:
                keeper.check()
            except RunLocked as exc:
                assert exc.holder == thief.token
                break
            assert time.monotonic() < end, "the keeper never noticed"
            time.sleep(0.02)
    held = store.run(read_run_lock(ctx))
    assert held is not None and held.holder == thief.token  # not released by the keeper that lost it


def test_bad_ttl_is_refused_before_io_and_the_checkpoint_leaves_the_lock_out(
    store: TraceStore, url: str, tmp_path: Path
) -> None:
    with pytest.raises(InvalidInput):
        store.run(lock_run(store.context, Holder.this_process("x"), 0))
    assert store.run(read_run_lock(store.context)) is None
    with RunLockKeeper(store, "trainer A"):
        store.open_session("s-1", "rollout:0")
        store.checkpoint(tmp_path / "c.ckpt")
        assert b":lock" not in (tmp_path / "c.ckpt").read_bytes()
        # a resumed trainer holds its lock before it restores into the (otherwise empty) run
        with TraceStore.connect(url, run=f"{store.run_id}-r") as dst:
            with RunLockKeeper(dst, "trainer B"):
                assert dst.restore(tmp_path / "c.ckpt").sessions == 1
            dst.delete_run(force=True)


def test_boot_id_is_read_where_the_system_has_one() -> None:
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert len(boot_id()) >= 32
    else:
        assert boot_id() == ""


def test_the_keeper_stops_when_the_run_s_record_is_gone_and_takes_nothing_back(store: TraceStore) -> None:
    """A trainer whose server restarted without its data (or was flushed) stops at its next step
    with RunLost: the keeper's renewal finds ``ts:{R}:meta`` gone and does not take the lock again
    (before, it re-created the lock key in a run that no longer existed)."""
    keeper = RunLockKeeper(store, "trainer A", ttl_s=0.6)
    with keeper:
        store.redis.delete(store.keys.meta, store.keys.lock)  # the server lost the run
        end = time.monotonic() + 30
        while True:
            try:
                keeper.check()
            except RunLost as exc:
                assert exc.run == store.run_id and "lost run" in str(exc) and "--resume" in str(exc)
                break
            assert time.monotonic() < end, "the keeper never noticed"
            time.sleep(0.02)
        time.sleep(0.5)  # past another renewal period
        assert store.redis.exists(store.keys.lock) == 0  # nothing written back into the lost run
    assert store.redis.exists(store.keys.lock) == 0
