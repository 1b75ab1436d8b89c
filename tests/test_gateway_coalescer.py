"""The gateway's Coalescer: the calls of one event-loop iteration go out as one batch.

Plain asyncio (no server): the flush records the batches it is given.
"""

from __future__ import annotations

import asyncio

import pytest

from tracestore.gateway.admission import Coalescer


def test_the_calls_of_one_iteration_are_one_batch_and_a_later_call_the_next() -> None:
    batches: list[list[int]] = []

    async def flush(items: list[int]) -> list[int | BaseException]:
        batches.append(list(items))
        await asyncio.sleep(0)
        return [x * 10 if x != 3 else ValueError("three") for x in items]

    async def main() -> None:
        c: Coalescer[int, int] = Coalescer(flush, 2)
        futs = [c.enqueue(x) for x in range(5)]  # one iteration: 5 items, batches of at most 2
        assert not any(f.done() for f in futs)
        got = await asyncio.gather(*futs, return_exceptions=True)
        assert got[:3] == [0, 10, 20] and isinstance(got[3], ValueError) and got[4] == 40
        assert sorted(batches) == [[0, 1], [2, 3], [4]]
        assert await c.submit(7) == 70  # the next iteration's call: a batch of its own
        assert batches[-1] == [7]

    asyncio.run(main())


def test_a_flush_that_raises_fails_every_call_of_its_batch_and_only_that_batch() -> None:
    async def flush(items: list[str]) -> list[str | BaseException]:
        if "bad" in items:
            raise RuntimeError("the round trip failed")
        return [s.upper() for s in items]

    async def main() -> None:
        c: Coalescer[str, str] = Coalescer(flush, 100)
        first = [c.enqueue("a"), c.enqueue("bad")]
        for f in first:
            with pytest.raises(RuntimeError, match="round trip"):
                await f
        assert await c.submit("b") == "B"

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_others_of_its_batch_their_results() -> None:
    async def flush(items: list[int]) -> list[int | BaseException]:
        await asyncio.sleep(0.01)
        return [x + 1 for x in items]

    async def main() -> None:
        c: Coalescer[int, int] = Coalescer(flush, 100)
        gone = asyncio.ensure_future(c.submit(1))
        kept = c.enqueue(2)
        await asyncio.sleep(0)
        gone.cancel()
        assert await kept == 3
        with pytest.raises(asyncio.CancelledError):
            await gone

    asyncio.run(main())
