"""Control-plane footprint: what a session costs live, released, and per turn (issue 17).

One dedicated standalone server (embedded valkey, so ``INFO`` and ``SCAN``
see only this benchmark). The run uses a short ``op_ttl_s`` so that the
steady state after the retry records expire can be observed within the
benchmark; every other setting is the default.

Phases, all through the public API:

1. **records**, on a run of its own with the default ``op_ttl_s``: one
   lease per session (``gate.admit_many``): bytes per lease in flight, and
   per settled lease until its receipt expires (``gate.settle_many``); then
   the keys and bytes one turn leaves behind until its retry records
   expire (a session per turn: open, admit, ``record_turn``, settle, put,
   take, release). Steady state: keys = that figure x turns per second x
   ``op_ttl_s``.
2. **live**: ``open_sessions`` of ``live`` sessions for ``rollout:0``;
   control-plane bytes per live session once the open's retry records
   expired. These sessions then go through the rest of phase 3.
3. **run**: ``n`` sessions in all, in batches of ``batch``: open, one turn
   each (admit, ``record_turn`` of a 24-token prompt and an 8-token
   response, settle), ``replay.put`` in groups of 8, ``replay.take`` of
   every group as ``train:<batch>``, ``release_owner`` (released and purged).
4. **steady**: after the last batch: control-plane keys and bytes right
   away, once the retry records expired (``op_ttl_s``), and once ``gc`` has
   trimmed the release events (``event_retention_s=0``, no consumer group):
   bytes per released session. The data-plane tombstones (one per released
   session, on the session's slot) are counted apart.

Control-plane bytes are the sum of ``MEMORY USAGE key SAMPLES 0`` over the
keys of ``ts:{R}:*`` (exact, per key); ``used_memory`` of the whole server
is given beside them. Works against older revisions too (``store.stats()``
is reported when present), so before/after figures come from the same file.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tracestore import Group, TraceStore
from tracestore.servers import EmbeddedServer
from tracestore.traces import PrefixMatch

#: Retry-record lifetime used by the benchmark (seconds): short, so the steady state shows.
OP_TTL_S = 3
GROUP = 8


def _control(store: TraceStore) -> dict[str, Any]:
    """Keys and exact bytes of the run's control plane, by key family."""
    r = store.redis
    pattern = store.keys.control_pattern
    keys: list[str] = []
    cursor = 0
    while True:
        cursor, page = r.scan(cursor, match=pattern, count=10_000)
        keys.extend(k.decode() if isinstance(k, bytes) else k for k in page)
        if not cursor:
            break
    head = len(f"{store.keys.prefix}:{{{store.keys.run}}}:")
    total = 0
    families: dict[str, list[int]] = {}
    for i in range(0, len(keys), 5000):
        part = keys[i : i + 5000]
        p = r.pipeline(transaction=False)
        for k in part:
            p.memory_usage(k, samples=0)
        for k, b in zip(part, p.execute(), strict=True):
            rest = k[head:]
            fam = rest.split(":", 1)[0]
            if fam in ("gate", "rb", "route", "owners") and ":" in rest:
                fam = ":".join(rest.split(":")[:2])
            f = families.setdefault(fam, [0, 0])
            f[0] += 1
            f[1] += int(b or 0)
            total += int(b or 0)
    return {
        "keys": len(keys),
        "bytes": total,
        "by_family": {k: {"keys": v[0], "bytes": v[1]} for k, v in sorted(families.items())},
    }


def _used(store: TraceStore) -> int:
    return int(store.redis.info("memory")["used_memory"])


