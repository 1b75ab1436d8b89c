"""A hypothesis fuzz of the public API (issue 11 item 7): typed errors, and nothing written on refusal.

Each example makes a few calls of the sync store's public methods (store,
gate, replay buffer, router, checkpoint) with arguments drawn from small
pools of valid values mixed with junk: wrong types, NaN and infinities,
``10**400``, ids with braces or whitespace, a string where a list belongs,
unknown op ids. A call must either succeed or raise a
:class:`~tracestore.TracestoreError` (never TypeError, ValueError,
OverflowError, KeyError...), and when it raises, every key of the run must
be byte-identical (DUMP) before and after.

``make test`` runs the fixed-seed profile (``TRACESTORE_FUZZ=ci``, on
standalone and cluster); ``make fuzz`` runs the long one
(``TRACESTORE_FUZZ=long``) and writes the counts to ``fuzz-report.json``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._dump import dump_run
from tracestore import ConfigError, InvalidId, PrefixMatch, Segment, TraceStore, TracestoreError
from tracestore.errors import OutcomeUnknown
from tracestore.gate import OUTCOMES, Lease
from tracestore.replay import Group

settings.register_profile(
    "ci",
    max_examples=120,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("TRACESTORE_FUZZ_EXAMPLES", "3000")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROFILE = os.environ.get("TRACESTORE_FUZZ", "ci")

# -- argument pools: valid values the calls can succeed with, and junk ----------------------------

JUNK: list[Any] = [
    None, True, False, 0, -1, 2**53, 2**64, 10**400, -(10**400), 1.5, -0.0,
    math.nan, math.inf, -math.inf, "", " ", "a b", "{x}", "x}", "é", "\x00", "x" * 300,
    b"bytes", [], ["s0", 3], {"a": 1}, ("s0",), {"s0"}, object(),
]
SIDS = ["s0", "s1", "s2", "s3"]
OWNERS = ["w0", "w1", "replay", "train:0"]
TASKS = ["math", "code"]
GIDS = ["g0", "g1", "g2"]
OP_IDS = [None, None, "op-1", "op-2", "op#3", ""]
TEXTS = ["", "p", "pr", "prompt", "prompt+more", "é✓", "\ud800"]


def junk() -> st.SearchStrategy[Any]:
    return st.sampled_from(JUNK)


def pick(pool: list[Any], *, junk_weight: int = 1) -> st.SearchStrategy[Any]:
    """A value of ``pool`` mostly, junk sometimes."""
    return st.one_of(*([st.sampled_from(pool)] * 3), *([junk()] * junk_weight))


def some(pool: list[Any]) -> st.SearchStrategy[Any]:
    """A list of pool values (sometimes junk instead of the list, or inside it)."""
    return st.one_of(
        st.lists(st.sampled_from(pool), max_size=4),
        st.lists(st.sampled_from(pool), max_size=4),
        st.lists(st.one_of(st.sampled_from(pool), junk()), max_size=3),
        junk(),
    )


TTL = pick([60, 120.5, 3600])
VERSION = pick([0, 1, 2, 5])
N = pick([1, 2, 3])
OP = st.sampled_from(OP_IDS)
SID, OWNER, TASK, GID = pick(SIDS), pick(OWNERS), pick(TASKS), pick(GIDS)
TEXT = pick(TEXTS)
INTS = st.one_of(st.lists(st.integers(0, 50), max_size=4), junk(), st.just([1, -2]), st.just([2**31]))
FLOATS = st.one_of(st.lists(st.floats(-5, 0), max_size=4), junk(), st.just([math.nan]))


class Fuzz:
    """The calls: each draws its arguments and returns a thunk that makes the call."""

    def __init__(self, store: TraceStore, tmp: Path) -> None:
        self.s = store
        self.tmp = tmp
        self.leases: list[Any] = ["nope"]
        self.matches: list[Any] = [PrefixMatch(0, [], None)]

    def lease(self) -> st.SearchStrategy[Any]:
        # an index into the leases admitted so far: the draw does not depend on that state
        return st.one_of(st.integers(0, 63).map(lambda i: self.leases[i % len(self.leases)]), junk())

    def path(self) -> st.SearchStrategy[Any]:
        """The checkpoint file, or junk; a junk str names a file in the test's directory, not the cwd."""
        return st.one_of(
            st.just(str(self.tmp / "ck.jsonl")),
            junk().map(lambda j: str(self.tmp / j) if isinstance(j, str) and j else j),
        )

    def match(self) -> st.SearchStrategy[Any]:
        return st.one_of(st.integers(0, 63).map(lambda i: self.matches[i % len(self.matches)]), junk())

    NAMES = (
        "open_session open_sessions transfer release release_owner owner_of sessions session_states "
        "heartbeat gc lookup search export record_turn insert drop_session_data admit admit_many renew "
        "settle seal reopen install drain status clear_poison lease_records router retire route_table "
        "put take claim_retry expire count stats groups checkpoint restore"
    ).split()

    def calls(self, d: Any) -> dict[str, Callable[[], Any]]:
        s, g, rb = self.s, self.s.gate, self.s.replay
        return {
            "open_session": lambda: s.open_session(
                d(SID), d(OWNER), version=d(VERSION), group=d(st.one_of(st.none(), GID)), op_id=d(OP)
            ),
            "open_sessions": lambda: s.open_sessions(d(some(SIDS)), d(OWNER), version=d(VERSION), op_id=d(OP)),
            "transfer": lambda: s.transfer(d(some(SIDS)), d(OWNER), d(OWNER), op_id=d(OP)),
            "release": lambda: s.release(d(some(SIDS)), d(OWNER), d(pick(["done", "x"])), op_id=d(OP)),
            "release_owner": lambda: s.release_owner(d(OWNER), d(pick(["done"])), op_id=d(OP)),
            "owner_of": lambda: s.owner_of(d(SID)),
            "sessions": lambda: s.sessions(d(st.one_of(st.none(), OWNER))),
            "session_states": lambda: s.session_states(d(some(SIDS))),
            "heartbeat": lambda: s.heartbeat(d(OWNER), d(TTL), op_id=d(OP)),
            "gc": lambda: s.gc(
                tombstone_retention_s=d(pick([86400])),
                group_idle_limit_s=d(pick([3600])),
                event_retention_s=d(pick([86400])),
            ),
            "lookup": lambda: self._match(s.lookup(d(SID), d(TEXT))),
            "search": lambda: s.search(d(SID), d(TEXT)),
            "export": lambda: s.export_training_trace(d(SID), d(TEXT)),
            "record_turn": lambda: s.record_turn(
                d(SID),
                d(TEXT),
                d(pick(["r", "resp"])),
                prefix=d(self.match()),
                delta_token_ids=d(INTS),
                response_token_ids=d(INTS),
                response_logprobs=d(FLOATS),
                version=d(VERSION),
                delta_expert_key=d(st.one_of(st.none(), pick(["d:1"]))),
                response_expert_key=d(st.one_of(st.none(), pick(["r:1"]))),
                op_id=d(OP),
            ),
            "insert": lambda: s.insert(
                d(SID),
                d(TEXT),
                d(st.one_of(st.builds(Segment, INTS, st.one_of(st.none(), FLOATS), version=VERSION), junk())),
            ),
            "drop_session_data": lambda: s.drop_session_data(d(SID)),
            "admit": lambda: self._lease(g.admit(d(SID), d(OWNER), d(TTL), op_id=d(OP))),
            "admit_many": lambda: [
                self._lease(x)
                for x in g.admit_many(
                    d(st.one_of(st.lists(st.tuples(SID, OWNER), max_size=3), junk())), d(TTL), op_id=d(OP)
                )
            ],
            "renew": lambda: g.renew(d(self.lease()), d(st.one_of(st.none(), TTL)), op_id=d(OP)),
            "settle": lambda: g.settle(d(self.lease()), d(pick(list(OUTCOMES))), op_id=d(OP)),
            "seal": lambda: g.seal(d(pick([500, 1])), op_id=d(OP)),
            "reopen": lambda: g.reopen(op_id=d(OP)),
            "install": lambda: g.install(d(VERSION), op_id=d(OP)),
            "drain": lambda: g.drain(d(pick([0, 0.01]))),
            "status": lambda: g.status(),
            "clear_poison": lambda: g.clear_poison(d(some(["nope", "x"])), d(pick(["fixed"])), op_id=d(OP)),
            "lease_records": lambda: g.lease_records(d(some(["nope"]))),
            "router": lambda: s.router(d(some(["e1", "e2"])), retention_s=d(TTL)).acquire_route(
                d(SID), op_id=d(OP)
            ),
            "retire": lambda: s.router(["e1"]).retire(d(some(SIDS)), op_id=d(OP)),
            "route_table": lambda: s.router(["e1"]).table(d(some(SIDS))),
            "put": lambda: rb.put(
                d(
                    st.one_of(
                        st.builds(
                            Group,
                            GID,
                            TASK,
                            st.one_of(st.lists(st.sampled_from(SIDS), min_size=1, max_size=2).map(tuple), junk()),
                            status=pick(["completed", "aborted", "failed"]),
                            min_version=VERSION,
                            retryable=pick([True, False]),
                            payload=st.one_of(st.just({"r": 1.0}), junk()),
                        ),
                        junk(),
                    )
                ),
                d(OWNER),
                op_id=d(OP),
            ),
            "take": lambda: rb.take(
                d(TASK),
                d(N),
                owner=d(OWNER),
                current_version=d(st.one_of(st.none(), VERSION)),
                policy=d(pick(["fifo", "staleness"])),
                max_staleness=d(st.one_of(st.none(), VERSION)),
                op_id=d(OP),
            ),
            "claim_retry": lambda: rb.claim_retry(d(TASK), d(N), d(OWNER), op_id=d(OP)),
            "expire": lambda: rb.expire(
                d(VERSION), d(VERSION), retryable=d(st.one_of(st.none(), pick([True]))), op_id=d(OP)
            ),
            "count": lambda: rb.count(d(st.one_of(st.none(), TASK)), d(st.one_of(st.none(), pick(["completed"])))),
            "stats": lambda: rb.stats(d(st.one_of(st.none(), TASK))),
            "groups": lambda: rb.groups(d(TASK), d(pick(["completed", "expired"]))),
            "checkpoint": lambda: s.checkpoint(d(self.path())),
            "restore": lambda: s.restore(d(self.path())),
        }

    def _lease(self, lease: Lease) -> Lease:
        self.leases.append(lease)
        self.leases.append(lease.id)
        return lease

    def _match(self, m: PrefixMatch) -> PrefixMatch:
        self.matches.append(m)
        return m


