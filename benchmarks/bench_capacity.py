"""Capacity planning (issue 15 item 5): what a turn, a token and a release cost a cluster.

The same workload runs on local clusters of 1, 3 and 6 primaries (embedded
valkey, one process per primary, on this one machine). A session server's
turn is a gate lease (admit + settle, on the run's control-plane slot) and a
``lookup`` + ``record_turn`` (on the session's own slot). Every round serves
turn t of every session: odd turns batched as a busy session server would
(one ``admit_many`` and one pipelined ``settle_many`` per batch of
sessions, the lookups and the writes pipelined with ``gather``), even turns
one call at a time (what an unbatched server sends: the servers then pay
a read and a write syscall per call). Then every session is released
(``release_owner``: control-plane script, one event each, then the purge on
the data slots) and the release events are read and acknowledged by a
consumer group, as a ``RefHolder`` does.

Per phase, the CPU (user + sys, from ``INFO cpu``) of every primary is
sampled before and after, so each figure is server CPU per turn, per
session released or per event read, and per primary:

* data plane: lookup + record_turn per steady turn, summed over primaries,
  and how evenly it spreads (largest primary's share vs 1/P);
* control plane: admit + settle per turn, all on the run's primary;
* release: per session, control plane and purge; events read per second of
  one core.

Figures on a shared 2-core machine: the primaries and the client share two
cores, so the *throughput* of 3 or 6 primaries cannot be measured here; what
is checked is that the per-turn cost does not depend on the number of
primaries and that the data plane spreads evenly over them, which is what
the capacity arithmetic of docs/capacity.md assumes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tracestore import TraceStore
from tracestore.scripts import Op
from tracestore.servers import LocalCluster

from .bench_traces import TURNS, _session, _Turn

PRIMARIES = (1, 3, 6)
CONTEXT = 2048  # first prompt; later turns add 32..96 + 32..96 tokens (as bench_traces)
SESSIONS_FULL = 384
SESSIONS_QUICK = 48
BATCH = 64  # sessions per pipelined batch (a session server's burst)
OWNER = "rollout:cap"
GROUP = "holder-cap"


def _cpu(store: TraceStore, ports: list[int]) -> list[float]:
    """CPU seconds (user + sys) of each primary so far."""
    out = []
    for port in ports:
        info = store.redis.get_node(host="127.0.0.1", port=port).redis_connection.info("cpu")
        out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out


def _delta(a: list[float], b: list[float]) -> list[float]:
    return [y - x for x, y in zip(a, b, strict=True)]


def _control_index(store: TraceStore, ports: list[int]) -> int:
    """Which primary holds the run's control-plane slot."""
    node = store.redis.get_node_from_key(store.keys.gate)
    return ports.index(int(node.port))


def _turn_ops(store: TraceStore, sid: str, t: _Turn, i: int) -> Op[Any]:
    """lookup then record_turn of one turn (one operation: gather pipelines many of them)."""
    m = yield from store.ops.lookup(sid, t.prompt)
    return (
        yield from store.ops.record_turn(
            sid, t.prompt, t.response, prefix=m, delta_token_ids=t.delta,
            response_token_ids=t.out, response_logprobs=t.logprobs, version=i,
        )
    )


