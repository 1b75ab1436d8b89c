"""What each page of the viewer shows, as frozen dataclasses (pure: no I/O).

The data layer (:mod:`.runs`, :mod:`.sessions`) builds them from the store;
the HTML layer (:mod:`.html`, :mod:`.html_session`) renders them; the JSON
endpoints (``/api/...``) serialise them as they are (orjson encodes
dataclasses), so a page and its JSON always carry the same data. Times are
the server's clock in milliseconds; every view carries ``server_ms``, the
clock when it was read, so ages are computed against the server, not the
viewer's machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidInput


class NotFound(InvalidInput):
    """A run, session or node the store does not hold (the app answers 404); ``field`` names which."""


@dataclass(frozen=True)
class RunRow:
    """One run on the runs page: its exact counters, memory and last activity."""

    run: str
    created_ms: int | None
    sessions_opened: int
    sessions_released: int
    sessions_live: int
    release_events: int
    groups_put: int
    groups_taken: int
    groups_expired: int
    gate_state: str
    gate_version: int
    #: Owners whose heartbeat deadline lies in the future.
    heartbeating: int
    #: Newest time the run's control plane records (creation, release, gate change, heartbeat).
    last_activity_ms: int | None
    #: ``MEMORY USAGE`` of the run's aggregate control keys (see :data:`.runs.AGGREGATE_KEYS`).
    control_bytes: int
    #: ``used_memory`` of the server (node) that holds the run's control plane.
    node_used_memory: int | None


@dataclass(frozen=True)
class Overview:
    """``/``: the runs on the server, one page of them."""

    server_ms: int
    url: str
    runs: tuple[RunRow, ...]
    runs_total: int
    page: int
    pages: int
    #: When the run list was last discovered (SCAN in the background, never per request).
    listed_ms: int | None
    #: The viewer shows only this run (``--run``), or every run on the server (None).
    fixed_run: str | None


@dataclass(frozen=True)
class OwnerRow:
    """An owner tag of a run: its live sessions and its heartbeat."""

    owner: str
    sessions: int
    #: Heartbeat deadline (server ms), None when the owner never heart-beat.
    deadline_ms: int | None
    #: When gc declared it lost, else None.
    lost_ms: int | None
    #: ``alive`` (deadline in the future), ``expired`` (deadline passed), ``lost``, ``none`` (never heart-beat).
    heartbeat: str


@dataclass(frozen=True)
class CycleRow:
    """One weight-update cycle from the gate's log (:class:`tracestore.gate_log.GateCycle`)."""

    sealed_ms: int | None
    drained_ms: int | None
    installed_ms: int | None
    reopened_ms: int | None
    version_from: int
    version_to: int
    installed: tuple[int, ...]
    live_at_seal: int | None
    #: Seal to drained (no live lease), ms.
    drain_ms: int | None
    #: Seal to reopen, ms (None while sealed).
    sealed_for_ms: int | None


@dataclass(frozen=True)
class GateView:
    """The gate now: state, version, live and poisoned leases, and when the current seal drained."""

    state: str
    version: int
    live: int
    poisoned: int
    sealed_ms: int | None
    drained_ms: int | None
    installed_ms: int | None
    poison: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ReplayCell:
    """One (task, status) cell of the replay buffer, with its staleness histogram.

    ``staleness[s]`` counts groups whose ``min_version`` is ``gate_version - s``
    (``s`` in ``0..len-1``); ``older`` those staler than that; ``ahead`` those
    whose ``min_version`` is above the gate's version.
    """

    task: str
    status: str
    groups: int
    oldest_version: int | None
    bytes: int
    staleness: tuple[int, ...]
    older: int
    ahead: int


@dataclass(frozen=True)
class ReleaseEvent:
    """One entry of the run's release event stream."""

    id: str
    ms: int
    sid: str
    owner: str
    reason: str


@dataclass(frozen=True)
class EventRate:
    """The release event rate, from the newest entries of the stream (at most ``read`` of them).

    ``per_s`` is over ``window_s`` (the last minute, or the span of the
    entries read when they all fall inside it: then ``lower_bound``).
    ``buckets`` counts events per ``bucket_s`` over the ``len(buckets) *
    bucket_s`` seconds up to now, oldest first (a sparkline).
    """

    per_s: float
    window_s: float
    in_window: int
    lower_bound: bool
    read: int
    bucket_s: int
    buckets: tuple[int, ...]


