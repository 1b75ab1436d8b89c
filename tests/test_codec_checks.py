"""codec's int32/float32 checks: the loop-free common case decides exactly what the per-value
rule does (pure, no server)."""

from __future__ import annotations

import math
import random
from array import array

import pytest

from tracestore import InvalidInput
from tracestore.codec import float32_logprobs, int32_array


def _ids_ok(values: list[int]) -> bool:
    return all(0 <= v <= 2**31 - 1 for v in values)


@pytest.mark.parametrize(
    "values",
    [[], [0], [2**31 - 1], [127, 128, 255, 256, 2**24 - 1, 2**24, 2**31 - 1], [-1], [5, -1], [-(2**31)], [1, 2, 3, -128]],
)
def test_int32_ids_sign_check(values: list[int]) -> None:
    if _ids_ok(values):
        assert int32_array("ids", values, non_negative=True).tolist() == values
    else:
        with pytest.raises(InvalidInput, match="non-negative"):
            int32_array("ids", values, non_negative=True)
    assert int32_array("labels", values, non_negative=False).tolist() == values  # no sign rule


def test_int32_ids_random_against_the_rule() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        values = [rng.randrange(-(2**31), 2**31) if rng.random() < 0.02 else rng.randrange(2**31) for _ in range(rng.randrange(0, 40))]
        ok = _ids_ok(values)
        try:
            int32_array("ids", values, non_negative=True)
        except InvalidInput:
            assert not ok, values
        else:
            assert ok, values


def _ref_logprobs(values: list[float]) -> bytes | None:
    """The per-value rule: None when refused, else the packed float32s with -0.0 as 0.0."""
    a = array("f", values)
    for i, x in enumerate(a):
        if x != x or x == math.inf:
            return None
        if x == 0.0:
            a[i] = 0.0
    return a.tobytes()


@pytest.mark.parametrize(
    "values",
    [
        [], [-0.5], [0.0], [-0.0], [-0.0, -1.0, -0.0], [-math.inf], [-math.inf, -1.0], [math.nan],
        [-1.0, math.inf], [-math.inf, math.inf], [1e39], [-1e39], [-3.4e38, -3.4e38, -3.4e38],
        # a -0.0 byte pattern across two values (not 4-aligned): 0x00000000 then 0x80 in the next
        [array("f", bytes([0, 0, 0, 0]))[0], array("f", bytes([0, 0, 0x80, 0x3F]))[0]],
    ],
)
def test_float32_logprobs_against_the_rule(values: list[float]) -> None:
    want = _ref_logprobs(values)
    if want is None:
        with pytest.raises(InvalidInput, match="finite or -inf"):
            float32_logprobs("lps", values)
    else:
        assert float32_logprobs("lps", values).tobytes() == want


def test_float32_logprobs_random_against_the_rule() -> None:
    rng = random.Random(11)
    specials = [0.0, -0.0, -math.inf, math.inf, math.nan, 1e39, -1e39]
    for _ in range(3000):
        values = [rng.choice(specials) if rng.random() < 0.05 else -rng.random() * 20 for _ in range(rng.randrange(0, 30))]
        want = _ref_logprobs(values)
        try:
            got = float32_logprobs("lps", values).tobytes()
        except InvalidInput:
            assert want is None, values
        else:
            assert got == want, values
