"""Test helper: every key of a run, byte for byte (refusals must leave it unchanged)."""

from __future__ import annotations

from typing import Any

from tracestore import TraceStore
from tracestore.scripts import Batch, Cmd, ScanAll


def dump_run(store: TraceStore) -> dict[str, tuple[Any, bool]]:
    """Every key of the run with its serialised value and whether it has a TTL.

    Two dumps compare equal only when no key of the run was created, deleted
    or changed in between (refusals must leave the state untouched).
    """
    k = store.keys
    keys = sorted({*store.execute(ScanAll(k.control_pattern)), *store.execute(ScanAll(k.data_pattern))})
    if not keys:
        return {}
    replies = store.execute(
        Batch(tuple(Cmd(("DUMP", x), key=x) for x in keys) + tuple(Cmd(("PTTL", x), key=x) for x in keys))
    )
    n = len(keys)
    return {x: (replies[i], int(replies[n + i]) >= 0) for i, x in enumerate(keys)}
