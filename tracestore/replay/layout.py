"""The KEYS layout of the replay scripts: the indexes of a (task, status) *cell*, built in one place.

Every stored group is a member of the indexes of its cell (its task and
status), one zset per index:

* ``q`` — ``ts:{R}:rb:q:<task>:<status>`` gid -> seq (put order);
* ``v`` — ``ts:{R}:rb:v:<task>:<status>`` gid -> ``min_version + seq / 2**32``
  (staleness order and the expiry range);
* ``p`` — ``ts:{R}:rb:p:<task>:<status>`` ``<seq, 10 digits>:<gid>`` ->
  ``-priority``, for the groups whose payload has a ``priority`` (highest
  first, then put order: equal scores sort by member, i.e. by seq).

A script that touches a task receives, after its fixed keys, the keys of
the cells it needs (:func:`task_keys`: for each status, one key per index
in :data:`INDEXES` order), then the declared session keys. The Lua side
reads them with one helper, ``rb_cells`` in ``lua/_lib/rb.lua``, whose
``RB_INDEXES`` lists the same indexes in the same order (and which checks
that each key is the index it expects, so a layout that disagrees fails
the call with nothing written; ``tests/test_replay_layout.py`` compares
both sides and every script's header). Adding an index is one entry here,
one in ``RB_INDEXES`` and its upkeep in ``lua/_lib/rb.lua``
(``rb_index_put``, ``rb_index_move``, ``rb_index_drop``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..errors import InvalidInput
from ..keys import Keys

#: The indexes of a cell, in the order the scripts' KEYS carry them (``RB_INDEXES`` in lua/_lib/rb.lua).
INDEXES: tuple[str, ...] = ("q", "v", "p")

#: The key of each index of a cell.
_INDEX_KEY: dict[str, Callable[[Keys, str, str], str]] = {
    "q": Keys.rb_queue,
    "v": Keys.rb_versions,
    "p": Keys.rb_priorities,
}

#: The payload field of a group's priority (the ``priority`` take policy).
PRIORITY_FIELD = "priority"


def cell_keys(keys: Keys, task: str, status: str) -> tuple[str, ...]:
    """The keys of the indexes of cell (``task``, ``status``), in :data:`INDEXES` order."""
    return tuple(_INDEX_KEY[index](keys, task, status) for index in INDEXES)


def task_keys(keys: Keys, task: str, statuses: Sequence[str]) -> tuple[str, ...]:
    """The KEYS block of one task of a replay script: the cells of ``statuses``, in that order.

    What ``rb_cells(k0, labels)`` of ``lua/_lib/rb.lua`` reads back: each
    script's header names its statuses (``-- CELLS:``). Pure, no I/O;
    raises InvalidId for a bad task or status.
    """
    return tuple(key for status in statuses for key in cell_keys(keys, task, status))


def priority_of(payload: object) -> float | None:
    """The priority in a group's payload (``payload["priority"]``), or None when it has none.

    A priority is a finite number (int or float, not a bool), compared as a
    64-bit float. Raises InvalidInput (field ``payload.priority``) for
    anything else, before any I/O: the group is then not stored.
    """
    if not isinstance(payload, dict) or PRIORITY_FIELD not in payload:
        return None
    value = payload[PRIORITY_FIELD]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(
            f"payload.{PRIORITY_FIELD}", f"must be a finite number (int or float), got {value!r:.60}"
        )
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidInput(f"payload.{PRIORITY_FIELD}", f"must be a finite number, got {value!r:.60}")
    return number


def priority_score(priority: float | None) -> str:
    """The ``p`` index score of a priority as the scripts take it: ``-priority``; ``""`` for none.

    Negated so that ascending order is highest first (equal scores then sort
    by member, whose seq prefix gives put order); ``-0.0`` becomes ``0``.
    """
    if priority is None:
        return ""
    return repr(-priority + 0.0)
