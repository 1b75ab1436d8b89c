"""Routed experts on the gateway's path: decode an engine's rows, put them into the holder ahead of the write."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Any

from ..session import ExpertHolder


def decode_experts(b64: str, shape: Sequence[int] | None, rows: int) -> Any:
    """The routed experts of a reply as int32 ``[rows + 1, layers, top_k]`` with a dummy row 0.

    The dummy row makes the layout the one :class:`tracestore.session.TurnRecorder`
    splits (row ``i`` is the routing of token ``i - 1``). Raises ValueError
    when the payload does not hold ``rows`` rows. Needs numpy.
    """
    import numpy as np  # the gateway extra has numpy; the core library does not need it

    flat: Any = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    arr: Any
    if shape is not None and len(shape) >= 2:
        arr = flat.reshape([-1, *shape[1:]])
    elif rows > 0 and flat.size % rows == 0:
        arr = flat.reshape(rows, -1)
    else:
        raise ValueError(f"routed experts: {flat.size} values do not split into {rows} rows")
    if arr.shape[0] != rows:
        raise ValueError(f"routed experts: {arr.shape[0]} rows, expected {rows}")
    return np.concatenate([np.zeros((1, *arr.shape[1:]), dtype=np.int32), arr.astype(np.int32)])


class PutAhead:
    """The holder a turn's recorder sees: it hands out keys of values already put (in order)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def put(self, sid: str, value: Any) -> str:
        """The next key put ahead for this turn."""
        return self.keys.pop(0)


async def put_parts(holder: ExpertHolder, sid: str, b64: str, shape: Sequence[int] | None, prefix: int, delta: int, output: int) -> tuple[Any, list[str]]:
    """Decode an engine's routed experts (``prefix + delta + output - 1`` rows) and put the delta's
    rows (when ``delta``) and the answer's rows into ``holder`` ahead of the write.

    Returns the array (with its dummy row 0) and the keys, delta's first. Raises ValueError when
    the rows do not match the tokens.
    """
    experts = decode_experts(b64, shape, prefix + delta + output - 1)
    p, d = prefix, delta
    parts = ([experts[p : p + d]] if d else []) + [experts[p + d :]]
    return experts, await put_ahead(holder, sid, parts)


async def put_ahead(holder: ExpertHolder, sid: str, parts: Sequence[Any]) -> list[str]:
    """Put each part into ``holder`` on a worker thread; their keys, in order.

    ``ray.put`` blocks; on the event loop it would stall every other request.
    """
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(None, holder.put, sid, x) for x in parts]


__all__ = ["PutAhead", "decode_experts", "put_ahead", "put_parts"]
