"""The viewer (``tracestore ui``) on real servers, in a real headless browser, with real HTTP clients.

A run is recorded through the public API (a multi-turn session that forks
into two branches, a weight-update cycle that drains a live lease, a replay
group, a release); ``tracestore ui`` is started as a subprocess against the
same server; the pages are loaded in Debian's ``chromium`` (``--dump-dom``:
the DOM after the browser parsed and ran the page) and compared with what
the store returns (``export_training_trace`` for every token, the gate's
log, ``stats()``); the JSON endpoints are read with aiohttp's client. The
observer ACL user serves the viewer too. Skips (with the reason) only where
no browser can be had.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import pytest

from tests._gateway import BIN, CliServer
from tracestore import PermissionDenied, TraceStore, acl
from tracestore.gate_log import cycles, gate_events
from tracestore.replay import Group
from tracestore.traces.index import SessionIndex, node_id
from tracestore.traces.reads import read_path
from tracestore.traces.types import Node
from tracestore.trainer.tokenizer import TOKENIZER
from tracestore.ui.html_session import session_page
from tracestore.ui.sessions import Shape, fork_of
from tracestore.ui.views import BranchRow, NodeRow, SessionView

SID = "chat/1?x#y"  # a session id with characters a URL must escape
P1 = "<user>add 2 and 3</user>"
R1 = "<assistant>add 2 3</assistant>"
P2 = P1 + R1 + "<tool>5</tool>"
R2 = "<assistant>done 5</assistant>"
P2B = P1 + R1 + "<user>no, add 2 and 4</user>"  # the client edited its history: a fork after R1
R2B = "<assistant>add 2 4</assistant>"
LEAF_KEYS = (P2 + R2, P2B + R2B)


def _record(store: TraceStore) -> None:
    """A forked two-turn session (routed-expert keys on every node), a gate cycle, a replay group, a release."""
    store.open_session(SID, "rollout:0")
    m = store.lookup(SID, P1)
    store.record_turn(SID, P1, R1, prefix=m, delta_token_ids=[3, 4, 5], response_token_ids=[6, 7],
                      response_logprobs=[-0.5, -0.125], version=0, delta_expert_key="ek-p1",
                      response_expert_key="ek-r1")
    lease = store.gate.admit(SID, "worker-0", 60)  # live when the weight update seals: its drain waits
    g = store.gate
    g.seal()
    g.settle(lease, "completed")
    assert g.drain(30).drained
    g.install(1)
    g.reopen()
    for prompt, answer, ids, out in ((P2, R2, [8, 9], [10, 11, 12]), (P2B, R2B, [13], [14, 15])):
        m = store.lookup(SID, prompt)
        store.record_turn(SID, prompt, answer, prefix=m, delta_token_ids=ids, response_token_ids=out,
                          response_logprobs=[-0.3 * (i + 1) for i in range(len(out))], version=1,
                          delta_expert_key=f"ek-d{ids[0]}", response_expert_key=f"ek-r{out[0]}")
    for sid in ("g-a", "g-b", "g-c"):
        store.open_session(sid, "rollout:1")
        m = store.lookup(sid, P1)
        store.record_turn(sid, P1, R1, prefix=m, delta_token_ids=[3], response_token_ids=[6],
                          response_logprobs=[-1.0], version=0)
    store.replay.put(Group("grp-1", "calc", ("g-a", "g-b"), "completed", payload={"reward": 1.0}), owner="rollout:1")
    store.release(["g-c"], "rollout:1", "done")


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser: apt-get install -y chromium (.ci/run installs it)")


def dump_dom(url: str, tmp: Path) -> str:
    """The DOM of ``url`` once a real headless chromium loaded it (a fresh profile each time)."""
    profile = tmp / f"profile-{uuid.uuid4().hex[:8]}"
    out = subprocess.run(
        [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )
    shutil.rmtree(profile, ignore_errors=True)
    assert out.returncode == 0 and "<html" in out.stdout, out.stderr[-2000:]
    return out.stdout


@dataclass
class El:
    tag: str
    attrs: dict[str, str]
    text: str = ""


class Dom(HTMLParser):
    """Elements of a dumped DOM with their attributes and text (the text of an element and its children)."""

    VOID = {"meta", "input", "br", "img", "link", "hr", "circle", "rect", "line", "polyline"}

    def __init__(self, source: str) -> None:
        super().__init__(convert_charrefs=True)
        self.els: list[El] = []
        self._open: list[El] = []
        self.feed(source)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = El(tag, {k: v or "" for k, v in attrs})
        self.els.append(el)
        if tag not in self.VOID:
            self._open.append(el)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i].tag == tag:
                del self._open[i:]
                return

    def handle_data(self, data: str) -> None:
        for el in self._open:
            el.text += data

    def having(self, cls: str, tag: str | None = None) -> list[El]:
        return [e for e in self.els if cls in e.attrs.get("class", "").split() and (tag is None or e.tag == tag)]

    def by_id(self, ident: str) -> El:
        (el,) = [e for e in self.els if e.attrs.get("id") == ident]
        return el


@pytest.fixture
def recorded(store: TraceStore) -> TraceStore:
    _record(store)
    return store


@pytest.fixture
def ui(recorded: TraceStore, url: str) -> Iterator[CliServer]:
    srv = CliServer("ui", "--url", url, "--run", recorded.run_id, "--port", "0", "--tokenizer", "builtin").start()
    yield srv
    srv.stop()


def _nums(dom: Dom) -> dict[str, int]:
    return {e.attrs["data-id"]: int(e.attrs["data-num"]) for e in dom.having("node", "tr")}


def test_the_browser_shows_every_node_token_version_and_the_fork(ui: CliServer, recorded: TraceStore, tmp_path: Path) -> None:
    store = recorded
    base = f"{ui.url}/runs/{store.run_id}/sessions/{quote(SID, safe='')}"
    dom = Dom(dump_dom(base, tmp_path))
    rows = {int(e.attrs["data-num"]): e for e in dom.having("node", "tr")}
    idx = _index(store)
    assert sorted(rows) == sorted(idx.nums.values())  # every node, once
    for nid, num in idx.nums.items():
        n, a = idx.nodes[nid], rows[num].attrs
        assert (a["data-id"], int(a["data-version"]), int(a["data-tokens"]), int(a["data-end"])) == (n.id, n.version, n.ntok, n.end)
        assert a["data-parent"] == ("" if n.parent is None else str(idx.nums[n.parent]))
        assert a["data-expert-key"] == (n.expert_key or "")
        assert a["data-fork"] == (getattr(n, "fork", None) or "")  # the fork reason column, where recorded
    # the fork: one branch point (the answer R1) with the two edited continuations as its children
    (branch,) = dom.having("branch", "tr")
    r1 = idx.nums[node_id(P1 + R1)]
    assert int(branch.attrs["data-num"]) == r1
    assert sorted(map(int, branch.attrs["data-children"].split())) == sorted(
        idx.nums[node_id(k)] for k in (P2, P2B))
    leaves = sorted(int(e.attrs["data-num"]) for e in dom.having("leaf", "a"))
    assert leaves == sorted(idx.nums[node_id(k)] for k in LEAF_KEYS)
    assert dom.by_id("nodes-total").text == str(len(idx.nodes))
    gate_v = store.gate.status().version
    for key in LEAF_KEYS:  # every token of both branches, as the trainer would get it
        trace = store.export_training_trace(SID, key)
        page = Dom(dump_dom(f"{base}/path/{idx.nums[node_id(key)]}", tmp_path))
        toks = page.having("t", "span")
        assert [int(t.attrs["data-id"]) for t in toks] == trace.input_ids
        assert [int(t.attrs["data-label"]) for t in toks] == trace.labels
        assert [t.attrs["data-trained"] == "1" for t in toks] == [x != -100 for x in trace.labels]
        assert [float(t.attrs["data-lp"]) for t in toks] == trace.logprobs
        assert [int(t.attrs["data-v"]) for t in toks] == trace.versions
        assert [int(t.attrs["data-staleness"]) for t in toks] == [gate_v - v for v in trace.versions]
        per_token_keys = [k for n, k in zip(trace.nodes, trace.expert_keys or [], strict=True) for _ in range(n.ntok)]
        assert [t.attrs["data-ek"] for t in toks] == per_token_keys
        assert [t.text.split(" ", 1)[1] for t in toks] == [TOKENIZER.decode([i]) for i in trace.input_ids]
        assert page.by_id("tokens-total").text == str(len(trace.input_ids))


def _index(store: TraceStore) -> SessionIndex:
    """The session's index as the store reads it."""
    ix, _, _ = store.run(read_path(store.context, SID, lambda _ix: None))
    return ix