#: Refusals documented to change state before they are raised (each names why).
PARTIAL = {
    # release_owner with a caller's op id may record the empty probe of a further chunk
}

SEEN: Counter[str] = Counter()


def _report(backend: str) -> None:
    line = {"backend": backend, "profile": PROFILE, "counts": dict(SEEN)}
    print(f"\nfuzz {json.dumps(line, sort_keys=True)}")
    target = os.environ.get("TRACESTORE_FUZZ_REPORT")
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def test_public_api_raises_typed_errors_and_writes_nothing_when_it_refuses(
    backend: str, url: str, run_id: str, tmp_path: Path
) -> None:
    if backend not in ("valkey", "cluster"):
        pytest.skip("the fuzz runs on standalone and cluster (the others run the same engine)")
    SEEN.clear()
    failures: list[str] = []
    runs = itertools.count()
    names = sorted(Fuzz.NAMES)

    @settings(settings.get_profile(PROFILE))
    @given(data=st.data())
    def run(data: Any) -> None:
        # a run of its own per example: examples do not depend on each other, so hypothesis
        # can replay and shrink a failure
        store = TraceStore.connect(url, run=f"{run_id}-{next(runs)}")
        try:
            one_example(store, Fuzz(store, tmp_path), data, names, failures)
        finally:
            store.close()

    run()
    SEEN["examples"] = next(runs)
    _report(backend)
    assert SEEN["succeeded"] > 0 and SEEN["refused"] > 0  # both sides of the fuzz were exercised


