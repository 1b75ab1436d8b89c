"""The gate healing itself under faults, with agents on it (issue 25): ``python -m benchmarks faults``.

16 openai-SDK agents with the SDK's default retries (non-streamed answers of
150-400 tokens, a fresh session per call; an agent whose call failed redoes
its turn a second later) through one ``tracestore gateway`` in front of
``tracestore engine``, and an updater that runs a weight update every 3 s
and never clears poison. One fault per scenario, after 10 s of load, then 25 s
more: ``baseline`` (none), ``engine`` (SIGKILL, restarted on its port 1 s
later), ``gateway`` (SIGKILL, restarted on its port 1 s later),
``gateway_pair`` (the same, with a second gateway process on the same port,
``--reuse-port``: the agents' retries land on it), on the embedded server; ``primary`` (SIGKILL of the control slot's primary of a
3+3 cluster with a 2 s node timeout: the cluster fails over by itself).

Per scenario: calls ok / failed (by error) and in the fault window (calls
that ended after the fault and started before it healed + 15 s); weight
updates ok / refused and the first that succeeded after the heal; the gate at
the end (state, live and poisoned leases, after a dead gateway's heartbeat
deadline and one resolving pass); every successful call recorded exactly once
with the tokens the agent got, and nothing recorded for a call the agent saw
fail. ``--quick``: 4 s of load before and 10 s after each fault.
"""

from __future__ import annotations

import collections
import random
import threading
import time
import uuid
from typing import Any

import openai

from tests._gateway import CliServer
from tracestore import TraceStore
from tracestore.gateway.tokenizer import BuiltinTokenizer
from tracestore.servers import EmbeddedServer, LocalCluster
from tracestore.servers.ports import free_port

MODEL = "tracestore-reference"
AGENTS = 16
TOK = BuiltinTokenizer()
SCENARIOS = ("baseline", "engine", "gateway", "gateway_pair", "primary")


def engine_proc(port: int) -> CliServer:
    return CliServer("engine", "--port", str(port), "--max-len", "4096", "--max-batch", "64").start()


def gateway_proc(engine_url: str, url: str, run: str, port: int, *extra: str) -> CliServer:
    return CliServer("gateway", "--engine", engine_url, "--url", url, "--run", run, "--port", str(port), *extra).start()