def test_the_run_page_shows_gate_cycles_replay_owners_and_counters(ui: CliServer, recorded: TraceStore, tmp_path: Path) -> None:
    store = recorded
    dom = Dom(dump_dom(f"{ui.url}/runs/{store.run_id}", tmp_path))
    (cyc,) = cycles(store.run(gate_events(store.context)))
    (row,) = dom.having("cycle", "tr")
    assert (int(row.attrs["data-to"]), int(row.attrs["data-drain-ms"])) == (1, cyc.drain_ms)
    assert cyc.live_at_seal == 1 and cyc.installed == (1,)
    assert dom.by_id("gate-version").text == "1" and dom.by_id("gate-state").text == "open"
    assert dom.having("plot", "svg"), "the gate timeline and the staleness histogram are drawn"
    cells = {(e.attrs["data-task"], e.attrs["data-status"]): int(e.attrs["data-groups"]) for e in dom.having("cell", "tr")}
    assert cells == {("calc", "completed"): 1}
    owners = {e.attrs["data-owner"]: int(e.attrs["data-sessions"]) for e in dom.having("owner", "tr")}
    # rollout:0 never heart-beat: found by the viewer's background discovery, counted live
    assert owners == {"rollout:0": 1, "replay": 2}
    stats = store.stats()
    shown = {e.attrs["data-counter"]: int(e.text) for e in dom.els if "data-counter" in e.attrs}
    assert shown["sessions_opened"] == stats.sessions_opened == 4
    assert shown["sessions_released"] == stats.sessions_released == 1
    assert shown["turns_recorded"] == stats.turns_recorded
    events = dom.having("event", "tr")
    assert len(events) == 1 and "g-c" in events[0].text
    runs = Dom(dump_dom(ui.url + "/", tmp_path))
    assert [e.attrs["data-run"] for e in runs.els if "data-run" in e.attrs] == [store.run_id]
    owner = Dom(dump_dom(f"{ui.url}/runs/{store.run_id}/owners/rollout:0", tmp_path))
    assert [e.attrs["data-sid"] for e in owner.having("session", "tr")] == [SID]
    groups = Dom(dump_dom(f"{ui.url}/runs/{store.run_id}/replay/calc/completed", tmp_path))
    assert [e.attrs["data-gid"] for e in groups.having("group", "tr")] == ["grp-1"]


