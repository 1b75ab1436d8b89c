"""The bulk roles' CPU priority (``trainer.actors.lower_priority``), in a child process (a nice
value only ever goes up without privilege, so the test process itself is left as it is)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread: Linux")


def _child(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_every_thread_of_the_process_and_the_threads_they_start_get_the_bulk_niceness() -> None:
    """Linux keeps a nice value per thread: a thread started before the call (as a Ray worker's
    own threads are, before the actor's __init__) is lowered too, and a thread started after it
    inherits the value."""
    got = _child(
        """
        import os, threading
        from tracestore.trainer.actors import BULK_NICENESS, lower_priority
        seen, go = {}, threading.Event()
        def early():
            go.wait()
            seen["early"] = os.getpriority(os.PRIO_PROCESS, 0)
        t = threading.Thread(target=early)
        t.start()
        now = lower_priority()
        go.set()
        t.join()
        late = threading.Thread(target=lambda: seen.__setitem__("late", os.getpriority(os.PRIO_PROCESS, 0)))
        late.start()
        late.join()
        print(BULK_NICENESS, now, seen["early"], seen["late"])
        """
    )
    bulk, now, early, late = map(int, got.split())
    assert now == early == late == max(bulk, now)


def test_it_never_raises_the_priority_of_a_process_already_nicer() -> None:
    got = _child(
        """
        import os
        from tracestore.trainer.actors import lower_priority
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        print(lower_priority(5), os.getpriority(os.PRIO_PROCESS, 0))
        """
    )
    assert got.split() == ["19", "19"]


def test_idle_puts_every_thread_and_the_threads_they_start_on_the_idle_policy() -> None:
    """``idle=True``: SCHED_IDLE on each thread, one started before the call and one after (a
    woken normal thread, the gateway's loop, then preempts them at once); without it the
    policy stays SCHED_OTHER."""
    got = _child(
        """
        import os, threading
        from tracestore.trainer.actors import lower_priority
        seen, go = {}, threading.Event()
        def early():
            go.wait()
            seen["early"] = os.sched_getscheduler(0)
        t = threading.Thread(target=early)
        t.start()
        lower_priority()
        plain = os.sched_getscheduler(0)
        lower_priority(idle=True)
        go.set()
        t.join()
        late = threading.Thread(target=lambda: seen.__setitem__("late", os.sched_getscheduler(0)))
        late.start()
        late.join()
        print(os.SCHED_OTHER, os.SCHED_IDLE, plain, os.sched_getscheduler(0), seen["early"], seen["late"])
        """
    )
    other, idle, plain, now, early, late = map(int, got.split())
    assert plain == other
    assert now == early == late == idle


def test_bulk_roles_are_idle_only_on_a_private_local_ray() -> None:
    from tracestore.trainer.actors import bulk_idle
    from tracestore.trainer.config import TrainConfig

    assert bulk_idle(TrainConfig())
    assert bulk_idle(TrainConfig(ray_address="local"))
    assert not bulk_idle(TrainConfig(ray_address="auto"))
    assert not bulk_idle(TrainConfig(ray_address="10.0.0.1:6379"))
