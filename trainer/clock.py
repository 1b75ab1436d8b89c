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