async def _get(client: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with client.get(url) as resp:
        return resp.status, await resp.json() if resp.content_type == "application/json" else await resp.text()


def test_the_json_endpoints_carry_the_same_data(ui: CliServer, recorded: TraceStore) -> None:
    store = recorded
    api = f"{ui.url}/api/runs/{store.run_id}"
    sid = quote(SID, safe="")
    idx = _index(store)

    async def main() -> dict[str, Any]:
        async with aiohttp.ClientSession() as c:
            out = {}
            for name, url in {
                "runs": f"{ui.url}/api/runs", "run": api, "session": f"{api}/sessions/{sid}",
                "owner": f"{api}/owners/rollout%3A0", "replay": f"{api}/replay/calc/completed",
                **{f"path{i}": f"{api}/sessions/{sid}/path/{idx.nums[node_id(k)]}" for i, k in enumerate(LEAF_KEYS)},
                # a window that starts and ends inside nodes
                "window": f"{api}/sessions/{sid}/path/{idx.nums[node_id(LEAF_KEYS[0])]}?offset=4&count=4",
                "missing": f"{api}/sessions/nope", "bad": f"{api}/sessions/{sid}/path/999",
                "badpage": f"{api}/sessions/{sid}?page=x", "badrun": f"{ui.url}/api/runs/no%20such",
                "health": f"{ui.url}/health",
            }.items():
                out[name] = await _get(c, url)
            return out

    got = asyncio.run(main())
    assert all(got[k][0] == 200 for k in ("runs", "run", "session", "owner", "replay", "path0", "path1", "window", "health"))
    assert [r["run"] for r in got["runs"][1]["runs"]] == [store.run_id]
    run = got["run"][1]
    assert run["counters"]["sessions_opened"] == store.stats().sessions_opened
    assert run["cycles"][0]["installed"] == [1] and run["cycles"][0]["live_at_seal"] == 1
    sess = got["session"][1]
    assert sorted(n["num"] for n in sess["nodes"]) == sorted(idx.nums.values())
    assert sess["branches"][0]["children"] == sorted(sess["branches"][0]["children"]) and sess["leaves_total"] == 2
    for i, key in enumerate(LEAF_KEYS):
        trace = store.export_training_trace(SID, key)
        toks = got[f"path{i}"][1]["tokens"]
        assert [t["id"] for t in toks] == trace.input_ids and [t["logprob"] for t in toks] == trace.logprobs
        assert [t["version"] for t in toks] == trace.versions and [t["label"] for t in toks] == trace.labels
    whole = store.export_training_trace(SID, LEAF_KEYS[0])
    win = got["window"][1]
    assert [t["i"] for t in win["tokens"]] == [4, 5, 6, 7]
    assert [t["id"] for t in win["tokens"]] == whole.input_ids[4:8]
    assert [t["logprob"] for t in win["tokens"]] == whole.logprobs[4:8]
    assert win["tokens_total"] == len(whole.input_ids) and win["path_nodes"] == len(whole.nodes)
    assert [n["num"] for n in win["nodes"]] == sorted({t["node"] for t in win["tokens"]})
    assert [s["sid"] for s in got["owner"][1]["sessions"]] == [SID]
    assert got["replay"][1]["groups"][0]["sids"] == ["g-a", "g-b"]
    assert got["missing"][0] == 404 and got["missing"][1]["error"]["type"] == "NotFound"
    assert got["bad"][0] == 404 and "no node 999" in got["bad"][1]["error"]["message"]
    assert got["badpage"][0] == 400 and got["badrun"][0] == 400
    assert got["health"][1]["rescans"] == 1  # the discovery at start: no request scanned


def _grant(store: TraceStore, args: list[str]) -> None:
    if store.cluster:
        store.redis.execute_command(*args, target_nodes=store.redis.ALL_NODES)
    else:
        store.redis.execute_command(*args)


def test_the_observer_user_can_use_the_viewer(recorded: TraceStore, url: str, backend: str) -> None:
    if backend not in ("valkey", "cluster"):  # (Redis 7.0 refuses the grant's client|setinfo, as in test_security)
        pytest.skip("runs on standalone and cluster (the ACL rules are the engine's)")
    store = recorded
    user, password = f"obs-{uuid.uuid4().hex[:6]}", "s3cret"
    _grant(store, acl.grant(store.run_id, "observer", user=user, password=password))
    try:
        u = urlsplit(url)
        obs_url = u._replace(netloc=f"{user}:{password}@{u.hostname}:{u.port}").geturl()
        srv = CliServer("ui", "--url", obs_url, "--run", store.run_id, "--port", "0").start()
        try:
            api = f"{srv.url}/api/runs/{store.run_id}"
            sid = quote(SID, safe="")
            leaf = _index(store).nums[node_id(LEAF_KEYS[0])]

            async def main() -> list[tuple[int, Any]]:
                async with aiohttp.ClientSession() as c:
                    return [await _get(c, x) for x in (
                        f"{srv.url}/api/runs", api, f"{api}/sessions/{sid}", f"{api}/sessions/{sid}/path/{leaf}",
                        f"{api}/owners/rollout%3A0", f"{api}/replay/calc/completed", f"{srv.url}/runs/{store.run_id}",
                        f"{srv.url}/runs/{store.run_id}/sessions/{sid}")]

            got = asyncio.run(main())
        finally:
            srv.stop()
        assert [s for s, _ in got] == [200] * len(got), got
        assert got[1][1]["owners"] and got[1][1]["counters"]["sessions_opened"] == 4
        assert [t["id"] for t in got[3][1]["tokens"]] == store.export_training_trace(SID, LEAF_KEYS[0]).input_ids
        assert got[1][1]["gate"]["version"] == 1
        observer = TraceStore.connect(obs_url, run=store.run_id, create_run=False)
        try:  # the same user cannot write: the viewer ran with a read-only grant
            with pytest.raises(PermissionDenied):
                observer.release([SID], "rollout:0")
        finally:
            observer.close()
    finally:
        _grant(store, ["ACL", "DELUSER", user])


def test_usage_errors_exit_2_with_one_line(url: str, run_id: str) -> None:
    for args, said in (
        (["--run", "no-such-run"], "no run 'no-such-run'"),
        (["--run", "bad run"], "invalid run id"),
        (["--tokenizer", "/nonexistent/tok"], "--tokenizer"),
        (["--port", "70000"], "70000"),
    ):
        out = subprocess.run([*BIN, "ui", "--url", url, *args], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], (args, out.stderr)



@dataclass(frozen=True)
class _ForkedNode(Node):
    """A node as issue 30 records it (``Node.fork``), to check that the viewer shows the reason where it is set."""

    fork: str | None = None


def test_a_recorded_fork_reason_is_shown_in_the_tree_and_the_branches() -> None:
    root = _ForkedNode("a" * 16, None, 10, 2, 0, 0, None)
    left = _ForkedNode("b" * 16, root.id, 20, 1, 1, 0, None)
    right = _ForkedNode("c" * 16, root.id, 21, 1, 1, 0, None, fork="client_edit")
    ix = SessionIndex("e", 3, {n.id: n for n in (root, left, right)}, {root.id: 1, left.id: 2, right.id: 3})
    sh = Shape.of(ix)
    assert [fork_of(n) for _, n in sh.order] == [None, None, "client_edit"]
    assert fork_of(Node("d" * 16, None, 1, 1, 0, 0, None)) is None  # today's nodes have no fork field
    rows = tuple(NodeRow(ix.nums[n.id], n.id, ix.nums.get(n.parent or ""), d, n.end, n.ntok, "prompt", 0, None, None,
                         fork_of(n), len(sh.children.get(n.id, ())), None) for d, n in sh.order)
    (b,) = sh.branches
    view = SessionView("r", "s", 0, "o", "live", 0, 0, None, None, None, False, 3, 3, 4, 2, (2, 3), 2,
                       (BranchRow(1, b.end, (2, 3), tuple(fork_of(ix.nodes[c]) for c in sh.children[b.id])),),
                       1, 1, 1, rows)
    dom = Dom(session_page(view))
    assert {int(e.attrs["data-num"]): e.attrs["data-fork"] for e in dom.having("node", "tr")} == {1: "", 2: "", 3: "client_edit"}
    (branch,) = dom.having("branch", "tr")
    assert "client_edit" in branch.text
