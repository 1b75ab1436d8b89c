"""Time spent in tracestore calls and busy in a role, for the report's time share."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Stopwatch:
    """Sums the seconds spent inside ``with watch():`` blocks (each block times itself).

    A role keeps one for its tracestore calls and one for its busy time; the
    report divides the first by the second. Blocks may run in several threads
    of an actor (the sum is a float updated under the GIL).
    """

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def add(self, seconds: float) -> None:
        """Count ``seconds`` measured elsewhere (parts of a block that also ran other work)."""
        self.seconds += seconds


class Backoff:
    """The pauses of a poll: ``first_s``, then each ``factor`` times longer, at most ``cap_s``.

    Each poll of the store is a round trip that counts as time in tracestore;
    a wait that lasts polls less often as it goes on. ``reset()`` after progress.
    """

    def __init__(self, first_s: float = 0.02, cap_s: float = 0.08, factor: float = 1.5) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.factor = factor
        self.next_s = first_s

    def sleep(self) -> None:
        """Pause for the current interval, and lengthen the next one."""
        time.sleep(self.next_s)
        self.next_s = min(self.cap_s, self.next_s * self.factor)

    def reset(self) -> None:
        """Start again from ``first_s``."""
        self.next_s = self.first_s
