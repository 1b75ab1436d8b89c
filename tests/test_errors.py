"""Typed errors: mapped from script result codes, and intact across process boundaries."""

from __future__ import annotations

import pickle

import pytest

from tracestore import errors
from tracestore.errors import ScriptError, raise_for_code

# Every code a script may return, with fields as the scripts send them.
CODES = {
    "SESSION_EXISTS": ("s-1", "rollout:0"),
    "SESSION_RELEASED": ("s-1", "its trace data was purged"),
    "NOT_OWNER": ("s-1", "train:3", "replay"),
    "OWNER_LOST": ("rollout:7", "1700000000000"),
    "NODE_CONFLICT": ("s-1", "ab" * 16, "token payload differs"),
    "GATE_SEALED": ("4", "250"),
    "GATE_POISONED": ("l-1", "l-2"),
    "NOT_DRAINED": ("sealed", "3"),
    "STALE_VERSION": ("4", "4"),
    "SESSION_RETIRED": ("s-1",),
    "UNKNOWN_LEASE": ("l-9",),
    "LEASE_FENCED": ("l-9",),
    "GROUP_EXISTS": ("g-1", "completed"),
    "INVALID_INPUT": ("ttl_s", "must be positive"),
    "PREFIX_CHANGED": ("s-1", "ab" * 8, "0badf00d", "", "1"),
}


def _raised(code: str) -> errors.TracestoreError:
    with pytest.raises(errors.TracestoreError) as info:
        raise_for_code("some_script", code, CODES[code])
    return info.value


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_code_maps_to_its_typed_error_and_pickles_intact(code: str) -> None:
    err = _raised(code)
    assert not isinstance(err, ScriptError), f"{code} fell through to ScriptError"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.__dict__ == err.__dict__


def test_unknown_code_is_a_script_error() -> None:
    with pytest.raises(ScriptError, match="NO_SUCH_CODE"):
        raise_for_code("some_script", "NO_SUCH_CODE", ())


def test_errors_raised_before_io_pickle_with_their_fields() -> None:
    for err in (
        errors.InvalidId("session id", "a b", "no whitespace"),
        errors.InvalidInput("delta_token_ids", "negative id"),
        errors.PromptMismatch("s-1", 12, 30, [10, 20], "...window..."),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), str(back), back.__dict__) == (type(err), str(err), err.__dict__)
