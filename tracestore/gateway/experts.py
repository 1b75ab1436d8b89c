"""Routed experts on the gateway's path: decode an engine's rows, put them into the holder ahead of the write."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Sequence
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


#: A batch of routed experts up to this many bytes is put from the event loop itself, rather
#: than paying the two thread switches of a worker thread (each a wait for a core, and for the
#: GIL, on a busy machine). A bigger batch goes to a worker thread. Either way each ``ray.put``
#: is a round trip to the raylet's object store, the loop blocked meanwhile: measured from an
#: actor on 2 cores, about 1.1 ms of wall time (0.5 ms of CPU) per put even for 200 bytes.
INLINE_BYTES = 64 * 1024


class Puts:
    """The routed-expert puts of one gateway into ``holder``.

    A holder with ``keep(sid, value) -> key`` (:class:`tracestore.ray.RefHolder`) keeps each
    part in this process until the trainer borrows it, so a turn pays no ``ray.put`` (measured
    in the reference trainer, the puts were a third of the gateway loop's busy time). Other
    holders get ``put``: the parts every turn hands in during one event-loop iteration are
    put together, from the loop when small (:data:`INLINE_BYTES`), else from one worker thread.
    """

    def __init__(self, holder: ExpertHolder) -> None:
        from .admission import Coalescer  # admission imports the engines; this module is lighter

        self.holder = holder
        self._keep: Callable[[str, Any], str] | None = getattr(holder, "keep", None)
        self._batches: Coalescer[tuple[str, list[Any]], list[str]] = Coalescer(self._flush, 4096)

    async def put(self, sid: str, parts: Sequence[Any]) -> list[str]:
        """Put ``parts`` of session ``sid``; their keys, in order."""
        if self._keep is not None:
            return [self._keep(sid, x) for x in parts]
        return await self._batches.submit((sid, list(parts)))

    async def _flush(self, items: list[tuple[str, list[Any]]]) -> list[list[str] | BaseException]:
        pairs = [(sid, x) for sid, parts in items for x in parts]
        if sum(int(getattr(x, "nbytes", 0)) for _, x in pairs) <= INLINE_BYTES:
            keys = self._put(pairs)
        else:
            keys = await asyncio.get_running_loop().run_in_executor(None, self._put, pairs)
        out: list[list[str] | BaseException] = []
        for _, parts in items:
            out.append(keys[: len(parts)])
            keys = keys[len(parts) :]
        return out

    def _put(self, pairs: list[tuple[str, Any]]) -> list[str]:
        # one put per part (not put_many's shared list): a key's ref stays its own value
        return [self.holder.put(sid, x) for sid, x in pairs]


async def put_parts(puts: Puts, sid: str, b64: str, shape: Sequence[int] | None, prefix: int, delta: int, output: int) -> tuple[Any, list[str]]:
    """Decode an engine's routed experts (``prefix + delta + output - 1`` rows) and put the delta's
    rows (when ``delta``) and the answer's rows into the holder of ``puts`` ahead of the write.

    Returns the array (with its dummy row 0) and the keys, delta's first. Raises ValueError when
    the rows do not match the tokens.
    """
    experts = decode_experts(b64, shape, prefix + delta + output - 1)
    p, d = prefix, delta
    # copies: a kept part must not hold on to the whole array (the prefix's rows are not its own)
    parts = ([experts[p : p + d].copy()] if d else []) + [experts[p + d :].copy()]
    return experts, await puts.put(sid, parts)


__all__ = ["INLINE_BYTES", "PutAhead", "Puts", "decode_experts", "put_parts"]
