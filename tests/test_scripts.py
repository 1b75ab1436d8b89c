"""Script runtime: contracts, NOSCRIPT recovery, slot routing, chunking (real servers)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import connect_async
from tracestore import ScriptError, TraceStore
from tracestore.keys import key_slot
from tracestore.scripts import Batch, Cmd, Eval, chunks, lua_dir, parse_script, registry, script

ROOT = Path(__file__).resolve().parent.parent


def _flush_all(store: TraceStore) -> None:
    r: Any = store.redis
    if store.cluster:
        for node in r.get_primaries():
            r.get_redis_connection(node).script_flush()
    else:
        r.script_flush()


def test_every_script_has_a_valid_contract() -> None:
    reg = registry()
    files = sorted(p.stem for p in lua_dir().glob("*.lua"))
    assert sorted(reg) == files and files
    for name, sc in reg.items():
        assert sc.name == name
        assert re.search(r"^-- KEYS\[1\]|^-- KEYS: 0", sc.source, re.M), f"{name}: KEYS lines"
        assert re.search(r"^-- returns:", sc.source, re.M), f"{name}: returns line"
        assert re.search(r"^-- errors:", sc.source, re.M), f"{name}: errors line"
        # Keys only through KEYS: no key names built inside a script.
        body = "\n".join(ln for ln in sc.source.splitlines() if not ln.lstrip().startswith("--"))
        assert "ts:{" not in body, f"{name} builds a key name inside Lua"


def test_every_lua_helper_is_defined_before_use_and_takes_few_arguments() -> None:
    """A script calling a _lib helper includes its library, and before any helper that calls it
    (a Lua local is captured where it is defined: defined later, the call would find nil).
    No helper takes more than six positional arguments (pass a table instead)."""
    lib = lua_dir() / "_lib"
    owner: dict[str, str] = {}
    for path in sorted(lib.glob("*.lua")):
        for m in re.finditer(r"^local function (\w+)\((.*)\)", path.read_text(), re.M):
            owner[m.group(1)] = path.stem
            nargs = len([a for a in m.group(2).split(",") if a.strip()])
            assert nargs <= 6, f"_lib/{path.stem}.lua: {m.group(1)} takes {nargs} positional arguments"
    assert owner["now_ms"] == "clock" and owner["op_replay"] == "op"
    for name, sc in registry().items():
        text = sc.source
        for fn, lib_name in owner.items():
            calls = [m.start() for m in re.finditer(rf"(?<![\w.]){fn}\(", text)]
            defined = text.find(f"local function {fn}(")
            uses = [c for c in calls if c != defined + len("local function ")]
            if uses:
                assert f"-- begin include {lib_name}\n" in text, f"{name} calls {fn} without -- include: {lib_name}"
                assert defined < min(uses), f"{name}: {fn} is used before _lib/{lib_name}.lua defines it"


def test_every_releasing_script_writes_what_it_queued_and_counted() -> None:
    """sessions_release queues hash deletions, owner-set removals and tombstones: a
    script that releases (directly or through the replay helpers) must flush both, once its
    checks are done; a script that counts must write its counters."""
    releasing = {"sessions_release(", "rb_expire_group("}
    for name, sc in registry().items():
        body = sc.source.split("-- end include rb\n")[-1].split("-- end include sessions\n")[-1]
        if any(fn in body for fn in releasing):
            assert "sessions_release_flush(" in body, f"{name} releases without sessions_release_flush"
            assert "stats_flush(" in body, f"{name} releases without stats_flush"
        if "stats_add(" in body:
            assert "stats_flush(" in body, f"{name} counts without stats_flush"


def test_every_script_is_used_by_python() -> None:
    sources = "\n".join(p.read_text() for p in (ROOT / "tracestore").rglob("*.py"))
    for name in registry():
        assert f'"{name}"' in sources, f"lua/{name}.lua is not called from tracestore/"


def test_contract_header_is_enforced() -> None:
    with pytest.raises(ScriptError, match="KEYS"):
        parse_script("x", "-- script: x\nreturn {0}")
    with pytest.raises(ScriptError, match="script: <file name>"):
        parse_script("x", "-- script: y\n-- KEYS: 1\nreturn {0}")
    sc = parse_script("x", "-- script: x\n-- KEYS: 2\nreturn {0}")
    assert (sc.nkeys, sc.variadic, sc.readonly) == (2, False, False)
    with pytest.raises(ScriptError, match="called with 1 KEYS, contract declares 2"):
        Eval(sc, ("ts:{r}:a",))
    v = parse_script("v", "#!lua flags=no-writes\n-- script: v\n-- KEYS: 1+\n-- CHUNK: 10\nreturn {0}")
    assert (v.nkeys, v.variadic, v.chunk, v.readonly) == (1, True, 10, True)
    Eval(v, ("ts:{r}:a", "ts:{r}:b", "ts:{r}:c"))
    with pytest.raises(ScriptError, match="0 KEYS"):
        Eval(v, ())


def test_keys_of_one_call_must_share_a_slot() -> None:
    sc = script("session_states")
    with pytest.raises(ScriptError, match="hash slots"):
        Eval(sc, ("ts:{r}:s:a", "ts:{other}:s:b"))


def test_noscript_recovery(store: TraceStore) -> None:
    store.open_session("a", "rollout:0")
    assert store.owner_of("a") == "rollout:0"
    _flush_all(store)
    assert store.owner_of("a") == "rollout:0"  # EVALSHA -> NOSCRIPT -> EVAL
    _flush_all(store)
    # the pipelined path recovers too
    states = store.session_states([f"s{i}" for i in range(50)] + ["a"])
    assert states["a"] == ("rollout:0", "live")


def test_noscript_recovery_async(url: str, run_id: str, arun: Any) -> None:
    async def go() -> tuple[Any, Any]:
        st = await connect_async(url, run_id)
        try:
            await st.open_session("a", "rollout:0")
            r: Any = st.redis
            if st.cluster:
                for node in r.get_primaries():
                    await r.execute_command("SCRIPT", "FLUSH", target_nodes=node)
            else:
                await r.script_flush()
            first = await st.owner_of("a")
            second = await st.session_states(["a", "zz"])
            return first, second
        finally:
            await st.close()

    first, second = arun(go())
    assert first == "rollout:0"
    assert second == {"a": ("rollout:0", "live"), "zz": None}


def test_variadic_20000_items_are_chunked(store: TraceStore) -> None:
    sids = [f"s{i}" for i in range(20_000)]
    for sid in sids[::2500]:
        store.open_session(sid, "producer")
    calls = len(list(chunks(sids, script("session_states").chunk)))
    assert calls == 5  # below Lua's unpack limit per call
    states = store.session_states(sids)
    assert len(states) == 20_000
    opened = {s for s, st in states.items() if st is not None}
    assert opened == set(sids[::2500])
    assert all(states[s] == ("producer", "live") for s in opened)


def test_batch_groups_across_slots(store: TraceStore) -> None:
    # One purge per session: the data keys of different sessions live in
    # different slots (and on different nodes of a cluster). The slots depend on
    # the run id, which is random: pick ids until 300 distinct slots are hit, so
    # the precondition holds for every run id (taking p0..p299 fell short ~1%).
    sids: list[str] = []
    slots: set[int] = set()
    for i in itertools.count():
        slot = key_slot(store.keys.idx(f"p{i}"))
        if slot not in slots:
            slots.add(slot)
            sids.append(f"p{i}")
            if len(sids) == 300:
                break
    for s in sids[:5]:
        store.redis.hset(store.keys.idx(s), "x", "1")
    assert store.drop_sessions_data(sids) == 5
    assert all(store.redis.exists(store.keys.dead(s)) for s in sids[:10])
    assert not any(store.redis.exists(store.keys.idx(s)) for s in sids[:5])


def test_batch_keeps_the_order_of_requests_of_one_slot(url: str, run_id: str, arun: Any) -> None:
    """Sync and asyncio, standalone and cluster: a Batch runs one slot's requests in order
    (a purge's tombstone must land before its UNLINK), whatever it does across slots."""
    keys = [f"ts:{{{run_id}/order-{j}}}:list" for j in range(8)]  # 8 slots, spread over nodes
    batch = Batch(tuple(Cmd(("RPUSH", keys[i % 8], i), key=keys[i % 8]) for i in range(400)))
    want = [[str(i) for i in range(j, 400, 8)] for j in range(8)]

    async def go() -> list[Any]:
        st = await connect_async(url, run_id)
        try:
            await st.execute(batch)
            got = [await st.redis.lrange(k, 0, -1) for k in keys]
            for k in keys:
                await st.redis.delete(k)
            return got
        finally:
            await st.close()

    dec = lambda xs: [x.decode() if isinstance(x, bytes) else x for x in xs]  # noqa: E731
    assert [dec(x) for x in arun(go())] == want
    sync = TraceStore.connect(url, run=run_id)
    try:
        sync.execute(batch)
        assert [dec(sync.redis.lrange(k, 0, -1)) for k in keys] == want
    finally:
        sync.close()


def test_lua_runtime_error_becomes_script_error(store: TraceStore) -> None:
    bad = parse_script("boom", "-- script: boom\n-- KEYS: 1\nreturn {0, redis.call('INCR', KEYS[1])}")
    key = store.keys.meta  # a hash: INCR fails with WRONGTYPE inside the script
    with pytest.raises(ScriptError) as exc:
        store.execute(Eval(bad, (key,)))
    assert exc.value.script == "boom"
    with pytest.raises(ScriptError, match="boom"):
        store.execute(Batch((Eval(bad, (key,)),)))


def test_cluster_refuses_cross_slot_raw_but_runtime_never_sends_it(cluster_url: str, run_id: str) -> None:
    from redis.exceptions import RedisClusterException, ResponseError

    st = TraceStore.connect(cluster_url, run=run_id)
    try:
        sc = script("session_states")
        raw: Any = st.redis
        with pytest.raises((RedisClusterException, ResponseError)):
            raw.eval(sc.source, 2, st.keys.session("a"), st.keys.idx("a"))
        with pytest.raises(ScriptError, match="hash slots"):
            Eval(sc, (st.keys.session("a"), st.keys.idx("a")))
    finally:
        st.close()
