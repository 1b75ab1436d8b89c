"""ACL roles of a run (issue 11 item 8): the grants of docs/security.md, run verbatim with redis-cli.

The observer (keys granted read-only, ``%R~``) reads everything an operator
looks at and can write nothing; the writer runs the whole API on its run
and nothing on another run. The command lists of :mod:`tracestore.acl` are
checked against what the sources send (lua/ and the client's commands).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from tests._dump import dump_run
from tests.test_ownership import prompt_of, response_of, write_turn
from tracestore import AsyncTraceStore, PermissionDenied, TraceStore, acl
from tracestore.replay import Group
from tracestore.scripts import registry

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"
RUN = "exp1"  # the run the grants in docs/security.md name
PASSWORD = "CHANGE-ME"


# -- the lists match the sources -------------------------------------------------------------------


def _lua_commands(readonly: bool | None) -> set[str]:
    out: set[str] = set()
    for sc in registry().values():
        if readonly is None or sc.readonly == readonly:
            out |= {c.lower() for c in re.findall(r"redis\.p?call\(\s*'(\w+)'", sc.source)}
    return out


def test_command_lists_match_what_the_sources_send() -> None:
    assert set(acl.LUA) == _lua_commands(None)
    # (the read scripts include helpers they do not call: the observer test shows the list suffices)
    assert set(acl.LUA_RO) <= _lua_commands(True)
    sent: set[str] = set()
    for path in (ROOT / "tracestore").rglob("*.py"):
        src = path.read_text(encoding="utf-8")
        for cmd, sub in re.findall(r'Cmd\(\s*\(\s*"([A-Z]+)"(?:,\s*"([A-Z]+)")?', src):
            name = cmd.lower()
            sent.add(f"{name}|{sub.lower()}" if name in ("xgroup", "xinfo", "memory", "cluster") else name)
    sent |= {"xreadgroup", "scan", "lrange", "xrange"}  # built outside a Cmd literal (ray.py, _io, checkpoint)
    assert sent - {"info", "ping", "cluster|shards"} <= set(acl.CLIENT), sent - set(acl.CLIENT)
    assert set(acl.commands("observer")) <= set(acl.commands("writer"))
    assert all(s.readonly for s in registry().values() if s.name in ("read_index", "gate_status", "session_states", "route_status"))


def _doc_lines() -> dict[str, str]:
    """The redis-cli grant lines of docs/security.md by role."""
    out = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"redis-cli .*ACL SETUSER (\S+) ", line)
        if m:
            out["observer" if "%R~" in line else "writer"] = line
    return out


def test_the_documented_grants_are_the_code_s() -> None:
    lines = _doc_lines()
    assert lines["writer"] == acl.grant_line(RUN, "writer", user=f"{RUN}-writer", password=PASSWORD)
    assert lines["observer"] == acl.grant_line(RUN, "observer", user=f"{RUN}-observer", password=PASSWORD)


# -- the grants, applied with redis-cli as documented ----------------------------------------------


def _nodes(url: str, admin: Any, cluster: bool) -> list[tuple[str, int]]:
    if not cluster:
        u = urlsplit(url.replace("+cluster", ""))
        return [(u.hostname or "127.0.0.1", int(u.port or 6379))]
    shards = admin.execute_command("CLUSTER", "SLOTS", target_nodes=admin.get_random_node())
    return sorted({(s[2][0].decode() if isinstance(s[2][0], bytes) else s[2][0], int(s[2][1])) for s in shards})


def _apply(url: str, store: TraceStore, role: str) -> None:
    """Run the documented line with redis-cli against every node (an ACL is per server)."""
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed")
    line = _doc_lines()[role]
    args = shlex.split(line)[1:]
    for host, port in _nodes(url, store.redis, store.cluster):
        out = subprocess.run([cli, "-h", host, "-p", str(port), *args], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "OK", out.stdout + out.stderr


def _as(url: str, role: str, **kw: Any) -> TraceStore:
    u = urlsplit(url)
    netloc = f"{RUN}-{role}:{PASSWORD}@{u.hostname}:{u.port}"
    return TraceStore.connect(u._replace(netloc=netloc).geturl(), run=RUN, create_run=False, **kw)


@pytest.fixture
def admin(url: str, backend: str) -> Any:
    if backend not in ("valkey", "cluster"):
        pytest.skip("runs on standalone and cluster (the ACL rules are the engine's)")
    st = TraceStore.connect(url, run=RUN)
    st.delete_run(force=True)  # the documented run id: start from nothing
    st = TraceStore.connect(url, run=RUN)
    yield st
    st.delete_run(force=True)
    st.close()


def _fill(st: TraceStore) -> str:
    st.open_sessions(["s1", "s2", "g.a", "g.b"], "rollout:0")
    write_turn(st, "s1")
    st.replay.put(Group("g", "math", ("g.a", "g.b"), payload={"r": 1}), "rollout:0")
    lease = st.gate.admit("s1", "w", 60)
    return lease.id


def test_observer_reads_everything_and_writes_nothing(url: str, admin: TraceStore, run_id: str, arun: Any) -> None:
    lease = _fill(admin)
    other = TraceStore.connect(url, run=run_id)  # another run on the server
    other.open_session("x", "w")
    _apply(url, admin, "observer")
    full = prompt_of("s1") + response_of("s1")
    with _as(url, "observer") as obs:
        before = dump_run(admin)
        assert obs.gate.status().live == 1
        assert obs.lookup("s1", full).text_len == len(full)
        assert obs.search("s1", full).segments
        assert obs.export_training_trace("s1", full).input_ids == [1, 2, 3, 4, 5, 6, 7]
        assert obs.replay.count("math") == 1 and obs.replay.stats("math")[0].groups == 1
        assert [g.gid for g in obs.replay.groups("math")] == ["g"]
        assert obs.sessions("rollout:0") == ["s1", "s2"] and "replay" in {o.owner for o in obs.owners()}
        assert obs.owner_of("g.a") == "replay" and obs.session_states(["s2"])["s2"] == ("rollout:0", "live")
        assert obs.gate.lease_records([lease])[0] is not None
        assert obs.router(["e1"]).table(["s1"]).routes == {"s1": None}
        assert obs.run_ids() == [RUN]  # the other runs are not the observer's to see
        assert [r.run for r in obs.list_runs()] == [RUN]
        assert obs.server_info().runs == (RUN,)
        for write in (
            lambda: obs.open_session("s3", "w"),
            lambda: obs.release(["s1"], "rollout:0"),
            lambda: obs.gate.admit("s1", "w", 5),
            lambda: obs.gate.settle(lease, "completed"),
            lambda: obs.gate.seal(),
            lambda: obs.replay.take("math", 1, owner="t"),
            lambda: obs.heartbeat("w", 5),
            lambda: obs.drop_session_data("s2"),
            lambda: obs.record_turn(
                "s2", "p", "r", prefix=obs.lookup("s2", "p"), delta_token_ids=[1], response_token_ids=[2],
                response_logprobs=[0.0], version=0,
            ),
        ):
            with pytest.raises(PermissionDenied):
                write()
        assert dump_run(admin) == before  # nothing written
        with pytest.raises(PermissionDenied):  # nor can it read another run
            TraceStore.connect(
                _as(url, "observer").url.replace("***", PASSWORD), run=run_id, create_run=False
            ).owner_of("x")
    with pytest.raises(PermissionDenied):  # connecting as a writer would create the run record
        TraceStore.connect(
            urlsplit(url)._replace(netloc=f"{RUN}-observer:{PASSWORD}@{urlsplit(url).netloc.split('@')[-1]}").geturl(),
            run=RUN,
        )

    async def main() -> None:
        u = urlsplit(url)
        st = await AsyncTraceStore.connect(
            u._replace(netloc=f"{RUN}-observer:{PASSWORD}@{u.netloc.split('@')[-1]}").geturl(),
            run=RUN, create_run=False,
        )
        try:
            assert (await st.gate.status()).live == 1
            assert (await st.export_training_trace("s1", full)).input_ids[-3:] == [5, 6, 7]
            with pytest.raises(PermissionDenied):
                await st.release(["s1"], "rollout:0")
        finally:
            await st.close()

    arun(main())
    other.close()


def test_writer_runs_the_api_on_its_run_only(url: str, admin: TraceStore, run_id: str, tmp_path: Path) -> None:
    from tracestore import ray as ts_ray

    _apply(url, admin, "writer")
    with _as(url, "writer") as w:
        lease = _fill(w)
        w.run(ts_ray.ensure_events_group(w.context, "holder", "c"))  # the RefHolder's consumer
        full = prompt_of("s1") + response_of("s1")
        assert w.export_training_trace("s1", full).input_ids == [1, 2, 3, 4, 5, 6, 7]
        w.gate.settle(lease, "completed")
        with w.gate.weight_update(1, drain_timeout_s=1):
            pass
        got = w.replay.take("math", 1, owner="train:0")
        assert [g.gid for g in got] == ["g"]
        w.replay.put(Group("h", "math", ("s2",), status="aborted", retryable=True), "rollout:0")
        assert [g.gid for g in w.replay.claim_retry("math", 1, "rollout:1")] == ["h"]
        w.replay.expire(5, 1)
        r = w.router(["e1", "e2"])
        assert r.acquire("s1") in ("e1", "e2") and r.retire(["s1"]) == ["s1"]
        w.heartbeat("rollout:0", 60)
        assert sorted(w.release_owner("train:0")) == ["g.a", "g.b"]
        assert w.release(["s1"], "rollout:0") == ["s1"]
        events = w.run(ts_ray.read_events(w.context, "holder", "c", ">", 10, 0.1))
        assert len(events) >= 3
        w.run(ts_ray.ack_events(w.context, "holder", [e[0] for e in events]))
        assert "holder" in w.run(ts_ray.events_groups(w.context))
        w.gc()
        w.checkpoint(tmp_path / "exp1.jsonl")
        assert [x.run for x in w.list_runs()] == [RUN]
        w.delete_run(force=True)
        w.restore(tmp_path / "exp1.jsonl")
        assert w.owner_of("s2") == "rollout:1"
    other = TraceStore.connect(url, run=run_id)
    other.open_session("x", "w")
    u = urlsplit(url)
    creds = u._replace(netloc=f"{RUN}-writer:{PASSWORD}@{u.netloc.split('@')[-1]}").geturl()
    with pytest.raises(PermissionDenied), TraceStore.connect(creds, run=run_id, create_run=False) as st:
        st.release(["x"], "w")
    assert other.owner_of("x") == "w"
    other.close()


def test_permission_denied_is_not_an_unknown_outcome(url: str, admin: TraceStore) -> None:
    _apply(url, admin, "observer")
    with _as(url, "observer") as obs, pytest.raises(PermissionDenied) as ei:
        obs.release(["s1"], "w", op_id="rel")
    assert "security.md" in str(ei.value)
    assert not isinstance(ei.value, redis.RedisError)


def test_cli_prints_the_documented_grant() -> None:
    from click.testing import CliRunner

    from tracestore.cli import main

    for role in acl.ROLES:
        r = CliRunner().invoke(main, ["acl", RUN, "--role", role])
        assert r.exit_code == 0, r.output
        assert r.output.strip() == _doc_lines()[role]
    r = CliRunner().invoke(main, ["acl", "bad run"])
    assert r.exit_code == 2 and "invalid run id" in r.output  # a usage error