def _dead_bytes(store: TraceStore, sids: list[str]) -> float:
    """Mean ``MEMORY USAGE`` of the data-plane tombstones of a sample of sessions."""
    sample = sids[:: max(1, len(sids) // 500)]
    p = store.redis.pipeline(transaction=False)
    for s in sample:
        p.memory_usage(store.keys.dead(s), samples=0)
    sizes = [int(x) for x in p.execute() if x]
    return round(sum(sizes) / len(sizes), 1) if sizes else 0.0


def _turns(store: TraceStore, sids: list[str], threads: int = 4) -> None:
    """One admitted, recorded and settled turn per session (admit/settle in bursts)."""
    g = store.gate
    leases = []
    for i in range(0, len(sids), 1000):
        leases += g.admit_many([(s, "rollout:0") for s in sids[i : i + 1000]], ttl_s=60)
    empty = PrefixMatch(0, [], None)

    def one(sid: str) -> None:
        store.record_turn(
            sid, f"<user>question {sid}</user>", "<assistant>42</assistant>", prefix=empty,
            delta_token_ids=list(range(24)), response_token_ids=list(range(8)),
            response_logprobs=[-0.25] * 8, version=0,
        )

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, sids))
    for i in range(0, len(leases), 1000):
        g.settle_many(leases[i : i + 1000], "completed")


def _groups(store: TraceStore, sids: list[str], taker: str) -> None:
    """Put ``sids`` in groups of 8, take them all as ``taker``, release (and purge) them."""
    rb = store.replay
    for i in range(0, len(sids), GROUP):
        part = tuple(sids[i : i + GROUP])
        rb.put(Group(f"g-{part[0]}", "calc", part, "completed"), owner="rollout:0")
    left = (len(sids) + GROUP - 1) // GROUP
    while left:
        n = min(left, 1000)
        rb.take("calc", n, owner=taker, current_version=0)
        left -= n
    released = store.release_owner(taker, "consumed")
    assert len(released) == len(sids), (len(released), len(sids))


def _wait_expiry(store: TraceStore) -> None:
    time.sleep(OP_TTL_S + 1.5)
    # Expired keys go at the next access or the active expiry cycle; a SCAN visits them all.
    for _ in store.redis.scan_iter(match=store.keys.control_pattern, count=10_000):
        pass


def _stats(store: TraceStore) -> dict[str, int] | None:
    fn = getattr(store, "stats", None)
    if fn is None:
        return None
    s = fn()
    return {k: int(v) for k, v in s.__dict__.items()}