def one_example(store: TraceStore, fuzz: Fuzz, data: Any, names: list[str], failures: list[str]) -> None:
    """A few calls; each either succeeds or raises a typed error that changed no key."""
    calls = fuzz.calls(data.draw)
    assert sorted(calls) == names
    for _ in range(data.draw(st.integers(1, 4), label="calls")):
        name = data.draw(st.sampled_from(names), label="method")
        before = dump_run(store)
        try:
            calls[name]()
        except OutcomeUnknown as exc:  # no I/O failure is arranged here
            raise AssertionError(f"{name}: {exc}") from exc
        except TracestoreError as exc:
            SEEN[type(exc).__name__] += 1
            SEEN["refused"] += 1
            if name not in PARTIAL:
                assert dump_run(store) == before, f"{name} refused ({exc}) but changed keys"
        except Exception as exc:
            raise AssertionError(f"{name} raised an untyped {type(exc).__name__}: {exc}") from exc
        else:
            SEEN["succeeded"] += 1


OPTION_NAMES = [
    "retries", "backoff_base_s", "backoff_cap_s", "socket_timeout_s", "connect_timeout_s", "max_connections",
    "health_check_interval_s", "client_name", "ssl_ca_certs", "ssl_cert_reqs", "ssl_check_hostname",
    "store_text", "max_payload_bytes", "cache_bytes", "op_ttl_s", "replay_payload_bytes", "no_such_option",
]
URL_NAMES = [
    "db", "socket_timeout", "protocol", "decode_responses", "ssl_cert_reqs", "ssl_ca_certs", "max_connections",
    "health_check_interval", "retry_on_error", "x",
]