@dataclass(frozen=True)
class RunView:
    """``/runs/{run}``: counters, owners, the gate and its cycles, the replay buffer, releases."""

    run: str
    server_ms: int
    created_ms: int | None
    counters: dict[str, int]
    gate: GateView
    cycles: tuple[CycleRow, ...]
    owners: tuple[OwnerRow, ...]
    owners_total: int
    owners_page: int
    owners_pages: int
    #: When owners without a heartbeat were last discovered (background SCAN of owner sets).
    owners_listed_ms: int | None
    replay: tuple[ReplayCell, ...]
    events: tuple[ReleaseEvent, ...]
    rate: EventRate
    control_bytes: int
    node_used_memory: int | None
    released_total: int


@dataclass(frozen=True)
class SessionRow:
    """A live session in an owner's listing."""

    sid: str
    state: str
    born: int | None
    opened_ms: int | None
    group: str | None
    #: Trace nodes stored (0: no data).
    nodes: int


@dataclass(frozen=True)
class OwnerView:
    """``/runs/{run}/owners/{owner}``: one page of an owner's sessions (SSCAN cursor paging)."""

    run: str
    owner: str
    server_ms: int
    sessions_total: int
    deadline_ms: int | None
    sessions: tuple[SessionRow, ...]
    cursor: str
    #: The cursor of the next page ("0": this was the last).
    next_cursor: str


@dataclass(frozen=True)
class GroupRow:
    """A stored replay group."""

    gid: str
    seq: int
    min_version: int
    staleness: int
    retryable: bool
    sids: tuple[str, ...]
    payload: str


@dataclass(frozen=True)
class ReplayView:
    """``/runs/{run}/replay/{task}/{status}``: one page of a cell's groups, FIFO order."""

    run: str
    task: str
    status: str
    server_ms: int
    gate_version: int
    total: int
    offset: int
    groups: tuple[GroupRow, ...]


@dataclass(frozen=True)
class NodeRow:
    """One node of a session's tree, in depth-first order."""

    num: int
    id: str
    parent: int | None
    depth: int
    end: int
    tokens: int
    labels: str
    version: int
    expert_key: str | None
    write_id: str | None
    #: Why this node branched from its parent's other children (None: not recorded).
    fork: str | None
    children: int
    text: str | None


@dataclass(frozen=True)
class BranchRow:
    """A node with more than one child: where the session's paths part."""

    num: int
    end: int
    children: tuple[int, ...]
    #: The fork reason recorded on each child (None: not recorded), in the order of ``children``.
    forks: tuple[str | None, ...]


@dataclass(frozen=True)
class SessionView:
    """``/runs/{run}/sessions/{sid}``: the session's control record and one page of its tree."""

    run: str
    sid: str
    server_ms: int
    owner: str | None
    state: str
    born: int | None
    opened_ms: int | None
    group: str | None
    released_ms: int | None
    route: str | None
    purged: bool
    index_version: int
    nodes_total: int
    tokens_total: int
    generated_total: int
    leaves: tuple[int, ...]
    leaves_total: int
    branches: tuple[BranchRow, ...]
    branches_total: int
    page: int
    pages: int
    nodes: tuple[NodeRow, ...]


@dataclass(frozen=True)
class TokenRow:
    """One token of a path: what the trainer gets, and where it came from."""

    i: int
    id: int
    text: str | None
    trained: bool
    label: int
    logprob: float
    version: int
    staleness: int
    expert_key: str | None
    node: int


@dataclass(frozen=True)
class TurnBar:
    """Tokens of one turn of a path: the prompt tokens before a generated node, and the node's."""

    turn: int
    prompt: int
    generated: int
    version: int


@dataclass(frozen=True)
class PathView:
    """``/runs/{run}/sessions/{sid}/path/{num}``: the path from the root to node ``num``, per token.

    ``tokens`` is one window (``offset``, at most ``count``) of the path's
    ``tokens_total``, ``nodes`` the nodes holding them (with their text) of
    the ``path_nodes`` on the path; ``turns`` and ``staleness`` cover the whole path
    (from the index: no payload read for them). ``staleness[s]`` counts
    trained tokens ``s`` versions behind the gate (the last bucket: ``s`` or more).
    """

    run: str
    sid: str
    num: int
    server_ms: int
    gate_version: int
    nodes: tuple[NodeRow, ...]
    path_nodes: int
    tokens_total: int
    trained_total: int
    offset: int
    count: int
    tokens: tuple[TokenRow, ...]
    turns: tuple[TurnBar, ...]
    staleness: tuple[int, ...]
    tokenizer: str | None = field(default=None)


__all__ = [
    "BranchRow",
    "CycleRow",
    "EventRate",
    "GateView",
    "GroupRow",
    "NodeRow",
    "NotFound",
    "OwnerRow",
    "OwnerView",
    "Overview",
    "PathView",
    "ReleaseEvent",
    "ReplayCell",
    "ReplayView",
    "RunRow",
    "RunView",
    "SessionRow",
    "SessionView",
    "TokenRow",
    "TurnBar",
]
