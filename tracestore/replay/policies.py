"""Take policies by name: the order in which ``take`` hands out a task's ready groups.

A policy is one Lua picker, ``function RB_PICK.<name>(cell, want, cutoff, skip)`` in
``lua/_lib/rb.lua`` (it reads the indexes of the task's ``completed`` cell and
returns up to ``want`` gids, best first, none stale), and one entry here
naming the indexes it reads (:data:`~tracestore.replay.layout.INDEXES`).
``rb_take`` calls the picker by name; ``tests/test_replay_layout.py`` checks
that both registries list the same policies. Adding a policy over the
existing indexes is those two entries; one that needs another index adds it
to the cell layout first (:mod:`~tracestore.replay.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import one_of
from .layout import INDEXES


@dataclass(frozen=True)
class TakePolicy:
    """A take order: its name (``take(..., policy=name)``), the indexes its picker reads, what it does."""

    name: str
    reads: tuple[str, ...]
    order: str

    def __post_init__(self) -> None:
        unknown = set(self.reads) - set(INDEXES)
        if unknown:  # pragma: no cover - a programming error in the table below
            raise ValueError(f"policy {self.name!r} reads unknown indexes {sorted(unknown)}")


#: Every take policy, by name.
POLICIES: dict[str, TakePolicy] = {
    p.name: p
    for p in (
        TakePolicy("fifo", ("q",), "put order"),
        TakePolicy("staleness", ("v",), "oldest min_version first, then put order"),
        TakePolicy(
            "priority",
            ("p", "q"),
            'payload["priority"] highest first, then put order; the groups without one after '
            "every group with one, in put order",
        ),
    )
}


def policy(name: str) -> TakePolicy:
    """The policy called ``name``; InvalidInput naming the known ones otherwise (before any I/O)."""
    return POLICIES[one_of("policy", name, tuple(POLICIES))]