def test_connect_refuses_bad_options_with_typed_errors(standalone_url: str, run_id: str) -> None:
    """connect with junk options, run ids, prefixes and URL query parameters: a ConfigError or InvalidId."""
    seen: Counter[str] = Counter()

    @settings(settings.get_profile(PROFILE), max_examples=min(settings.get_profile(PROFILE).max_examples, 80))
    @given(
        name=st.sampled_from(OPTION_NAMES),
        value=st.one_of(junk(), st.sampled_from([1, 2.5, 10, "required", "none", True, "x"])),
        run=st.one_of(*[st.just(run_id)] * 8, junk()),
        prefix=st.one_of(*[st.just("ts")] * 8, junk()),
        query=st.one_of(
            st.just(""),
            st.tuples(st.sampled_from(URL_NAMES), st.sampled_from(["0", "3", "yes", "abc", "", "%zz"])).map(
                lambda nv: f"?{nv[0]}={nv[1]}"
            ),
        ),
    )
    def run(name: str, value: Any, run: Any, prefix: Any, query: str) -> None:
        try:
            store = TraceStore.connect(standalone_url + query, run=run, prefix=prefix, **{name: value})
        except (ConfigError, InvalidId) as exc:
            seen[type(exc).__name__] += 1
        except Exception as exc:
            raise AssertionError(f"connect({name}={value!r:.40}, {query!r}) raised {type(exc).__name__}: {exc}") from exc
        else:
            seen["connected"] += 1
            store.close()

    run()
    SEEN.clear()
    SEEN.update({f"connect {k}": v for k, v in seen.items()})
    _report("standalone")
    assert seen["connected"] > 0 and seen["ConfigError"] > 0