def scenario(name: str, url: str, fault: str, cluster: LocalCluster | None = None, load_s: tuple[float, float] = (10.0, 25.0)) -> dict[str, Any]:
    run = f"rel-{name}-{uuid.uuid4().hex[:6]}"
    eport, gport = free_port(), free_port()
    eng = engine_proc(eport)
    pair = fault == "gateway_pair"  # two gateway processes on one port (--reuse-port); one is killed
    extra = ("--reuse-port",) if pair else ()
    gw = gateway_proc(eng.url, url, run, gport, *extra)
    other = gateway_proc(eng.url, url, run, gport, *extra) if pair else None
    gw_url = gw.url
    st = TraceStore.connect(url, run=run)
    upd_store = TraceStore.connect(url, run=run)
    stop = threading.Event()
    lock = threading.Lock()
    calls: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    procs = {"eng": eng, "gw": gw}

    def agent(i: int) -> None:
        client = openai.OpenAI(base_url=gw_url + "/v1", api_key="unused")  # default max_retries=2
        rng = random.Random(i)
        k = 0
        while not stop.is_set():
            k += 1
            sid = f"a{i}-{k}-{uuid.uuid4().hex[:4]}"
            n = rng.randint(150, 400)
            t0 = time.monotonic()
            rec: dict[str, Any] = {"sid": sid, "t0": t0, "max_tokens": n}
            try:
                r = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"reach {k} from {i}"}], max_tokens=n,
                    extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": sid},
                )
                rec.update(ok=True, text=r.choices[0].message.content, n=r.usage.completion_tokens)
            except Exception as exc:  # noqa: BLE001 - counted
                code = getattr(exc, "status_code", None)
                body = getattr(exc, "body", None)
                c = body.get("code") if isinstance(body, dict) else None
                rec.update(ok=False, err=f"{type(exc).__name__}:{code}:{c}")
            rec["t1"] = time.monotonic()
            with lock:
                calls.append(rec)
            if not rec["ok"]:
                time.sleep(1.0)  # an agent that redoes its failed turn a second later

    def updater() -> None:
        v = upd_store.gate.status().version
        while not stop.is_set():
            time.sleep(3)
            t0 = time.monotonic()
            try:
                with upd_store.gate.weight_update(v + 1, drain_timeout_s=30):
                    try:
                        procs["eng"].post("/update_weight_version", {"new_version": v + 1})
                    except Exception:  # noqa: BLE001 - engine down: the version is the gate's
                        pass
                v += 1
                updates.append({"t0": t0, "t1": time.monotonic(), "ok": True, "version": v})
            except Exception as exc:  # noqa: BLE001 - a refused update; the updater retries
                updates.append({"t0": t0, "t1": time.monotonic(), "ok": False, "err": type(exc).__name__ + ": " + str(exc)[:160]})

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    ut = threading.Thread(target=updater)
    for t in threads:
        t.start()
    ut.start()
    time.sleep(load_s[0])
    t_fault = time.monotonic()
    healed = t_fault
    if fault == "engine":
        eng.kill()
        time.sleep(1.0)
        procs["eng"] = engine_proc(eport)
        healed = time.monotonic()
    elif fault in ("gateway", "gateway_pair"):
        gw.kill()
        time.sleep(1.0)
        procs["gw"] = gateway_proc(eng.url, url, run, gport, *extra)
        healed = time.monotonic()
    elif fault == "primary":
        assert cluster is not None
        primary = cluster.primary_of(st.keys.gate)
        (replica,) = cluster.replicas_of(primary)
        primary.kill()
        while True:
            try:
                if cluster.primary_of(st.keys.gate) is replica:
                    break
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.1)
        healed = time.monotonic()
        primary.restart()
        cluster.wait_replicas_online()
    time.sleep(load_s[1])
    stop.set()
    for t in threads:
        t.join(300)
    ut.join(120)
    t_end = time.monotonic()
    # the gate, as the run left it (give a dead gateway's leases their heartbeat deadline + one pass)
    deadline = time.monotonic() + 30
    while True:
        s = st.gate.status()
        if (s.live == 0 and s.poisoned == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    gate_end = {"state": s.state, "live": s.live, "poisoned": s.poisoned, "version": s.version,
                "waited_s": round(time.monotonic() - t_end, 1)}
    # exactly once
    ok = [c for c in calls if c["ok"]]
    failed = [c for c in calls if not c["ok"]]
    bad_ok: list[Any] = []
    bad_failed: list[str] = []
    for c in ok:
        keys = st.trace_keys(c["sid"])  # from the store: /v1/sessions/SID/trace serves only its own process's turns
        if len(keys) != 2:  # one turn: the prompt node and the answer node (a second record would fork)
            bad_ok.append((c["sid"], "keys", len(keys)))
            continue
        tr = st.export_training_trace(c["sid"], max(keys, key=len))
        ids = [t for t, lab in zip(tr.input_ids, tr.labels, strict=True) if lab != -100]
        if len(ids) != c["n"] or TOK.decode(ids) != c["text"]:
            bad_ok.append((c["sid"], len(ids), c["n"]))
    for c in failed:
        if st.trace_keys(c["sid"]):
            bad_failed.append(c["sid"])
    during = [c for c in calls if c["t1"] >= t_fault and c["t0"] <= healed + 15]
    after_heal = [u for u in updates if u["ok"] and u["t0"] >= healed]
    out = {
        "fault": fault,
        "calls": len(calls), "ok": len(ok), "failed": len(failed),
        "failed_by_error": dict(collections.Counter(c["err"] for c in failed)),
        "failed_before_fault": sum(1 for c in failed if c["t1"] < t_fault),
        "calls_in_fault_window": len(during), "failed_in_fault_window": sum(1 for c in during if not c["ok"]),
        "updates_ok": sum(u["ok"] for u in updates), "updates_refused": sum(not u["ok"] for u in updates),
        "refusals": [round(u["t0"] - t_fault, 1).__str__() + "s: " + u["err"] for u in updates if not u["ok"]][:6],
        "longest_refused_update_s": max([u["t1"] - u["t0"] for u in updates if not u["ok"]], default=0.0),
        "first_ok_update_after_heal_s": round(after_heal[0]["t1"] - healed, 2) if after_heal else None,
        "heal_after_fault_s": round(healed - t_fault, 2),
        "gate_end": gate_end,
        "ok_not_recorded_exactly": bad_ok[:5], "ok_not_recorded_exactly_n": len(bad_ok),
        "failed_but_recorded": bad_failed[:5], "failed_but_recorded_n": len(bad_failed),
    }
    print(f"   {name}: {out['ok']} ok / {out['failed']} failed ({out['failed_in_fault_window']} of {out['calls_in_fault_window']} in the fault window), "
          f"updates {out['updates_ok']} ok / {out['updates_refused']} refused, first after heal {out['first_ok_update_after_heal_s']} s, "
          f"gate {gate_end['state']} live {gate_end['live']} poisoned {gate_end['poisoned']}, not recorded exactly {out['ok_not_recorded_exactly_n']}, "
          f"failed but recorded {out['failed_but_recorded_n']}", flush=True)
    procs["gw"].stop()
    if other is not None:
        other.stop()
    procs["eng"].stop()
    st.close()
    upd_store.close()
    return out


def run(quick: bool) -> dict[str, Any]:
    """Every scenario, one after the other; their figures."""
    load = (4.0, 10.0) if quick else (10.0, 25.0)
    res: dict[str, Any] = {"agents": AGENTS, "load_s": list(load)}
    server = EmbeddedServer().start()
    try:
        for f in ("baseline", "engine", "gateway", "gateway_pair"):
            res[f] = scenario(f, server.url, f, None, load)
    finally:
        server.stop()
    cluster = LocalCluster(primaries=3, replicas=1, extra_args=["--cluster-node-timeout", "2000"]).start()
    try:
        res["primary"] = scenario("primary", cluster.url, "primary", cluster, load)
    finally:
        cluster.stop()
    return res
