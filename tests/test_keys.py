"""Key builder and id validation (pure core, no server)."""

from __future__ import annotations

import pytest

from tracestore import InvalidId
from tracestore.keys import (
    Keys,
    hash_tag,
    key_slot,
    meta_pattern,
    run_of_meta_key,
    same_slot,
    validate_id,
)


def test_layout_matches_design() -> None:
    k = Keys("ts", "R1")
    assert k.meta == "ts:{R1}:meta"
    assert k.session("s1") == "ts:{R1}:s:s1"
    assert k.owner("train:3") == "ts:{R1}:o:train:3"
    assert k.events == "ts:{R1}:events"
    assert k.released == "ts:{R1}:released"
    assert k.gate_lease("L1") == "ts:{R1}:gate:l:L1"
    assert k.rb_queue("math", "completed") == "ts:{R1}:rb:q:math:completed"
    assert k.rb_versions("math", "completed") == "ts:{R1}:rb:v:math:completed"
    assert k.idx("s1") == "ts:{R1/s1}:idx"
    assert k.tok("s1") == "ts:{R1/s1}:tok"
    assert k.txt("s1") == "ts:{R1/s1}:txt"
    assert k.dead("s1") == "ts:{R1/s1}:dead"


def test_control_plane_shares_one_slot_and_sessions_their_own() -> None:
    k = Keys("ts", "run-7")
    control = [k.meta, k.session("a"), k.owner("replay"), k.events, k.gate, k.rb_groups, k.rb_payloads, k.rb_sids, k.route]
    assert len({key_slot(x) for x in control}) == 1
    assert same_slot(control)
    data = k.data_keys("sess/1") + [k.dead("sess/1")]
    assert len({key_slot(x) for x in data}) == 1
    # Different sessions spread over slots (not all on the control slot).
    slots = {key_slot(k.idx(f"s{i}")) for i in range(200)}
    assert len(slots) > 150
    assert not same_slot([k.meta, k.idx("a")]) or key_slot(k.meta) == key_slot(k.idx("a"))


def test_hash_tag() -> None:
    assert hash_tag("ts:{R}:meta") == "R"
    assert hash_tag("ts:{R/s}:idx") == "R/s"
    assert hash_tag("plain") == "plain"
    assert hash_tag("a{}b") == "a{}b"


@pytest.mark.parametrize(
    "bad",
    ["", "has space", "tab\there", "brace{", "brace}", "é", "x" * 201, "new\nline", None, 5],
)
def test_bad_ids_raise_invalid_id(bad: object) -> None:
    with pytest.raises(InvalidId) as exc:
        validate_id("session id", bad)  # type: ignore[arg-type]
    assert "session id" in str(exc.value)
    assert "printable ASCII" in str(exc.value)


def test_good_ids() -> None:
    for ok in ["a", "train:12", "rollout:w-3", "x" * 200, "sess/1.2_3~!"]:
        assert validate_id("session id", ok) == ok


@pytest.mark.parametrize("bad", ["", "has:colon", "a" * 65, "{x}", "sp ace"])
def test_bad_run_ids(bad: str) -> None:
    with pytest.raises(InvalidId, match="run id"):
        Keys("ts", bad)


def test_bad_prefix() -> None:
    with pytest.raises(InvalidId, match="key prefix"):
        Keys("ts:{x}", "r")


def test_key_builders_validate_before_returning() -> None:
    k = Keys("ts", "r")
    with pytest.raises(InvalidId):
        k.session("bad id")
    with pytest.raises(InvalidId):
        k.idx("a}b")
    with pytest.raises(InvalidId, match="owner tag"):
        k.owner("")


def test_meta_pattern_and_run_discovery() -> None:
    assert meta_pattern() == "ts:{*}:meta"
    assert run_of_meta_key("ts:{abc}:meta") == "abc"
    assert run_of_meta_key("ts:{abc/x}:meta") is None
    assert run_of_meta_key("ts:{abc}:other") is None
    assert Keys("ts", "r").sid_of_data_key("ts:{r/s:1}:idx") == "s:1"
    assert Keys("ts", "r").sid_of_data_key("ts:{q/s}:idx") is None
