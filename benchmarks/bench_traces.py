"""Multi-turn prefix traces: tracestore vs the one-actor text trie (issue 3).

Each session has 8 turns. Turn 1 sends a long first prompt (system prompt,
documents, tool output) so that the context reaches about 1k, 8k or 32k
tokens; every later turn adds 32..96 user tokens and 32..96 response tokens
(uniform, 64 on average). Turns
run turn-major over many sessions (turn t of every session, then t+1), as a
session server interleaves them. Per turn:

* tracestore: ``lookup`` before the request, ``record_turn`` after it
  (benchmarks/../tracestore/traces/); export at the end.
* baseline (benchmarks/baselines/actor_store.py): XTuner's design, a text
  trie in one Ray actor, called as its session server does: ``search``
  before the request; ``search`` and two ``insert`` calls after it; export
  at the end. Also run in-process (no Ray) for reference.

Figures (side by side, one run, dedicated embedded standalone server; the
three contexts and the systems take turns block by block, so the ratios
between contexts are side by side too):

* turns/s over turns 2..8 (context ~C) and over whole sessions; server time
  per turn: script time (INFO commandstats) and process CPU (INFO cpu, with
  the network I/O);
* bytes on the wire per turn, from the server's ``total_net_input_bytes`` +
  ``total_net_output_bytes`` (minus the INFO calls' own bytes), and round
  trips per turn counted at the client; for the actor, the pickled size of
  each call's arguments and results (what Ray serialises);
* Redis memory per stored token from ``MEMORY USAGE`` (SAMPLES 0) of every
  data key of the sessions, with and without node text.

* client CPU per steady turn (``lookup`` + ``record_turn``, turns 2..8): CPU time of the
  driving thread (``time.thread_time()``, user + system, so the socket calls count) around
  those two calls only; the server is another process, and the thread clock leaves out
  what Ray's threads in this process burn meanwhile. Beside it, its floor: the same thread's
  CPU for two round trips through redis-py + hiredis carrying as many bytes each way as
  that block's ``lookup`` + ``record_turn`` did, with none of the library's work (``_Floor``;
  the two calls of a turn cannot be one: the engine runs between them).

Goals: client CPU per steady turn at 8k <= 100 us (issue 28); turn rate (lookup + record_turn, client included) at 32k >= 0.8x
the rate at 1k and >= 20x the actor's at 8k (issue 15; issue 3 asked 5x);
wire bytes per turn at 32k <= 1.2x the 1k figure; <= 10 B/token without
text, <= 16 with text.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import time
import tracemalloc
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tracestore import PrefixMatch, TraceStore
from tracestore.servers import EmbeddedServer

from .baselines.actor_store import SessionServerClient, TextTrieStore, remote_class

TURNS = 8
USER_TOKENS = 64
RESPONSE_TOKENS = 64
CONTEXTS = (1024, 8192, 32768)
SESSIONS_FULL = {1024: 400, 8192: 160, 32768: 64}
SESSIONS_QUICK = {1024: 8, 8192: 8, 32768: 8}
MEMORY_SESSIONS = 24  # sessions written again without text, for B/token
BLOCK = 64  # sessions per timed block (the contexts' blocks alternate)


def _piece(t: int) -> str:
    """A toy vocabulary: every token is 4 characters (English BPE averages about 4)."""
    return " " + chr(97 + t % 26) + chr(97 + (t // 26) % 26) + chr(97 + (t // 676) % 26)


@dataclass
class _Turn:
    prompt: str
    response: str
    delta: list[int]
    out: list[int]
    logprobs: list[float]
    prefix_len: int  # chars of the prompt already stored before this turn


def _session(context: int, seed: int) -> list[_Turn]:
    rng = random.Random(seed)
    sizes = random.Random(1000 + seed % 8)  # session counts are multiples of 8
    first = max(USER_TOKENS, context - TURNS * (USER_TOKENS + RESPONSE_TOKENS) + USER_TOKENS)
    text = ""
    stored = 0  # chars of the longest stored key (the previous prompt + response)
    turns = []
    for i in range(TURNS):
        # segment lengths vary around their means (fixed sizes would all land at the
        # same allocator size class and make the memory figure an accident of the choice)
        # (own generator: later turns have the same sizes at every context length)
        n_user = first if i == 0 else sizes.randint(USER_TOKENS // 2, USER_TOKENS * 3 // 2)
        n_out = sizes.randint(RESPONSE_TOKENS // 2, RESPONSE_TOKENS * 3 // 2)
        delta = [rng.randrange(17_000) for _ in range(n_user)]
        out = [rng.randrange(17_000) for _ in range(n_out)]
        prefix_len = stored
        prompt = text + "".join(map(_piece, delta)) + "<|assistant|>"
        response = "".join(map(_piece, out)) + "<|end|>"
        lps = [-rng.random() * 4 for _ in out]
        turns.append(_Turn(prompt, response, delta, out, lps, prefix_len))
        stored = len(prompt + response)
        text = prompt + response + "<|user|>"
    return turns


def _net(r: Any) -> tuple[int, int]:
    s = r.info("stats")
    return int(s["total_net_input_bytes"]), int(s["total_net_output_bytes"])


def _record(store: TraceStore, sid: str, t: _Turn, i: int, prefix: PrefixMatch) -> None:
    """``record_turn`` of turn ``i`` after its ``lookup`` returned ``prefix``."""
    store.record_turn(
        sid,
        t.prompt,
        t.response,
        prefix=prefix,
        delta_token_ids=t.delta,
        response_token_ids=t.out,
        response_logprobs=t.logprobs,
        version=i,
    )


class _RoundTrips:
    """Counts the requests (round trips) a store sends."""

    def __init__(self, store: TraceStore) -> None:
        self.n = 0
        orig = store.execute

        def counting(req: Any) -> Any:
            self.n += 1
            return orig(req)

        store.execute = counting  # type: ignore[method-assign]


class _Tracestore:
    """A session server's calls on tracestore: lookup before, record_turn after.

    ``cpu``: CPU seconds of the calling thread (``time.thread_time``: user + system, so
    the socket calls count too; the server is another process, Ray's threads are not
    counted) spent inside those two calls since it was last reset; the engine input
    built between them is the caller's work and is built after the clock stops.
    """

    name = "tracestore"

    def __init__(self, store: TraceStore) -> None:
        self.store = store
        self.rt = _RoundTrips(store)
        self.cpu = 0.0
        #: (request, reply) bytes per call of its last block, read by its :class:`_Floor`
        self.call_bytes = (64, 64)

    def turn(self, sid: str, t: _Turn, i: int) -> None:
        c0 = time.thread_time()
        m = self.store.lookup(sid, t.prompt)
        _record(self.store, sid, t, i, m)  # (record_turn does not need the engine's input)
        self.cpu += time.thread_time() - c0
        assert m.text_len == t.prefix_len, (sid, i, m.text_len, t.prefix_len)
        input_ids = m.token_ids + t.delta  # what goes to the engine
        assert len(input_ids) >= len(t.delta)

    def export(self, sid: str, key: str) -> int:
        return len(self.store.export_training_trace(sid, key).input_ids)


class _Floor:
    """The floor of the library's turn path: two round trips through redis-py + hiredis (what
    tracestore's sync client is built on), carrying as many bytes each way as tracestore's
    ``lookup`` + ``record_turn`` of the same block did, and no other work: no validation,
    hashing, packing, keys, cache or reply parsing. Its ``cpu`` is measured as
    :class:`_Tracestore`'s is; the sizes are ``of``'s calls in the block it ran just before.
    It has no export: the loop skips it in that phase.
    """

    name = "floor"
    ECHO = "return string.rep('x', tonumber(ARGV[2]))"

    def __init__(self, r: Any, of: _Tracestore) -> None:
        self.r = r
        self.of = of
        self.sha = r.script_load(self.ECHO)
        self.cpu = 0.0

    def turn(self, sid: str, t: _Turn, i: int) -> None:
        sent, got = self.of.call_bytes
        blob = b"x" * max(1, sent - 130)  # ~130 bytes of a request are its framing (EVALSHA, sha, lengths)
        c0 = time.thread_time()
        for _ in range(2):
            self.r.evalsha(self.sha, 0, blob, got)
        self.cpu += time.thread_time() - c0


class _Baseline:
    """The same calls on the text trie, through :class:`SessionServerClient`."""

    def __init__(self, name: str, client: SessionServerClient) -> None:
        self.name = name
        self.client = client

    def turn(self, sid: str, t: _Turn, i: int) -> None:
        pos, prefix_ids = self.client.before_request(sid, t.prompt)
        assert pos == t.prefix_len, (sid, i, pos, t.prefix_len)
        input_ids = prefix_ids + t.delta
        assert len(input_ids) >= len(t.delta)
        self.client.after_response(sid, t.prompt, t.response, t.delta, t.out, t.logprobs, i)

    def export(self, sid: str, key: str) -> int:
        return len(self.client.export(sid, key)["input_ids"])


def _server_usec(r: Any) -> tuple[int, float]:
    """``(script usec, process CPU usec)`` of the server so far.

    Script time is the ``usec`` of EVALSHA/EVAL in INFO commandstats (the
    commands a script calls are counted inside it and again on their own
    lines, so only the script lines are summed; a steady turn sends nothing
    else); process CPU (INFO cpu, user + sys) adds the network I/O.
    """
    stats = r.info("commandstats")
    scripts = sum(int(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in ("evalsha", "eval"))
    cpu = r.info("cpu")
    return scripts, 1e6 * (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


def _run_side_by_side(
    blocks: dict[int, tuple[list[Any], dict[str, list[_Turn]]]], r: Any
) -> dict[int, dict[str, dict[str, Any]]]:
    """Turn-major over the sessions of every context at once: turn i of a block of (at most
    BLOCK) sessions of each context, each system in turn, the next blocks, then turn i+1.
    Contexts and systems alternate block by block, so load from other processes falls on
    all of them alike and the ratios between contexts are side by side too."""
    def probe() -> tuple[tuple[int, int], tuple[int, float]]:
        return _net(r), _server_usec(r)

    a0, _ = probe()
    a1, _ = probe()
    info_cost = [x - y for x, y in zip(a1, a0, strict=True)]  # bytes one probe's INFO calls add
    acc: dict[int, dict[str, dict[str, list[float]]]] = {
        ctx: {
            s.name: {p: [0.0, 0, 0, 0, 0, 0, 0.0] for p in ("first_turn", "steady_turns", "export")}
            for s in systems
        }
        for ctx, (systems, _) in blocks.items()
    }
    # blocks of at most BLOCK sessions, so that no context's figure depends on its block size
    chunks = {
        ctx: [list(sessions.items())[j : j + BLOCK] for j in range(0, len(sessions), BLOCK)]
        for ctx, (_, sessions) in blocks.items()
    }
    for i in range(TURNS + 1):
        phase = "first_turn" if i == 0 else "steady_turns" if i < TURNS else "export"
        for j in range(max(map(len, chunks.values()))):
            for ctx, (systems, _) in blocks.items():
                if j >= len(chunks[ctx]):
                    continue
                for system in systems:
                    rt = getattr(system, "rt", None)
                    if rt is not None:
                        rt.n = 0
                    if hasattr(system, "cpu"):
                        system.cpu = 0.0
                    gc.collect()  # the garbage of the block before is not this block's time
                    before, usec = probe()
                    start = time.perf_counter()
                    for sid, turns in chunks[ctx][j]:
                        if i < TURNS:
                            system.turn(sid, turns[i], i)
                        elif isinstance(system, _Floor):
                            continue
                        else:
                            last = turns[-1]
                            n = system.export(sid, last.prompt + last.response)
                            assert n == sum(len(t.delta) + len(t.out) for t in turns)
                    took = time.perf_counter() - start
                    now, usec_after = probe()
                    sent, got = now[0] - before[0] - info_cost[0], now[1] - before[1] - info_cost[1]
                    wire = sent + got
                    if isinstance(system, _Tracestore):  # what its floor sends and gets next
                        n_calls = 2 * len(chunks[ctx][j])
                        system.call_bytes = (max(1, round(sent / n_calls)), max(1, round(got / n_calls)))
                    a = acc[ctx][system.name][phase]
                    a[0] += took
                    a[1] += len(chunks[ctx][j])
                    a[2] += wire
                    a[3] += rt.n if rt is not None else 0
                    a[4] += usec_after[0] - usec[0]
                    a[5] += usec_after[1] - usec[1]
                    a[6] += getattr(system, "cpu", 0.0)
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for ctx, by_system in acc.items():
        out[ctx] = {}
        n_sessions = len(blocks[ctx][1])
        for name, phases in by_system.items():
            res: dict[str, Any] = {}
            for phase, (took, n, wire, rts, usec, cpu, client) in phases.items():
                res[phase] = {
                    "calls" if phase == "export" else "turns": int(n),
                    "per_s": round(n / took, 1),
                }
                if name == "floor":
                    if phase == "export":  # it exports nothing
                        del res[phase]
                        continue
                    res[phase]["wire_bytes"] = round(wire / n, 1)
                    res[phase]["client_cpu_us"] = round(1e6 * client / n, 1)
                elif name == "tracestore":
                    res[phase]["wire_bytes"] = round(wire / n, 1)
                    res[phase]["round_trips"] = round(rts / n, 2)
                    res[phase]["server_us"] = round(usec / n, 1)
                    res[phase]["server_cpu_us"] = round(cpu / n, 1)
                    if phase != "export":
                        res[phase]["client_cpu_us"] = round(1e6 * client / n, 1)
            turn_s = phases["first_turn"][0] + phases["steady_turns"][0]
            res["session_turns_per_s"] = round(n_sessions * TURNS / turn_s, 1)
            out[ctx][name] = res
    return out


def _baseline_serialized_bytes(turns: list[_Turn]) -> dict[str, float]:
    """Pickled size of every actor call's arguments and result (what Ray ships), per turn."""
    trie = TextTrieStore()
    sizes = []
    sid = "sample"
    for i, t in enumerate(turns):
        n = 0
        res = trie.search(sid, t.prompt)
        n += len(pickle.dumps((sid, t.prompt))) + len(pickle.dumps(res))
        res2 = trie.search(sid, t.prompt)
        n += len(pickle.dumps((sid, t.prompt))) + len(pickle.dumps(res2))
        from .baselines.actor_store import TokenizedSegment

        d = TokenizedSegment(t.prompt[res2[0] :], t.delta, version=i)
        s = TokenizedSegment(t.response, t.out, list(t.out), t.logprobs, version=i)
        n += len(pickle.dumps((sid, t.prompt, d))) + len(
            pickle.dumps((sid, t.prompt + t.response, s))
        )
        trie.insert(sid, t.prompt, d)
        trie.insert(sid, t.prompt + t.response, s)
        sizes.append(n)
    return {
        "first_turn": float(sizes[0]),
        "steady_turns": round(sum(sizes[1:]) / (len(sizes) - 1), 1),
    }