def run(quick: bool, n: int | None = None) -> dict[str, Any]:
    n = n or (20_000 if quick else 1_000_000)
    batch = 5_000 if quick else 10_000
    live_n = 5_000 if quick else 100_000
    server = EmbeddedServer().start()
    out: dict[str, Any] = {"quick": quick, "sessions": n, "batch": batch, "op_ttl_s": OP_TTL_S}
    try:
        store = TraceStore.connect(server.url, run=f"fp-{uuid.uuid4().hex[:6]}", op_ttl_s=OP_TTL_S)
        info = store.redis.info("server")
        out["server"] = f"valkey {info.get('valkey_version') or info.get('redis_version')} standalone"
        base = _control(store)
        used0 = _used(store)

        # 1. per-turn records at the default op_ttl_s, on a run of their own
        print("   records per lease and per turn (default op_ttl_s) ...", flush=True)
        with TraceStore.connect(server.url, run=f"fp-turn-{uuid.uuid4().hex[:6]}") as long:
            out["default_op_ttl_s"] = long.config.op_ttl_s
            m = 5_000 if quick else 20_000
            lsids = [f"l{i:06d}" for i in range(m)]
            long.open_sessions(lsids, "rollout:0")
            c0 = _control(long)
            g = long.gate
            leases = []
            for i in range(0, m, 1000):
                leases += g.admit_many([(s, "rollout:0") for s in lsids[i : i + 1000]], ttl_s=600)
            c1 = _control(long)
            for i in range(0, m, 1000):
                g.settle_many(leases[i : i + 1000], "completed")
            c2 = _control(long)
            out["lease"] = {
                "bytes_in_flight": round((c1["bytes"] - c0["bytes"]) / m, 1),
                "keys_in_flight": round((c1["keys"] - c0["keys"]) / m, 3),
                "bytes_settled_until_op_ttl": round((c2["bytes"] - c0["bytes"]) / m, 1),
                "keys_settled_until_op_ttl": round((c2["keys"] - c0["keys"]) / m, 3),
            }
            tsids = [f"t{i:06d}" for i in range(m)]
            c3 = _control(long)
            long.open_sessions(tsids, "rollout:0")
            _turns(long, tsids)
            _groups(long, tsids, "train:0")
            c4 = _control(long)
            fams = sorted(set(c3["by_family"]) | set(c4["by_family"]))
            delta = {
                f: {
                    "keys": c4["by_family"].get(f, {}).get("keys", 0) - c3["by_family"].get(f, {}).get("keys", 0),
                    "bytes": c4["by_family"].get(f, {}).get("bytes", 0) - c3["by_family"].get(f, {}).get("bytes", 0),
                }
                for f in fams
            }
            # keys with a ttl: the retry records (op:<id>) and the settled leases' receipts
            transient = [f for f in delta if f in ("op", "gate:l")]
            out["per_turn"] = {
                "turns": m,
                "note": "a session per turn: open, admit, record_turn, settle, put (groups of 8), take, release",
                "transient_keys_per_turn": round(sum(delta[f]["keys"] for f in transient) / m, 3),
                "transient_bytes_per_turn": round(sum(delta[f]["bytes"] for f in transient) / m, 1),
                "kept_bytes_per_turn": round(sum(v["bytes"] for f, v in delta.items() if f not in transient) / m, 1),
                "by_family": delta,
            }
            print(f"   lease {out['lease']}; per turn {out['per_turn']['transient_keys_per_turn']} keys, "
                  f"{out['per_turn']['transient_bytes_per_turn']} B until op_ttl_s", flush=True)

        # 2. live sessions at rest
        print(f"   live: {live_n} sessions ...", flush=True)
        live = [f"s{i:07d}" for i in range(live_n)]
        for i in range(0, live_n, batch):
            store.open_sessions(live[i : i + batch], "rollout:0")
        _wait_expiry(store)
        c_live = _control(store)
        out["live"] = {
            "bytes_per_session": round((c_live["bytes"] - base["bytes"]) / live_n, 1),
            "by_family": c_live["by_family"],
        }
        print(f"   live: {out['live']['bytes_per_session']} B/session", flush=True)
        for i in range(0, live_n, batch):
            part = live[i : i + batch]
            _turns(store, part)
            _groups(store, part, f"train:live{i}")

        # 3. the run, batch by batch
        done = live_n
        t_start = time.perf_counter()
        all_sids = list(live)
        bi = 0
        while done < n:
            sids = [f"s{j:07d}" for j in range(done, min(n, done + batch))]
            store.open_sessions(sids, "rollout:0")
            _turns(store, sids)
            _groups(store, sids, f"train:{bi}")
            all_sids += sids
            done += len(sids)
            bi += 1
            if bi % 10 == 0 or done >= n:
                el = time.perf_counter() - t_start
                print(f"   {done}/{n} sessions, {(done - live_n) / el:.0f} sessions/s", flush=True)
        out["run_s"] = round(time.perf_counter() - t_start, 1)

        # 4. steady state
        c_now = _control(store)
        _wait_expiry(store)
        c_steady = _control(store)
        store.gc(scan_data=False, event_retention_s=0)
        c_trimmed = _control(store)
        used1 = _used(store)
        out["released"] = {
            "right_after": {"keys": c_now["keys"], "bytes": c_now["bytes"]},
            "after_ttl": c_steady,
            "after_events_trimmed": c_trimmed,
            "bytes_per_released_session": round((c_steady["bytes"] - base["bytes"]) / n, 1),
            "bytes_per_released_session_events_trimmed": round((c_trimmed["bytes"] - base["bytes"]) / n, 1),
            "data_plane_tombstone_bytes": _dead_bytes(store, all_sids),
            "used_memory_per_session": round((used1 - used0) / n, 1),
        }
        out["stats"] = _stats(store)
        print(
            f"   released: {out['released']['bytes_per_released_session']} B/session "
            f"({out['released']['bytes_per_released_session_events_trimmed']} B once events are trimmed); "
            f"data-plane tombstone {out['released']['data_plane_tombstone_bytes']} B",
            flush=True,
        )
        store.close()
        return out
    finally:
        server.stop()
