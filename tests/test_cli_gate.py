"""``tracestore gate ...`` and ``tracestore routes`` against real servers (click's CliRunner)."""

from __future__ import annotations

import time

import orjson
import pytest
from click.testing import CliRunner, Result

from tracestore import TraceStore
from tracestore.cli import main
from tracestore.errors import GateSealed


def cli(url: str, run: str, *args: str) -> Result:
    """Invoke ``tracestore <args> --url URL --run RUN`` in-process."""
    return CliRunner().invoke(main, [*args, "--url", url, "--run", run])


def test_operator_walks_a_weight_update_through_the_cli(store: TraceStore, url: str) -> None:
    run = store.run_id
    g = store.gate
    live = g.admit("sess-live", "worker-7", 30)
    dead = g.admit("sess-dead", "worker-dead", 0.05)
    time.sleep(0.1)

    r = cli(url, run, "gate", "status")
    assert r.exit_code == 0, r.output
    assert "open" in r.output and "worker-dead" in r.output and "sess-dead" in r.output
    assert dead.id in r.output and "overdue" in r.output
    r = cli(url, run, "gate", "status", "--check")
    assert r.exit_code == 2
    r = cli(url, run, "gate", "status", "--json")
    assert r.exit_code == 0, r.output
    doc = orjson.loads(r.output)
    assert (doc["state"], doc["version"], doc["live"], doc["poisoned"]) == ("open", 0, 1, 1)

    r = cli(url, run, "gate", "seal", "--retry-after-ms", "750")
    assert r.exit_code == 0, r.output
    assert "sealed" in r.output
    with pytest.raises(GateSealed) as ei:
        g.admit("sess-new", "w", 5)
    assert ei.value.retry_after_ms == 750

    r = cli(url, run, "gate", "drain", "--timeout", "0.2")
    assert r.exit_code == 2 and "no" in r.output  # a live lease remains
    g.settle(live, "completed")
    r = cli(url, run, "gate", "drain", "--timeout", "2")
    assert r.exit_code == 2 and dead.id in r.output  # drained, but poisoned
    r = cli(url, run, "gate", "install", "1")
    assert r.exit_code == 1 and "GatePoisoned" in r.output

    r = cli(url, run, "gate", "clear-poison", "--resolution", "worker-died")
    assert r.exit_code == 2 and "give the LEASE_IDS to clear, or --all" in r.output  # a usage error
    r = cli(url, run, "gate", "clear-poison", "--all", "--resolution", "worker-died")
    assert r.exit_code == 0, r.output
    assert f"cleared 1 of 1 lease(s): {dead.id}" in r.output
    r = cli(url, run, "gate", "drain", "--timeout", "1")
    assert r.exit_code == 0, r.output
    r = cli(url, run, "gate", "status", "--check")
    assert r.exit_code == 0, r.output

    r = cli(url, run, "gate", "install", "1")
    assert r.exit_code == 0 and "installed version 1 (was 0)" in r.output
    r = cli(url, run, "gate", "install", "1")
    assert r.exit_code == 1 and "StaleVersion" in r.output
    r = cli(url, run, "gate", "reopen")
    assert r.exit_code == 0 and "open" in r.output
    st = g.status()
    assert (st.state, st.version, st.poisoned) == ("open", 1, 0)
    assert g.admit("sess-new", "w", 5).version == 1


def test_cli_refuses_bad_arguments(store: TraceStore, url: str) -> None:
    # usage errors: exit 2
    r = cli(url, store.run_id, "gate", "seal", "--retry-after-ms", "0")
    assert r.exit_code == 2 and "--retry-after-ms" in r.output
    r = cli(url, store.run_id, "gate", "drain", "--timeout", "-1")
    assert r.exit_code == 2 and "--timeout" in r.output
    r = cli(url, store.run_id, "gate", "clear-poison", "bad{id}", "--resolution", "x")
    assert r.exit_code == 2 and "InvalidId" in r.output
    assert store.gate.status().state == "open"


def test_routes_shows_load_and_routes(store: TraceStore, url: str) -> None:
    router = store.router(["ep-a", "ep-b"])
    placed = {sid: router.acquire(sid) for sid in ("s0", "s1", "s2")}
    router.retire(["s2"])
    r = cli(url, store.run_id, "routes", "s0", "s1", "s2", "nowhere")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "routed sessions: 2; retired (tombstoned): 1" in out
    assert "(retired: 410 Gone)" in out and "(not routed)" in out
    lines = {ln.split()[0]: ln.split()[1] for ln in out.splitlines() if ln.startswith(("s0 ", "s1 "))}
    assert lines == {"s0": placed["s0"], "s1": placed["s1"]}
    r = cli(url, store.run_id, "routes")
    assert r.exit_code == 0 and "ep-a" in r.output and "ep-b" in r.output