def _redis_bytes_per_token(store: TraceStore, sessions: dict[str, list[_Turn]]) -> dict[str, float]:
    r = store.redis
    total = 0
    for sid in sessions:
        for key in store.keys.data_keys(sid):
            total += int(r.memory_usage(key, samples=0) or 0)
    tokens = sum(len(t.delta) + len(t.out) for turns in sessions.values() for t in turns)
    return {"bytes_per_token": round(total / tokens, 2), "bytes": total, "tokens": tokens}


def _write_only(store: TraceStore, sessions: dict[str, list[_Turn]]) -> None:
    for i in range(TURNS):
        for sid, turns in sessions.items():
            t = turns[i]
            _record(store, sid, t, i, store.lookup(sid, t.prompt))


def _python_bytes_per_token(sessions: dict[str, list[_Turn]]) -> float:
    """Memory of the baseline's trie in Python (tracemalloc), per stored token."""
    gc.collect()
    tracemalloc.start()
    trie = TextTrieStore()
    client = SessionServerClient(trie)
    for i in range(TURNS):
        for sid, turns in sessions.items():
            t = turns[i]
            client.after_response(
                sid, t.prompt, t.response, t.delta, list(t.out), list(t.logprobs), i
            )
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens = sum(len(t.delta) + len(t.out) for turns in sessions.values() for t in turns)
    # the prompt strings themselves are kept by the driver too; count only the trie's share
    del trie, client
    return round(used / tokens, 2)


