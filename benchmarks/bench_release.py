"""Release of many sessions with their data, against the one-actor baseline (issue 4).

* ``release_owner`` of 1k and 10k sessions, each with one real turn written
  through ``record_turn`` (control-plane script + slot-grouped purge):
  client-observed time and the client's CPU time, and server time from ``INFO commandstats`` (sum of
  ``usec`` of every command, after ``CONFIG RESETSTAT``) on a dedicated
  standalone server, split into the control-plane phase and the purge.
* The baseline (benchmarks/baselines/actor_release.py): the same sessions and
  nodes in one Ray actor's dicts, ``release_sessions`` of the same ids;
  client-observed time of the remote call, and the time spent inside it.
* Events per second consumed by a :class:`tracestore.ray.RefHolder`: the
  holder holds one ref per session, the sessions are released, and the clock
  stops when the holder has dropped them all.

Each size is measured ``REPEATS`` times, tracestore and the actor taking
turns, and the medians are reported (the machine is shared: one run alone
is noise). Goals (issue 15 item 3): 10k sessions released and purged within
60 ms of server time, and a client time at most 2x the actor's.
"""

from __future__ import annotations

import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tracestore import TraceStore
from tracestore.servers import EmbeddedServer

PROMPT_TOKENS = 64
RESPONSE_TOKENS = 32
#: Measurements per size (medians reported); 1 in a --quick run.
REPEATS = 3


def _prompt(sid: str) -> str:
    return f"<user>question {sid} " + "x" * 200 + "</user>"


def _fill(store: TraceStore, sids: list[str], owner: str) -> None:
    """Open ``sids`` for ``owner`` and write one turn into each (4 threads)."""
    store.open_sessions(sids, owner)

    def one(sid: str) -> None:
        p = _prompt(sid)
        m = store.lookup(sid, p)
        store.record_turn(
            sid, p, "<assistant>answer</assistant>", prefix=m,
            delta_token_ids=list(range(PROMPT_TOKENS)),
            response_token_ids=list(range(RESPONSE_TOKENS)),
            response_logprobs=[-0.5] * RESPONSE_TOKENS, version=1,
        )

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(one, sids))


#: Commands the release path sends itself. Commands that scripts call are
#: counted both on their own line and inside EVALSHA, so only these are summed.
DIRECT = ("evalsha", "eval", "smembers", "mset", "unlink", "time")


def _server_usec(store: TraceStore) -> tuple[float, dict[str, float]]:
    """Server time of the release path (usec) and every command's line of INFO commandstats.

    The purge sends MSET and UNLINK itself; the scripts call neither.
    """
    stats = store.redis.info("commandstats")
    per = {k[len("cmdstat_"):]: float(v["usec"]) for k, v in stats.items() if k.startswith("cmdstat_")}
    per = {k: v for k, v in per.items() if not k.startswith(("config", "info"))}
    return sum(v for k, v in per.items() if k in DIRECT), per


def _reset(store: TraceStore) -> float:
    """Reset command stats; returns the server's CPU seconds so far."""
    store.redis.config_resetstat()
    return _cpu(store)


