"""Demo section: the server, the run's meta record and the script runtime."""

from __future__ import annotations

import time

from ..scripts import registry
from ..store import TraceStore

TITLE = "Server and script runtime"


def run(store: TraceStore) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    info = store.server_info()
    rows.append(("connected to", f"{store.url} ({info.engine} {info.version}, {info.mode})"))
    ri = store.init_run()
    rows.append(("run meta record", f"{store.keys.meta} schema={ri.schema}"))
    rows.append(("Lua scripts loaded", len(registry())))
    sids = [f"demo-{i}" for i in range(20_000)]
    start = time.perf_counter()
    states = store.session_states(sids)
    rows.append(
        ("read 20,000 session states", f"{len(states)} in {1000 * (time.perf_counter() - start):.0f} ms (chunked)")
    )
    store.redis.script_flush()
    store.session_states(sids[:3])
    rows.append(("SCRIPT FLUSH, then call again", "reloaded on NOSCRIPT, ok"))
    return rows
