"""What a gateway keeps per session and per turn takes fixed memory (issue 28: memory per idle session).

A gateway remembers per session that it opened it and which engine it last
ran on; both were LRU dicts (~185 bytes a session each, up to 200,000
sessions). :class:`~tracestore.gateway.sidtable.SidTable` is a fixed-size
set-associative table of digests. The unit tests pin its semantics (a full set
forgets its oldest session; values; discard) and its memory; the gateway
test runs real turns through a gateway in front of two engine URLs and checks
that the route hint is where the router placed each session. The latency
samples a gateway keeps for its reports (``Recent``) are rings of C doubles.
"""

from __future__ import annotations

import tracemalloc
import uuid
from collections import OrderedDict
from collections.abc import Iterator

import openai
import pytest

from tests._gateway import CliServer
from tracestore import TraceStore
from tracestore.gateway import GATEWAY, GatewayConfig, start_gateway
from tracestore.gateway.sidtable import SLOTS, WAYS, SidTable


def _in_one_set(table: SidTable, n: int) -> list[str]:
    """``n`` session ids whose digests pick the same set of ``table``."""
    by_set: dict[int, list[str]] = {}
    while True:
        sid = f"s-{uuid.uuid4().hex[:8]}"
        group = by_set.setdefault(table._digest(sid) & table._mask, [])
        group.append(sid)
        if len(group) == n:
            return group


def test_membership_values_discard_and_a_full_set_forgets_its_oldest() -> None:
    t = SidTable(slots=1024, values=True)
    assert "a" not in t and t.get("a") is None and 3 not in t
    t.put("a", 7)
    t.add("b")
    assert "a" in t and "b" in t and t.get("a") == 7
    t.put("a", 9)  # a known session keeps its slot, with the new value
    assert t.get("a") == 9 and "b" in t
    t.discard("a")
    assert "a" not in t and t.get("a") is None and "b" in t
    t.discard("never")  # nothing
    four = SidTable(slots=WAYS, values=True)  # one set
    sids = _in_one_set(four, WAYS + 1)
    for i, sid in enumerate(sids[:WAYS]):
        four.put(sid, i)
    for _ in range(3):  # sessions in use at once in one set do not forget each other
        for i, sid in enumerate(sids[:WAYS]):
            assert four.get(sid) == i
            four.add(sid)
    four.put(sids[WAYS], 99)  # a fifth: the oldest goes, the others keep their values
    assert sids[0] not in four and four.get(sids[WAYS]) == 99
    assert [four.get(sid) for sid in sids[1:WAYS]] == list(range(1, WAYS))
    with pytest.raises(TypeError, match="values=True"):
        SidTable(slots=WAYS).put("x", 1)
    with pytest.raises(ValueError, match="power of two"):
        SidTable(slots=1000)
    with pytest.raises(ValueError, match="at least"):
        SidTable(slots=2)


def test_sessions_in_use_keep_their_slots_until_they_are_many() -> None:
    """10,000 sessions in use at once, each seen again after the others (the turns of a run):
    at most a few are forgotten (a set of 65,536 overflows with p ~6e-7; direct-mapped, ~2%
    were, and forgot each other every turn); at 200,000, the
    bound of the LRU dicts this replaced, most are still known."""
    for n, least in ((10_000, 0.999), (200_000, 0.85)):
        table = SidTable()
        sids = [f"agent-{uuid.uuid4().hex}" for _ in range(n)]
        for sid in sids:
            table.add(sid)
        kept = sum(sid in table for sid in sids)
        assert kept >= least * n, (n, kept)


def test_its_memory_does_not_grow_with_the_sessions_an_lru_dict_did() -> None:
    sids = [f"agent-{uuid.uuid4().hex}" for _ in range(50_000)]
    tracemalloc.start()
    try:
        table = SidTable(values=True)
        base = tracemalloc.get_traced_memory()[0]
        for i, sid in enumerate(sids):
            table.put(sid, i % 4)
        grown = tracemalloc.get_traced_memory()[0] - base
        lru: OrderedDict[str, None] = OrderedDict()
        base = tracemalloc.get_traced_memory()[0]
        for sid in sids:
            lru[sid] = None
        lru_grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert table.nbytes == SLOTS * 10
    assert grown < 4096, grown  # nothing per session (the ids are the caller's)
    assert lru_grown > 50_000 * 40, lru_grown  # what the dict took for the same ids
    kept = sum(sid in table for sid in sids)
    assert kept > 0.99 * len(sids), kept  # 50k sessions in 65,536 sets of 4: ~0.1% of sets overflow


@pytest.fixture(scope="module")
def engine() -> Iterator[CliServer]:
    e = CliServer("engine", "--port", "0", "--seed", "5").start()
    yield e
    e.stop()


@pytest.mark.backends("valkey")
def test_the_route_hint_is_where_the_router_placed_each_session(url: str, run_id: str, engine: CliServer) -> None:
    # the same engine process under two names: the router places sessions on both
    port = engine.url.rsplit(":", 1)[1]
    names = (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
    server = start_gateway(GatewayConfig(engines=names, url=url, run=run_id))
    try:
        services = server.app[GATEWAY].services
        assert services.routes is not None and services.route_hint("nobody") is None
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        sids = [f"h-{i}-{uuid.uuid4().hex[:6]}" for i in range(8)]
        for sid in sids:
            client.chat.completions.create(
                model="tracestore-reference", messages=[{"role": "user", "content": "reach 7 from 3"}],
                max_tokens=4, extra_body={"session_id": sid},
            )
        store = TraceStore.connect(url, run=run_id)
        try:
            placed = store.router(list(names)).table(sids).routes
        finally:
            store.close()
        assert {services.route_hint(sid) for sid in sids} <= set(names)
        assert {sid: services.route_hint(sid) for sid in sids} == placed
        assert all(sid in services.opened for sid in sids)
    finally:
        server.stop()


def test_recent_keeps_the_last_samples_in_a_ring_of_fixed_size() -> None:
    from tracestore.gateway.metrics import Recent

    r = Recent(keep=4)
    assert r.pct("total", 0.5) is None
    for x in (9.0, 8.0, 7.0, 6.0, 1.0, 2.0):  # the 9 and the 8 go: 7 6 1 2 are kept
        r.add("total", x)
    assert r.pct("total", 0.0) == 1.0 and r.pct("total", 0.99) == 7.0 and r.pct("total", 0.5) == 6.0
    with pytest.raises(ValueError, match="positive"):
        Recent(keep=0)
    big = Recent()
    tracemalloc.start()
    try:
        for i in range(20_000):  # past keep: the ring is full, a sample takes its slot
            big.add("total", i * 1e-6)
        base = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            big.add("total", i * 1e-6)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 1024, grown
    assert big.pct("total", 0.0) == 10_000 * 1e-6  # the last 10,000 of 0..19,999
