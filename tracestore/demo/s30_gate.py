"""Demo section: a weight update while requests are in flight, and a worker that dies."""

from __future__ import annotations

import threading
import time

from ..errors import GatePoisoned, GateSealed
from ..store import TraceStore

TITLE = "Request gate: weight update with requests in flight (one worker dies)"


def run(store: TraceStore) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    gate = store.gate
    router = store.router(["engine-0", "engine-1"])
    admitted = threading.Barrier(5)
    leases: dict[str, str] = {}

    def worker(i: int) -> None:
        sid = f"chat-{i}"
        router.acquire(sid)
        lease = gate.admit(sid, holder=f"worker-{i}", ttl_s=1.0)
        leases[sid] = lease.id
        admitted.wait()
        if i == 3:
            return  # this worker dies mid-request: its lease is never settled
        time.sleep(0.1 + 0.1 * i)  # generating
        gate.settle(lease, "completed")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    admitted.wait()
    table = router.table()
    rows.append(("requests in flight", f"{gate.status().live} leases, routed {dict(sorted(table.load.items()))}"))

    gate.seal()
    try:
        gate.admit("chat-late", holder="worker-9", ttl_s=1.0)
    except GateSealed as exc:
        rows.append(("admission while sealed", f"GateSealed, retry in {exc.retry_after_ms} ms"))
    res = gate.drain(timeout_s=5)
    for t in threads:
        t.join()
    rows.append((
        "drain (wakes on settles, then at the dead lease's deadline)",
        f"drained in {res.waited_s:.2f} s: live={res.live}, poisoned={res.poisoned}",
    ))
    dead = res.poisoned_ids[0] if res.poisoned_ids else ""
    rec = gate.lease_records([dead])[0] if dead else None
    rows.append(("poisoned lease", f"{dead[:8]}... session {rec.sid if rec else '?'}, holder {rec.holder if rec else '?'}"))
    try:
        gate.install(1)
    except GatePoisoned as exc:
        rows.append(("install(1) while poisoned", f"refused: GatePoisoned ({len(exc.lease_ids)} lease)"))
    cleared = gate.clear_poison([dead], "worker-died:request-retried")
    rows.append(("clear_poison (operator: the request is retried)", f"cleared {len(cleared)}"))
    prev = gate.install(1)
    st = gate.reopen()
    rows.append(("install(1), reopen", f"version {prev} -> {st.version}, gate {st.state}"))

    try:
        with gate.weight_update(2, drain_timeout_s=2):
            raise RuntimeError("weight push failed")
    except RuntimeError:
        st = gate.status()
        rows.append(("weight_update(2) whose body fails", f"reopened without installing: {st.state}, version {st.version}"))

    inflight = gate.admit("chat-0", holder="worker-0", ttl_s=5)
    timer = threading.Timer(0.2, gate.settle, args=(inflight, "completed"))
    timer.start()
    start = time.perf_counter()
    with gate.weight_update(2, drain_timeout_s=5) as drained:
        pushed = time.perf_counter() - start
    timer.join()
    rows.append((
        "weight_update(2) with one request in flight",
        f"body ran after {pushed:.2f} s (drain woke on the settle, {drained.waited_s:.2f} s)",
    ))
    lease = gate.admit("chat-0", holder="worker-0", ttl_s=5)
    gate.settle(lease, "completed")
    rows.append(("next admission", f"version {lease.version} (the fencing token its turns record)"))
    rows.append(("chat-0 stays on its engine", router.acquire("chat-0")))
    return rows
