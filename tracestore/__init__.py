"""tracestore: a Redis-backed distributed trace store for agentic RL of LLMs.

Start with :func:`connect` (or :meth:`TraceStore.connect`); see README.md and
docs/design.md for the model. The core imports without Ray or torch; the Ray
integration lives in :mod:`tracestore.ray` (extra ``tracestore[ray]``).
"""

from .checkpoint import CheckpointInfo, expert_key_lost
from .errors import (
    ConfigError,
    CorruptData,
    DurabilityUnconfirmed,
    GatePoisoned,
    GateSealed,
    GroupExists,
    HolderNotDead,
    InvalidId,
    InvalidInput,
    LeaseFenced,
    NodeConflict,
    NotDrained,
    NotEnoughReplicas,
    NotOwner,
    OutcomeUnknown,
    OwnerLost,
    PermissionDenied,
    PrefixChanged,
    PromptMismatch,
    RunInUse,
    RunNotEmpty,
    RunRecordMissing,
    ScriptError,
    ServerError,
    SessionExists,
    SessionReleased,
    SessionRetired,
    StaleVersion,
    StateRolledBack,
    StorageError,
    TracestoreError,
    UnknownLease,
)
from .gate import DrainResult, GateStatus, Lease, SettlementReceipt
from .gc import GcReport
from .keys import Keys
from .replay import ExpireReport, Group, PutResult, Taken, TakenMany
from .router import Route, RouteTable
from .runs import RunDeleted, RunKeys, RunSummary
from .session import AsyncTurnRecorder, TurnRecorder
from .store import AsyncTraceStore, TraceStore, connect
from .traces import Node, PrefixMatch, Segment, Trace, Turn

__version__ = "0.1.0"

__all__ = [
    "CheckpointInfo",
    "ExpireReport",
    "Group",
    "GroupExists",
    "PutResult",
    "RunNotEmpty",
    "RunInUse",
    "RunRecordMissing",
    "RunDeleted",
    "RunKeys",
    "RunSummary",
    "Taken",
    "TakenMany",
    "expert_key_lost",
    "AsyncTraceStore",
    "ConfigError",
    "CorruptData",
    "DurabilityUnconfirmed",
    "GcReport",
    "GatePoisoned",
    "GateSealed",
    "InvalidId",
    "InvalidInput",
    "Keys",
    "HolderNotDead",
    "LeaseFenced",
    "Node",
    "NodeConflict",
    "PrefixChanged",
    "NotDrained",
    "NotEnoughReplicas",
    "NotOwner",
    "OutcomeUnknown",
    "OwnerLost",
    "PermissionDenied",
    "PrefixMatch",
    "PromptMismatch",
    "ScriptError",
    "Segment",
    "ServerError",
    "SessionExists",
    "SessionReleased",
    "SessionRetired",
    "StaleVersion",
    "StateRolledBack",
    "StorageError",
    "Trace",
    "TraceStore",
    "TracestoreError",
    "Turn",
    "connect",
    "DrainResult",
    "GateStatus",
    "Lease",
    "Route",
    "RouteTable",
    "SettlementReceipt",
    "UnknownLease",
    "AsyncTurnRecorder",
    "TurnRecorder",
]