def run(quick: bool) -> dict[str, Any]:
    import ray

    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    counts = SESSIONS_QUICK if quick else SESSIONS_FULL
    figures: dict[str, Any] = {
        "turns": TURNS,
        "user_tokens_per_turn": USER_TOKENS,
        "response_tokens_per_turn": RESPONSE_TOKENS,
        "contexts": {},
    }
    server = EmbeddedServer().start()
    floor_redis = redis.Redis.from_url(server.url)  # the floors' own connection
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run_id = f"bench-{uuid.uuid4().hex[:6]}"
        actor = remote_class().remote()
        blocks: dict[int, tuple[list[Any], dict[str, list[_Turn]]]] = {}
        stores: dict[int, TraceStore] = {}
        for context in CONTEXTS:
            n = counts[context]
            print(f"   context ~{context} tokens, {n} sessions x {TURNS} turns", flush=True)
            sessions = {f"c{context}-s{i}": _session(context, seed=i) for i in range(n)}
            # one client (session server) per context: each has its own node cache
            stores[context] = store = TraceStore.connect(server.url, run=run_id)
            ts = _Tracestore(store)
            systems = [
                ts,
                _Floor(floor_redis, ts),
                _Baseline("actor", SessionServerClient(actor)),
                _Baseline("in_process_trie", SessionServerClient(TextTrieStore())),
            ]
            blocks[context] = (systems, sessions)
        gc.collect()
        gc.freeze()  # the prepared sessions are never garbage: keep them out of every collection
        print("   every context and system side by side, turn by turn", flush=True)
        timed = _run_side_by_side(blocks, stores[CONTEXTS[0]].redis)
        gc.unfreeze()
        ray.kill(actor)
        for context, (_, sessions) in blocks.items():
            store = stores[context]
            res: dict[str, Any] = {"sessions": len(sessions), **timed[context]}
            res["actor"]["serialized_bytes_per_turn"] = _baseline_serialized_bytes(
                next(iter(sessions.values()))
            )
            sample = dict(list(sessions.items())[:MEMORY_SESSIONS])
            res["memory_with_text"] = _redis_bytes_per_token(store, sample)
            nt = TraceStore.connect(
                server.url, run=f"bench-nt-{uuid.uuid4().hex[:6]}", store_text=False
            )
            _write_only(nt, sample)
            res["memory_without_text"] = _redis_bytes_per_token(nt, sample)
            nt.drop_sessions_data(list(sample))
            nt.close()
            res["baseline_python_bytes_per_token"] = _python_bytes_per_token(
                dict(list(sessions.items())[:5])
            )
            ts, ac = res["tracestore"], res["actor"]
            res["ratio_steady_turns_per_s"] = round(
                ts["steady_turns"]["per_s"] / ac["steady_turns"]["per_s"], 2
            )
            res["ratio_session_turns_per_s"] = round(
                ts["session_turns_per_s"] / ac["session_turns_per_s"], 2
            )
            store.drop_sessions_data(list(sessions))
            figures["contexts"][str(context)] = res
            print(
                f"     ~{context}: tracestore {ts['steady_turns']['per_s']} turns/s "
                f"({ts['steady_turns']['server_us']} us server, "
                f"{ts['steady_turns']['client_cpu_us']} us client CPU), actor "
                f"{ac['steady_turns']['per_s']} ({res['ratio_steady_turns_per_s']}x); "
                f"wire {ts['steady_turns']['wire_bytes']} B/turn; "
                f"memory {res['memory_without_text']['bytes_per_token']} / "
                f"{res['memory_with_text']['bytes_per_token']} B/token (no text / text)",
                flush=True,
            )
            store.close()
    finally:
        floor_redis.close()
        ray.shutdown()
        server.stop()
    c = figures["contexts"]
    w1 = c["1024"]["tracestore"]["steady_turns"]["wire_bytes"]
    w32 = c["32768"]["tracestore"]["steady_turns"]["wire_bytes"]
    r1 = c["1024"]["tracestore"]["steady_turns"]["per_s"]
    r32 = c["32768"]["tracestore"]["steady_turns"]["per_s"]
    c8 = c["8192"]["tracestore"]["steady_turns"]["client_cpu_us"]
    figures["client_cpu_us_per_steady_turn"] = {
        ctx: c[ctx]["tracestore"]["steady_turns"]["client_cpu_us"] for ctx in c
    }
    f8 = c["8192"]["floor"]["steady_turns"]["client_cpu_us"]
    figures["floor_client_cpu_us_per_steady_turn"] = {
        ctx: c[ctx]["floor"]["steady_turns"]["client_cpu_us"] for ctx in c
    }
    figures["goals"] = {
        "client_cpu_us_8k (goal <= 100)": {
            "value": c8, "goal": "<= 100", "met": c8 <= 100,
            "floor": f8, "floor_meets_goal": f8 <= 100, "over_floor": round(c8 / f8, 2) if f8 else None,
        },
        "turn_rate_32k_over_1k (goal >= 0.8)": round(r32 / r1, 3),
        "ratio_at_8k (goal >= 20)": c["8192"]["ratio_steady_turns_per_s"],
        "wire_32k_over_1k (goal <= 1.2)": round(w32 / w1, 3),
        "bytes_per_token_without_text_worst (goal <= 10)": max(
            x["memory_without_text"]["bytes_per_token"] for x in c.values()
        ),
        "bytes_per_token_with_text_worst (goal <= 16)": max(
            x["memory_with_text"]["bytes_per_token"] for x in c.values()
        ),
    }
    print(
        f"   client CPU per steady turn (us): {figures['client_cpu_us_per_steady_turn']}; "
        f"its floor (two round trips of the same bytes, nothing else): "
        f"{figures['floor_client_cpu_us_per_steady_turn']}; "
        f"goal <= 100 at 8k: {'met' if c8 <= 100 else 'not met'} (the floor: {f8})",
        flush=True,
    )
    print(f"   goals: {figures['goals']}", flush=True)
    return figures