def test_gate_demo_section(standalone_url: str) -> None:
    r = CliRunner().invoke(main, ["demo", "--url", standalone_url, "--only", "gate"])
    assert r.exit_code == 0, r.output
    for text in ("GateSealed, retry in 500 ms", "live=0, poisoned=1", "holder worker-3",
                 "refused: GatePoisoned", "cleared 1", "version 0 -> 1", "open, version 1", "version 2 ("):
        assert text in r.output, text


def test_clear_poison_all_clears_more_than_one_status_page(store: TraceStore, url: str) -> None:
    g = store.gate
    leases = g.admit_many([(f"p-{i}", "w-dead") for i in range(150)], 30)
    g.settle_many([x.id for x in leases], "unknown")  # outcome unknown: every lease is poisoned
    assert g.status().poisoned == 150 and len(g.status().poison) == 100  # status lists 100
    r = cli(url, store.run_id, "gate", "clear-poison", "--all", "--resolution", "worker-died")
    assert r.exit_code == 0, r.output
    assert "cleared 150 of 150 lease(s)" in r.output
    assert g.status().poisoned == 0


def test_status_names_every_poisoned_lease_in_one_line(store: TraceStore, url: str) -> None:
    """Issue 25 item 2: each poisoned lease in one line (id, why, how long ago, session,
    holder, engine, request id), every one of them, not the first 100; --json the same."""
    g = store.gate
    engine = "http://10.0.0.7:30000"
    unknown = g.admit("s-unknown", "gw-1", 60, engine=engine, request="rid-u")
    g.settle(unknown, "unknown")
    bulk = g.admit_many([(f"b-{i}", "gw-3") for i in range(110)], 60)
    g.settle_many(bulk, "unknown")
    # admitted after the last settle: a settle sweeps leases past their deadline into the poison
    # set ("expired"), so one running 50 ms later (a loaded machine) made this lease not "overdue"
    expired = g.admit("s-expired", "gw-2", 0.05, engine=engine, request="rid-e")
    g.heartbeat("gw-dead", 0.05)
    orphan = g.admit("s-orphan", "gw-dead", 60, engine=engine, request="rid-o")
    end = time.monotonic() + 30
    while g.status().live != 1 or not g.dead_holder_leases():  # expired: past its deadline; gw-dead: stopped
        assert time.monotonic() < end
        time.sleep(0.02)

    r = cli(url, store.run_id, "gate", "status")
    assert r.exit_code == 0, r.output
    lines = {ln.split()[2].rstrip(":"): ln for ln in r.output.splitlines() if ln.startswith("poisoned lease ")}
    assert set(lines) == {unknown.id, expired.id, *(x.id for x in bulk)}  # 112: every one
    u, e = lines[unknown.id], lines[expired.id]
    assert "unknown" in u and " ago;" in u and "session s-unknown" in u and "holder gw-1" in u
    assert f"engine {engine}" in u and "request rid-u" in u and "version 0" in u
    assert "overdue" in e and "session s-expired" in e and "holder gw-2" in e and "request rid-e" in e
    assert "engine -, request -" in lines[bulk[0].id]
    dead = [ln for ln in r.output.splitlines() if ln.startswith("lease of a dead holder")]
    assert len(dead) == 1 and orphan.id in dead[0] and "holder gw-dead" in dead[0] and "request rid-o" in dead[0]

    r = cli(url, store.run_id, "gate", "status", "--json")
    assert r.exit_code == 0, r.output
    doc = orjson.loads(r.output)
    by_id = {p["lease_id"]: p for p in doc["poisoned_leases"]}
    assert len(by_id) == 112 and doc["poisoned"] == 112
    p = by_id[unknown.id]
    assert (p["reason"], p["sid"], p["holder"], p["engine"], p["request"]) == (
        "unknown", "s-unknown", "gw-1", engine, "rid-u",
    )
    assert p["ago_ms"] >= 0 and p["since_ms"] <= p["server_ms"]
    assert [d["lease_id"] for d in doc["dead_holder_leases"]] == [orphan.id]
