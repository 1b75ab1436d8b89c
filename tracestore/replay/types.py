"""Value types and limits of the replay buffer (:mod:`tracestore.replay`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInput

#: Owner tag of sessions held by the replay buffer.
REPLAY_OWNER = "replay"
#: Every group status; ``failed`` and ``filtered`` groups are never stored.
STATUSES = ("completed", "aborted", "expired", "failed", "filtered")
#: Statuses a stored group can have.
STORED_STATUSES = ("completed", "aborted", "expired")
#: Statuses :func:`expire` moves to ``expired`` (or releases).
EXPIRABLE_STATUSES = ("completed", "aborted")
#: Versions are packed with the FIFO seq into one zset score (53-bit mantissa).
MAX_VERSION = 2**21 - 1
#: Most sessions in one group.
MAX_SIDS = 4000
#: Most groups one take, take_many (all tasks together) or claim_retry moves:
#: a call holds the server while it runs; take more with several calls.
MAX_TAKE = 2000
#: Most stale groups a take expires inside its own atomic call; beyond that it
#: runs :func:`expire` for the task first (separate atomic calls).
MAX_STALE_IN_TAKE = 2048
#: Most groups expired per ``rb_expire`` call (a call holds the server briefly).
EXPIRE_BATCH = 1000
#: Rounds of the NEED protocol before giving up (contention on one queue head).
MAX_ROUNDS = 64
#: Reply fields per group of rb_take / rb_claim: gid, record, sids, payload.
_GROUP_FIELDS = 4


# -- value types -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """A replay group: the rollouts of one prompt and what the learner needs about them.

    Input fields (to :meth:`Replay.put`):

    * ``sids``: the group's sessions (members), in the order the learner
      should see them; ``status``: one of :data:`STATUSES`;
    * ``min_version``: oldest weight version of any token of the group.
      Leave it None: ``put`` reads it from the stored traces (the oldest
      version of each member's trained tokens). A given value older than the
      traces is kept (a conservative bound); a newer one is refused;
    * ``retryable`` (default True, as in XTuner): an expired group is kept
      (status ``expired``, claimable by a producer with
      :meth:`Replay.claim_retry`) instead of being released;
    * ``agentic``: the group's members are one agent's interdependent
      sessions: per-member expiry never splits it (it expires whole);
    * ``payload``: JSON object (rewards, finish reasons...), at most
      ``StoreConfig.replay_payload_bytes`` once encoded.

    Set by the buffer on the groups it returns: ``seq`` (FIFO position),
    ``member_versions`` (each member's oldest version, aligned with ``sids``)
    and ``reroll``: the members that per-member expiry released (their
    sessions are gone; the producer rolls them out again under new session
    ids), while ``sids`` keeps the fresh members in their order.
    """

    gid: str
    task: str
    sids: tuple[str, ...]
    status: str = "completed"
    min_version: int | None = None
    retryable: bool = True
    payload: dict[str, Any] = field(default_factory=dict, hash=False)
    agentic: bool = False
    reroll: tuple[str, ...] = ()
    member_versions: tuple[int, ...] = field(default=(), compare=False)
    seq: int | None = field(default=None, compare=False)

    def staleness(self, current_version: int) -> int:
        """``current_version - min_version``; InvalidInput before the buffer has set ``min_version``."""
        if self.min_version is None:
            raise InvalidInput("min_version", f"group {self.gid!r} has none yet (put sets it)")
        return current_version - self.min_version


@dataclass(frozen=True)
class PutResult:
    """What :meth:`Replay.put` did.

    ``stored``: the group is in the buffer, with ``seq`` and ``status``
    (``expired`` when it was already stale at put). ``released``: sessions
    released instead (all of them for a group that was not stored; the stale
    members of a group expired per member at put). ``min_version``: the
    version the group was put with.
    """

    gid: str
    stored: bool
    seq: int | None
    released: tuple[str, ...] = ()
    status: str | None = None
    min_version: int | None = None


@dataclass(frozen=True)
class Taken:
    """The result of :meth:`Replay.take`: the groups taken (possibly none) and the expiry it ran first.

    Iterating, ``len``, indexing and truth work on the groups, like a
    sequence; but a ``Taken`` is not a list: ``Taken(()) == []`` is False.
    Test a take with ``if not taken`` or ``len(taken) == 0``.
    ``expired``: gids of stale retryable groups moved to status
    ``expired``; ``released``: sids released by the expiry (one event each).
    ``ready``: on a short all-or-nothing take, how many groups were ready
    (nothing was taken; the stale groups were expired all the same and are
    in ``expired`` / ``released``); None otherwise.
    """

    groups: tuple[Group, ...]
    expired: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    ready: int | None = None

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __getitem__(self, i: int) -> Group:
        return self.groups[i]


@dataclass(frozen=True)
class TakenMany:
    """The result of :meth:`Replay.take_many`: groups per task, and the expiry it ran first.

    ``tasks``: task -> the groups taken from it, in policy order (every task
    asked for is a key). ``ready``: on a short all-or-nothing take, how many
    groups each task had ready (nothing was taken; the stale groups were
    expired all the same); None otherwise. ``taken[task]`` is ``taken.tasks[task]``; iterating yields
    every group (tasks in the order asked); ``len`` counts them; a take that
    took nothing is falsy.
    """

    tasks: dict[str, tuple[Group, ...]]
    expired: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    ready: dict[str, int] | None = None

    def __getitem__(self, task: str) -> tuple[Group, ...]:
        return self.tasks[task]

    def __iter__(self) -> Iterator[Group]:
        return (g for groups in self.tasks.values() for g in groups)

    def __len__(self) -> int:
        return sum(len(g) for g in self.tasks.values())

    def __bool__(self) -> bool:
        return len(self) > 0


@dataclass(frozen=True)
class ExpireReport:
    """The result of :meth:`Replay.expire`.

    ``kept``: gids now ``expired`` (claimable); ``released_groups``: gids
    released whole; ``released_sids``: every session released (whole groups
    and the stale members of groups expired per member; one event each).
    """

    kept: tuple[str, ...]
    released_groups: tuple[str, ...]
    released_sids: tuple[str, ...]

    @property
    def expired(self) -> int:
        """Groups that left their queue (kept + released)."""
        return len(self.kept) + len(self.released_groups)


@dataclass(frozen=True)
class StatusStats:
    """One (task, status) cell of :meth:`Replay.stats`."""

    task: str
    status: str
    groups: int
    oldest_version: int | None
    bytes: int