def _cpu(store: TraceStore) -> float:
    """The server process's CPU seconds (user + sys): unlike commandstats' wall-clock
    usec, not inflated when the machine is busy and the server is descheduled."""
    info = store.redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def ts_release(url: str, n: int, phases: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with TraceStore.connect(url, run=f"bench-rel-{uuid.uuid4().hex[:8]}") as store:
        sids = [f"s{i}" for i in range(n)]
        _fill(store, sids, "train:1")
        cpu0 = _reset(store)
        t0, p0 = time.perf_counter(), time.process_time()
        released = store.release_owner("train:1", "consumed")
        out["client_ms"] = round(1000 * (time.perf_counter() - t0), 2)
        # the client's own work (not its wait for the server): hardly moved by a loaded machine
        out["client_cpu_ms"] = round(1000 * (time.process_time() - p0), 2)
        out["server_cpu_ms"] = round(1000 * (_cpu(store) - cpu0), 2)
        total, per = _server_usec(store)
        out["server_ms"] = round(total / 1000, 2)
        out["server_by_command_ms"] = {k: round(v / 1000, 2) for k, v in per.items()}
        assert len(released) == n, len(released)
        assert store.redis.xlen(store.keys.events) == n
        if not phases:
            return out

        # The same again on fresh sessions, phase by phase.
        sids2 = [f"t{i}" for i in range(n)]
        _fill(store, sids2, "train:2")
        _reset(store)
        t0 = time.perf_counter()
        got = store.release_owner("train:2", "consumed", purge=False)
        out["phase1_client_ms"] = round(1000 * (time.perf_counter() - t0), 2)
        out["phase1_server_ms"] = round(_server_usec(store)[0] / 1000, 2)
        _reset(store)
        t0 = time.perf_counter()
        store.drop_sessions_data(got)
        out["purge_client_ms"] = round(1000 * (time.perf_counter() - t0), 2)
        out["purge_server_ms"] = round(_server_usec(store)[0] / 1000, 2)
        left = sum(store.redis.exists(*store.keys.data_keys(s)) for s in sids[:: max(1, n // 200)])
        assert left == 0, left
    return out


def actor_release(cls: Any, n: int) -> dict[str, Any]:
    import ray

    actor = cls.remote()
    try:
        sids = [f"s{i}" for i in range(n)]
        ray.get(actor.open_sessions.remote(sids, "train:1"))
        turns = []
        for s in sids:
            turns.append((s, f"{s}/d", "", list(range(PROMPT_TOKENS)), [0.0] * PROMPT_TOKENS))
            turns.append((s, f"{s}/r", f"{s}/d", list(range(RESPONSE_TOKENS)), [-0.5] * RESPONSE_TOKENS))
        for i in range(0, len(turns), 2000):
            ray.get(actor.record_turns.remote(turns[i : i + 2000]))
        t0 = time.perf_counter()
        released = ray.get(actor.release_sessions.remote(sids, "train:1", "consumed"))
        client_ms = 1000 * (time.perf_counter() - t0)
        inside_ms = 1000 * ray.get(actor.last_call.remote())
        assert len(released) == n
        return {"client_ms": round(client_ms, 2), "inside_actor_ms": round(inside_ms, 2)}
    finally:
        ray.kill(actor)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def holder_events_per_s(url: str, n: int) -> dict[str, Any]:
    import numpy as np

    from tracestore.ray import RefHolder

    with TraceStore.connect(url, run=f"bench-holder-{uuid.uuid4().hex[:8]}") as store:
        sids = [f"h{i}" for i in range(n)]
        store.open_sessions(sids, "rollout:0")
        with RefHolder(store, reconcile_s=3600, block_s=0.2) as holder:
            for s in sids:
                holder.put(s, np.zeros(16, dtype=np.int32))
            t0 = time.perf_counter()
            store.release_owner("rollout:0", "done", purge=False)
            released_s = time.perf_counter() - t0
            while holder.stats().sessions:
                time.sleep(0.002)
            total_s = time.perf_counter() - t0
            st = holder.stats()
            assert st.events >= n and st.refs == 0
    return {
        "sessions": n,
        "release_s": round(released_s, 3),
        "until_all_dropped_s": round(total_s, 3),
        "events_per_s": round(n / total_s),
    }


def run(quick: bool) -> dict[str, Any]:
    import ray

    from .baselines import actor_release as baseline

    sizes = (1_000, 2_000) if quick else (1_000, 10_000)
    server = EmbeddedServer().start()  # dedicated: INFO commandstats sees only this benchmark
    url = server.url
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(baseline)
        cls = baseline.remote_class()
        out: dict[str, Any] = {"quick": quick, "sizes": list(sizes), "server": "embedded valkey, standalone"}
        repeats = 1 if quick else REPEATS
        out["repeats"] = repeats
        for n in sizes:
            runs_ts: list[dict[str, Any]] = []
            runs_actor: list[dict[str, Any]] = []
            for r in range(repeats):
                print(f"   release {n} sessions ({r + 1}/{repeats}) ...", flush=True)
                runs_ts.append(ts_release(url, n, phases=r == 0))
                runs_actor.append(actor_release(cls, n))
            ours = {
                k: _median([x[k] for x in runs_ts])
                for k in ("client_ms", "client_cpu_ms", "server_ms", "server_cpu_ms")
            }
            ours.update({k: v for k, v in runs_ts[0].items() if k not in ours})
            theirs = {k: _median([x[k] for x in runs_actor]) for k in runs_actor[0]}
            out[str(n)] = {
                "tracestore": ours,
                "actor": theirs,
                "client_ratio_tracestore_over_actor": round(ours["client_ms"] / theirs["client_ms"], 2),
                "runs": {"tracestore": runs_ts, "actor": runs_actor},
            }
        big = out[str(sizes[-1])]
        out["goal_10k_within_60ms_server"] = (not quick) and big["tracestore"]["server_ms"] <= 60.0
        out["goal_10k_client_within_2x_actor"] = (not quick) and big["client_ratio_tracestore_over_actor"] <= 2.0
        print("   RefHolder events/s ...", flush=True)
        out["holder"] = holder_events_per_s(url, 2_000 if quick else 20_000)
        return out
    finally:
        ray.shutdown()
        server.stop()