def _run(primaries: int, n_sessions: int) -> dict[str, Any]:
    cluster = LocalCluster(primaries=primaries).start()
    try:
        store = TraceStore.connect(cluster.url, run=f"cap-{uuid.uuid4().hex[:6]}")
        ports = cluster.ports[:primaries]
        ctl = _control_index(store, ports)
        sessions = {f"s{i}": _session(CONTEXT, seed=i) for i in range(n_sessions)}
        sids = list(sessions)
        store.open_sessions(sids, OWNER)
        events = store.keys.events
        store.redis.xgroup_create(events, GROUP, id="$", mkstream=True)
        batches = [sids[b : b + BATCH] for b in range(0, n_sessions, BATCH)]
        # per mode (pipelined, one by one): [data CPU per primary, control CPU per primary, turns, data s]
        acc = {m: [[0.0] * primaries, [0.0] * primaries, 0, 0.0] for m in ("pipelined", "one_by_one")}
        for i in range(TURNS):
            # odd turns batched as a busy session server does, even turns one call at a time;
            # each phase for every session, CPU sampled around it (INFO's own cost is negligible)
            mode = "pipelined" if i % 2 else "one_by_one"
            c0 = _cpu(store, ports)
            if mode == "pipelined":
                leases = [store.gate.admit_many([(s, OWNER) for s in b], 60.0) for b in batches]
            else:
                leases = [[store.gate.admit(s, OWNER, 60.0)] for s in sids]
            c1 = _cpu(store, ports)
            w0 = time.perf_counter()
            if mode == "pipelined":
                for b in batches:
                    store.gather(*(_turn_ops(store, s, sessions[s][i], i) for s in b))
            else:
                for s in sids:
                    store.run(_turn_ops(store, s, sessions[s][i], i))
            w1 = time.perf_counter()
            c2 = _cpu(store, ports)
            for ls in leases:
                store.gate.settle_many(ls, "completed")
            c3 = _cpu(store, ports)
            if i == 0:
                continue  # the first turn writes the long first prompt: not a steady turn
            a = acc[mode]
            a[2] += n_sessions
            a[3] += w1 - w0
            for k, (x, y, z) in enumerate(zip(_delta(c0, c1), _delta(c1, c2), _delta(c2, c3), strict=True)):
                a[0][k] += y
                a[1][k] += x + z
        tokens = sum(len(t.delta) + len(t.out) for turns in sessions.values() for t in turns)
        c0 = _cpu(store, ports)
        w0 = time.perf_counter()
        released = store.release_owner(OWNER, "trained")
        release_s = time.perf_counter() - w0
        c1 = _cpu(store, ports)
        assert len(released) == n_sessions
        read = 0
        w0 = time.perf_counter()
        while read < n_sessions:
            got = store.redis.xreadgroup(GROUP, "c", {events: ">"}, count=500)
            ids = [eid for _, entries in got for eid, _ in entries]
            if not ids:
                break
            store.redis.xack(events, GROUP, *ids)
            read += len(ids)
        read_s = time.perf_counter() - w0
        c2 = _cpu(store, ports)
        assert read == n_sessions, read
        rel = _delta(c0, c1)
        rd = _delta(c1, c2)
        store.close()
    finally:
        cluster.stop()
    per_mode: dict[str, Any] = {}
    for mode, (data, control, steady, t_data) in acc.items():
        data_us = [1e6 * x / steady for x in data]
        total = sum(data_us)
        per_mode[mode] = {
            "steady_turns": steady,
            "data_plane_us_per_turn": round(total, 1),
            "data_plane_us_per_turn_by_primary": [round(x, 1) for x in data_us],
            "data_plane_largest_share": round(max(data_us) / total, 3),
            "control_plane_us_per_turn": round(1e6 * control[ctl] / steady, 1),
            "control_plane_us_per_turn_elsewhere": round(1e6 * (sum(control) - control[ctl]) / steady, 1),
            "client_turns_per_s_data_plane": round(steady / t_data, 1),
        }
    return {
        "primaries": primaries,
        "sessions": n_sessions,
        "tokens": tokens,
        "control_primary": ctl,
        "data_plane_even_share": round(1 / primaries, 3),
        **per_mode,
        "release_us_per_session": round(1e6 * sum(rel) / n_sessions, 1),
        "release_us_per_session_control_primary": round(1e6 * rel[ctl] / n_sessions, 1),
        "release_client_ms": round(1000 * release_s, 1),
        "event_read_us_per_event": round(1e6 * rd[ctl] / read, 2),
        "events_read_per_s_client": round(read / read_s),
    }


def run(quick: bool) -> dict[str, Any]:
    n = SESSIONS_QUICK if quick else SESSIONS_FULL
    out: dict[str, Any] = {"context_tokens": CONTEXT, "turns": TURNS, "batch": BATCH, "runs": {}}
    for p in PRIMARIES:
        print(f"   {p} primar{'y' if p == 1 else 'ies'}: {n} sessions x {TURNS} turns", flush=True)
        r = _run(p, n)
        out["runs"][str(p)] = r
        for mode in ("one_by_one", "pipelined"):
            m = r[mode]
            print(
                f"     {mode}: data plane {m['data_plane_us_per_turn']} us/turn (largest primary "
                f"{100 * m['data_plane_largest_share']:.0f}%, even {100 * r['data_plane_even_share']:.0f}%), "
                f"control plane {m['control_plane_us_per_turn']} us/turn",
                flush=True,
            )
        print(
            f"     release {r['release_us_per_session']} us/session "
            f"({r['release_us_per_session_control_primary']} on the run's primary), "
            f"event read {r['event_read_us_per_event']} us",
            flush=True,
        )
    for mode in ("one_by_one", "pipelined"):
        one, six = out["runs"]["1"][mode], out["runs"]["6"][mode]
        out[f"data_plane_us_per_turn_6_over_1_{mode}"] = round(
            six["data_plane_us_per_turn"] / one["data_plane_us_per_turn"], 3
        )
    return out
