"""A multi-turn tool-using toy task with a verifiable reward.

The user asks to reach a target number from a start number. Each assistant
turn is either a calculator call (``add 3``, ``sub 4``, ``mul 2``, one digit
operand) that the environment executes and answers in a ``tool`` message
(``= 7``), or ``done``. The episode ends on ``done``, after ``max_calls`` calls
(then a final turn must still say ``done``), or on a truncated turn. The
reward is verifiable from the problem and the final value: 1.0 on the target,
else a shaped score that decays with the distance, 0 for a malformed turn.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

SYSTEM_PROMPT = "use add sub mul with one digit then done"
MAX_VALUE = 99
_ACTION = re.compile(r"^(add|sub|mul) ([0-9])$")


@dataclass(frozen=True)
class Problem:
    """One prompt: reach ``target`` from ``start``."""

    pid: str
    start: int
    target: int

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable form (replay group payloads)."""
        return {"pid": self.pid, "start": self.start, "target": self.target}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Problem:
        """Inverse of :meth:`to_json`."""
        return cls(str(d["pid"]), int(d["start"]), int(d["target"]))


def make_problem(rng: random.Random, pid: str) -> Problem:
    """A problem one call away: target = start +/- a digit, or start times a digit, in 0..``MAX_VALUE``."""
    start = rng.randint(1, 9)
    op = rng.choice(("add", "add", "sub", "mul"))
    n = rng.randint(2, 9)
    target = apply_op(op, n, start)
    if target == start or target > 30:
        target = apply_op("add", n, start)
    return Problem(pid, start, target)


def apply_op(op: str, n: int, value: int) -> int:
    """Apply one calculator call, clamped to 0..``MAX_VALUE``."""
    if op == "add":
        out = value + n
    elif op == "sub":
        out = value - n
    elif op == "mul":
        out = value * n
    else:
        raise ValueError(f"unknown operation {op!r}")
    return max(0, min(MAX_VALUE, out))


def parse_action(content: str) -> tuple[str, int] | None:
    """``(op, n)`` for a call, ``("done", 0)`` for done, None when malformed."""
    text = content.strip()
    if text == "done":
        return ("done", 0)
    m = _ACTION.match(text)
    if m is None:
        return None
    return (m.group(1), int(m.group(2)))


def score(problem: Problem, value: int, valid: bool) -> float:
    """The verifiable reward: 1 on target, ``0.5 * (1 - d/10)`` within 10, 0 if invalid."""
    if not valid:
        return 0.0
    d = abs(value - problem.target)
    if d == 0:
        return 1.0
    return max(0.0, 0.5 * (1.0 - d / 10.0))


@dataclass
class Episode:
    """State of one rollout of a problem: the conversation and the calculator value."""

    problem: Problem
    max_calls: int = 3
    messages: list[dict[str, str]] = field(default_factory=list)
    value: int = 0
    calls: int = 0
    turns: int = 0
    done: bool = False
    valid: bool = True
    finish: str = ""

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": f"reach {self.problem.target} from {self.problem.start}",
                },
            ]
            self.value = self.problem.start

    def step(self, content: str, stopped: bool) -> dict[str, str] | None:
        """Apply one assistant turn; return the tool message, or None when the episode ended.

        The assistant message itself is appended by the caller (after recording).
        """
        self.turns += 1
        if not stopped:
            self.done, self.valid, self.finish = True, False, "length"
            return None
        action = parse_action(content)
        if action is None:
            self.done, self.valid, self.finish = True, False, "malformed"
            return None
        op, n = action
        if op == "done":
            self.done, self.finish = True, "done"
            return None
        if self.calls >= self.max_calls:
            self.done, self.valid, self.finish = True, False, "too-many-calls"
            return None
        self.calls += 1
        self.value = apply_op(op, n, self.value)
        return {"role": "tool", "content": f"= {self.value}"}

    @property
    def reward(self) -> float:
        """Reward of the episode (meaningful once ``done``)."""
        return score(self.problem, self.value, self.valid and self.done)


def demonstration(problem: Problem, rng: random.Random, oracle: float = 0.3) -> list[str]:
    """Assistant turns of a well-formed episode (random calls, some toward the target).

    Used to warm-start the policy on the format, so that RL starts from a
    model that speaks the protocol but does not yet solve the task.
    """
    turns: list[str] = []
    value = problem.start
    for _ in range(rng.randint(1, 3)):
        if rng.random() < oracle and value != problem.target:
            diff = problem.target - value
            if 0 < diff <= 9:
                op, n = "add", diff
            elif -9 <= diff < 0:
                op, n = "sub", -diff
            else:
                op, n = rng.choice(("add", "sub", "mul")), rng.randint(1, 9)
        else:
            op, n = rng.choice(("add", "sub", "mul")), rng.randint(1, 9)
        turns.append(f"{op} {n}")
        value = apply_op(op, n, value)
    turns.append("done")
    return turns
