"""Durability levels (issue 11 item 1): WAIT/WAITAOF after every mutating script.

Real primaries and replicas: a standalone primary with one replica, a
3+3 cluster, a server with its AOF on. A replica is made to miss writes by
freezing it (SIGSTOP) and dropping its link on the primary
(``CLIENT KILL TYPE replica``); the wait then cannot be satisfied. Exact
counts of WAIT/WAITAOF come from the servers' ``INFO commandstats``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests._netcut import CutProxy
from tests.conftest import connect_async
from tracestore import (
    AsyncTraceStore,
    ConfigError,
    DurabilityUnconfirmed,
    OutcomeUnknown,
    TraceStore,
)
from tracestore.durability import Durability
from tracestore.keys import Keys
from tracestore.replay import Group
from tracestore.scripts import Batch, Eval, script
from tracestore.servers import EmbeddedServer, LocalCluster, redis_server_binary

SYNC = ["--repl-diskless-sync-delay", "0"]


def _online(primary: EmbeddedServer, n: int = 1, timeout_s: float = 30) -> None:
    """Wait until ``primary`` has ``n`` replicas in sync (WAIT can succeed)."""
    c = primary.client()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            info = c.info("replication")
            states = [v.get("state") for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if states.count("online") >= n:
                return
            assert time.monotonic() < deadline, info
            time.sleep(0.02)
    finally:
        c.close()


@pytest.fixture
def pair() -> Iterator[tuple[EmbeddedServer, EmbeddedServer]]:
    """A standalone primary and its replica, in sync."""
    primary = EmbeddedServer(extra_args=SYNC).start()
    replica = EmbeddedServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    try:
        _online(primary)
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def _cut(primary: EmbeddedServer, replica: EmbeddedServer) -> None:
    """Freeze the replica and drop its link: later writes reach no replica."""
    replica.pause()
    c = primary.client()
    c.execute_command("CLIENT", "KILL", "TYPE", "replica")
    c.close()


def _calls(server: EmbeddedServer, command: str) -> int:
    """How many times ``server`` ran ``command`` (INFO commandstats)."""
    c = server.client()
    try:
        return int(c.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))
    finally:
        c.close()


def _run() -> str:
    return f"d-{uuid.uuid4().hex[:10]}"


#: The wait of a call that must be confirmed: long, so a busy machine's slow replica acknowledgement
#: is never taken for a missing one. Calls meant to fail use a store with SHORT (each costs it).
PATIENT_S = 10.0
SHORT_S = 0.2


# -- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"durability": "strong"}, "not a durability level"),
        ({"durability": "replicas", "durability_replicas": 0}, "durability_replicas"),
        ({"durability": "replicas", "durability_replicas": 17}, "durability_replicas"),
        ({"durability": "replicas", "durability_replicas": True}, "durability_replicas"),
        ({"durability": "aof", "durability_timeout_s": 0}, "durability_timeout_s"),
        ({"durability": "aof", "durability_timeout_s": math.nan}, "durability_timeout_s"),
        ({"durability": "aof", "durability_timeout_s": math.inf}, "durability_timeout_s"),
        ({"durability": "aof", "durability_timeout_s": 61}, "durability_timeout_s"),
        ({"durability": "aof", "durability_timeout_s": "1"}, "durability_timeout_s"),
    ],
)
def test_bad_levels_are_config_errors_before_any_io(opts: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TraceStore.connect("redis://127.0.0.1:1", run="r", **opts)  # nothing listens there


def test_the_default_level_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, standalone_url: str
) -> None:
    monkeypatch.setenv("TRACESTORE_DURABILITY", "aof")
    assert Durability.from_options({}).level == "aof"
    assert Durability.from_options({"durability": "none"}).level == "none"
    with pytest.raises(ConfigError, match="append-only"):  # the server has no AOF
        TraceStore.connect(standalone_url, run=_run())
    monkeypatch.setenv("TRACESTORE_DURABILITY", "weak")
    with pytest.raises(ConfigError, match="'weak' is not a durability level"):
        TraceStore.connect(standalone_url, run=_run())


def test_replicas_and_timeout_come_from_the_environment_too(
    monkeypatch: pytest.MonkeyPatch, pair: tuple[EmbeddedServer, EmbeddedServer]
) -> None:
    """What a launcher exports (``tracestore train --durability-replicas``) reaches ``connect``."""
    primary, _ = pair
    monkeypatch.setenv("TRACESTORE_DURABILITY", "replicas")
    monkeypatch.setenv("TRACESTORE_DURABILITY_REPLICAS", "2")
    monkeypatch.setenv("TRACESTORE_DURABILITY_TIMEOUT_S", "2.5")
    assert Durability.from_options({}) == Durability("replicas", 2, 2.5)
    assert Durability.from_options({"durability_replicas": 1}) == Durability("replicas", 1, 2.5)
    with pytest.raises(ConfigError, match=r"needs 2 replica\(s\) .* has 1"):  # the pair has one
        TraceStore.connect(primary.url, run=_run())
    monkeypatch.setenv("TRACESTORE_DURABILITY_REPLICAS", "1")
    with TraceStore.connect(primary.url, run=_run()) as st:
        assert st.durability == Durability("replicas", 1, 2.5)
    monkeypatch.setenv("TRACESTORE_DURABILITY_REPLICAS", "two")
    with pytest.raises(ConfigError, match=r"\$TRACESTORE_DURABILITY_REPLICAS='two' is not an integer"):
        Durability.from_options({})
    monkeypatch.setenv("TRACESTORE_DURABILITY_REPLICAS", "1")
    monkeypatch.setenv("TRACESTORE_DURABILITY_TIMEOUT_S", "0")
    with pytest.raises(ConfigError, match=r"durability_timeout_s must be a number of seconds in \(0, 60\]"):
        Durability.from_options({})


def test_connect_refuses_a_level_the_server_cannot_give(
    standalone_url: str, pair: tuple[EmbeddedServer, EmbeddedServer], arun: Any
) -> None:
    with pytest.raises(ConfigError, match=r"needs 1 replica\(s\) per primary, but .* has 0"):
        TraceStore.connect(standalone_url, run=_run(), durability="replicas")
    primary, _ = pair
    with pytest.raises(ConfigError, match="append-only file .* appendonly"):
        TraceStore.connect(primary.url, run=_run(), durability="replicas+aof")
    with pytest.raises(ConfigError, match=r"needs 2 replica\(s\) .* has 1"):
        TraceStore.connect(primary.url, run=_run(), durability="replicas", durability_replicas=2)
    with pytest.raises(ConfigError, match="append-only"):
        arun(connect_async(primary.url, _run(), durability="aof"))
    run = _run()
    with TraceStore.connect(primary.url, run=run, durability="replicas") as st:
        assert st.durability == Durability("replicas", 1, 1.0)
    c = primary.client()
    assert c.exists(Keys("ts", run).meta) == 1  # the refused connects wrote nothing: only this run
    c.close()


def test_aof_needs_waitaof_which_redis_7_0_lacks() -> None:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("Debian redis-server is not installed")
    with EmbeddedServer(binary=binary, extra_args=["--appendonly", "yes"]) as srv:
        version = srv.client().info("server")["redis_version"]
        if tuple(int(x) for x in str(version).split(".")[:2]) >= (7, 2):
            pytest.skip(f"redis-server {version} has WAITAOF")
        with pytest.raises(ConfigError, match="no WAITAOF"):
            TraceStore.connect(srv.url, run=_run(), durability="aof")


# -- standalone primary + replica ------------------------------------------------------------


def _exercise(st: TraceStore, tag: str) -> None:
    """One of every kind of mutating call (each must be confirmed)."""
    sids = [f"{tag}{i}" for i in range(6)]
    st.open_session(sids[0], "prod")
    st.open_sessions(sids[1:], "prod")
    m = st.lookup(sids[0], "hello")
    st.record_turn(
        sids[0], "hello", " world", prefix=m, delta_token_ids=[1, 2], response_token_ids=[3],
        response_logprobs=[-0.5], version=0,
    )
    st.transfer(sids[4:], "prod", "other")
    st.replay.put(Group(f"{tag}g", "t", tuple(sids[1:3])), "prod")
    taken = st.replay.take("t", 1, owner="learner")
    assert [g.gid for g in taken] == [f"{tag}g"]
    lease = st.gate.admit(sids[0], "worker", 30)
    st.gate.settle(lease, "completed")
    st.heartbeat("prod", 30)
    assert sorted(st.release([sids[0], sids[3]], "prod")) == [sids[0], sids[3]]
    assert sorted(st.release_owner("learner")) == sorted(sids[1:3])


def test_every_mutating_call_waits_once_and_reads_never(pair: tuple[EmbeddedServer, EmbeddedServer]) -> None:
    primary, replica = pair
    run = _run()
    with TraceStore.connect(primary.url, run=run, durability="replicas", durability_timeout_s=PATIENT_S) as st:
        # the first call of a script on a server also loads it (NOSCRIPT, then EVAL and a second wait)
        st.open_session("warm", "prod")
        st.open_sessions(["warm2"], "prod")
        waits, evals = _calls(primary, "wait"), _calls(primary, "evalsha") + _calls(primary, "eval")
        st.open_session("a", "prod")
        assert _calls(primary, "wait") == waits + 1
        # confirmed means the replica has it when the call returns
        rc = replica.client()
        assert rc.hget(st.keys.session("a"), "owner") == b"prod"
        # a batch of one node: its scripts, then one WAIT (3 chunks of open_sessions)
        before = _calls(primary, "wait")
        assert st.open_sessions([f"b{i}" for i in range(9000)], "prod") == 9000
        assert _calls(primary, "wait") == before + 1
        assert rc.exists(st.keys.session("b8999")) == 1
        # reads (read-only scripts, plain commands) get no wait
        before = _calls(primary, "wait")
        st.owner_of("a")
        st.gate.status()
        st.lookup("a", "x")
        st.sessions("prod")
        st.replay.count()
        assert _calls(primary, "wait") == before
        _exercise(st, "x")
        rc.close()
        assert _calls(primary, "evalsha") + _calls(primary, "eval") > evals


def test_unconfirmed_writes_raise_with_their_op_id(pair: tuple[EmbeddedServer, EmbeddedServer]) -> None:
    primary, replica = pair
    run = _run()
    ok = TraceStore.connect(primary.url, run=run, durability="replicas", durability_timeout_s=PATIENT_S)
    st = TraceStore.connect(primary.url, run=run, durability="replicas", durability_timeout_s=SHORT_S)
    try:
        ok.open_sessions(["a", "b", "c"], "prod")
        _cut(primary, replica)
        with pytest.raises(DurabilityUnconfirmed) as err:
            st.open_session("d", "prod")
        e = err.value
        assert isinstance(e, OutcomeUnknown) and e.op_id and e.script == "open_session"
        assert e.level == "replicas" and "0 of 1 replica(s)" in e.detail and str(primary.port) in e.node
        assert e.op_id in str(e)
        with pytest.raises(DurabilityUnconfirmed) as err:
            st.release(["a"], "prod")  # the batch path
        assert err.value.script == "release"
        with pytest.raises(DurabilityUnconfirmed):
            st.gate.admit("b", "worker", 30)
        m = st.lookup("c", "hi")  # reads still answer at once
        with pytest.raises(DurabilityUnconfirmed):
            st.record_turn(
                "c", "hi", "!", prefix=m, delta_token_ids=[1], response_token_ids=[2],
                response_logprobs=[-1.0], version=0,
            )
        assert st.owner_of("d") == "prod"  # it ran on the primary: the outcome is unknown, not "failed"
        ran = False
        with pytest.raises(DurabilityUnconfirmed):  # the seal is not confirmed: the body never runs
            with st.gate.weight_update(5, drain_timeout_s=0.5):
                ran = True
        assert not ran and st.gate.status().state == "open"  # and the seal was undone
        # a refusal is not an unconfirmed write: nothing was written
        with pytest.raises(Exception, match="already open"):
            st.open_session("b", "prod")
        replica.resume()
        _online(primary)
        ok.open_session("e", "prod")  # confirmed again once the replica is back
    finally:
        replica.resume()
        st.close()
        ok.close()


def test_a_replayed_reply_waits_for_the_first_write(pair: tuple[EmbeddedServer, EmbeddedServer]) -> None:
    """The reply of the first attempt is lost; the retry, on a new connection, replays it by op id.

    The replica is frozen but still connected, so a WAIT on a connection
    that wrote nothing would count it at once (it acknowledged every
    earlier offset). The replay rewrites its op record, so the WAIT covers
    the first attempt's write and cannot be satisfied.
    """
    primary, replica = pair
    run = _run()
    with TraceStore.connect(primary.url, run=run, durability="replicas", durability_timeout_s=PATIENT_S) as ok:
        ok.open_session("warm", "prod")  # loads the scripts while the replica acknowledges
    with CutProxy("127.0.0.1", primary.port) as proxy:
        st = TraceStore.connect(proxy.url, run=run, durability="replicas", durability_timeout_s=SHORT_S)
        try:
            replica.pause()  # connected, acknowledges nothing new
            proxy.arm()  # drop the reply of the script (the first reply of the exchange)
            with pytest.raises(DurabilityUnconfirmed):
                st.open_session("a", "prod")
            assert proxy.cuts == 1
        finally:
            replica.resume()
            st.close()


def test_async_store_waits_and_raises_the_same(pair: tuple[EmbeddedServer, EmbeddedServer], arun: Any) -> None:
    primary, replica = pair

    async def main() -> None:
        run = _run()
        ok: AsyncTraceStore = await connect_async(
            primary.url, run, durability="replicas", durability_timeout_s=PATIENT_S
        )
        st: AsyncTraceStore = await connect_async(
            primary.url, run, durability="replicas", durability_timeout_s=SHORT_S
        )
        try:
            await ok.open_sessions(["w"], "prod")  # loads the scripts (the first call waits twice)
            await ok.release(["w"], "prod")
            before = _calls(primary, "wait")
            await ok.open_sessions(["a", "b"], "prod")
            assert await ok.release(["a"], "prod") == ["a"]
            assert _calls(primary, "wait") == before + 2
            _cut(primary, replica)
            with pytest.raises(DurabilityUnconfirmed) as err:
                await st.release(["b"], "prod")
            assert err.value.op_id
            await st.gate.status()  # a read: no wait, no error
        finally:
            replica.resume()
            await st.close()
            await ok.close()

    arun(main())


def test_aof_level_waits_for_the_fsync() -> None:
    with EmbeddedServer(extra_args=["--appendonly", "yes", "--appendfsync", "everysec"]) as srv:
        with TraceStore.connect(srv.url, run=_run(), durability="aof") as st:
            before = _calls(srv, "waitaof")
            _exercise(st, "y")
            assert _calls(srv, "waitaof") > before
            assert _calls(srv, "wait") == 0


# -- cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated_cluster() -> Iterator[LocalCluster]:
    """3 primaries, 1 replica each, AOF on (every level can be given)."""
    c = LocalCluster(primaries=3, replicas=1, extra_args=["--appendonly", "yes"]).start()
    yield c
    c.stop()


def test_cluster_batches_wait_once_per_node(replicated_cluster: LocalCluster) -> None:
    cl = replicated_cluster
    primaries = [p for _, p, _ in cl.shards()]
    with TraceStore.connect(cl.url, run=_run(), durability="replicas+aof", durability_timeout_s=PATIENT_S) as st:
        _exercise(st, "z")
        # a batch whose scripts land on every primary: one WAIT and one WAITAOF per node
        runs = [Keys("ts", f"n{i}") for i in range(30)]
        by_node = {p.port: 0 for p in primaries}
        for k in runs:
            by_node[cl.primary_of(k.meta).port] += 1
        assert all(by_node.values())
        batch = Batch(tuple(Eval(script("init_run"), (k.meta,), ("1", "{}")) for k in runs))
        st.execute(batch)  # loads init_run on every node (NOSCRIPT, then EVAL: a second wait)
        waits = {p.port: (_calls(p, "wait"), _calls(p, "waitaof")) for p in primaries}
        st.execute(batch)
        for p in primaries:
            assert (_calls(p, "wait"), _calls(p, "waitaof")) == (
                waits[p.port][0] + 1, waits[p.port][1] + 1,
            )


def test_cluster_a_cut_replica_fails_only_its_shard(replicated_cluster: LocalCluster, arun: Any) -> None:
    cl = replicated_cluster
    run = _run()
    ok = TraceStore.connect(cl.url, run=run, durability="replicas", durability_timeout_s=PATIENT_S)
    st = TraceStore.connect(cl.url, run=run, durability="replicas", durability_timeout_s=SHORT_S)
    primary = cl.primary_of(st.keys.meta)
    # a session whose data lives on another shard
    sid = next(f"s{i}" for i in range(100) if cl.primary_of(st.keys.idx(f"s{i}")) is not primary)
    ok.open_sessions([sid, "other"], "prod")
    replica = cl.cut_replica(primary)
    try:
        with pytest.raises(DurabilityUnconfirmed):
            st.open_session("x", "prod")
        m = ok.lookup(sid, "hi")
        ok.record_turn(  # the data plane of another shard is still confirmed
            sid, "hi", "!", prefix=m, delta_token_ids=[1], response_token_ids=[2],
            response_logprobs=[-1.0], version=0,
        )

        async def main() -> None:
            a = await AsyncTraceStore.connect(cl.url, run=run, durability="replicas", durability_timeout_s=SHORT_S)
            b = await AsyncTraceStore.connect(cl.url, run=run, durability="replicas", durability_timeout_s=PATIENT_S)
            try:
                with pytest.raises(DurabilityUnconfirmed):
                    await a.release(["other"], "prod")
                m = await b.lookup(sid, "hi!")
                await b.record_turn(
                    sid, "hi!", "?", prefix=m, delta_token_ids=[], response_token_ids=[3],
                    response_logprobs=[-1.0], version=0,
                )
            finally:
                await a.close()
                await b.close()

        arun(main())
    finally:
        replica.resume()
        st.close()
        ok.close()
    cl.wait_replicas_online()
