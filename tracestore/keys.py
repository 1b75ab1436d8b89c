"""The one module that builds key names (DESIGN section 3).

Nothing else in tracestore concatenates key strings. Every builder validates
its ids first and raises :class:`~tracestore.errors.InvalidId` before any I/O.

Control-plane keys of a run share the hash tag ``{R}`` (one slot per run);
the data keys of a session share ``{R/sid}`` (one slot per session), so every
script's KEYS land in one slot on a Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from redis.crc import key_slot as _key_slot

from .errors import InvalidId
from .validate import is_run_id, validate_id, validate_ids, validate_prefix, validate_run


def key_slot(key: str | bytes) -> int:
    """Redis Cluster hash slot of ``key`` (CRC16 of its hash tag, mod 16384)."""
    return int(_key_slot(key.encode() if isinstance(key, str) else key))


def hash_tag(key: str) -> str:
    """The part of ``key`` that Redis Cluster hashes (its ``{tag}``, else the whole key)."""
    start = key.find("{")
    if start > -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def same_slot(keys: Iterable[str]) -> bool:
    """True if every key hashes to one cluster slot (equal tags, else equal slots)."""
    it = iter(keys)
    first = next(it, None)
    if first is None:
        return True
    tag = hash_tag(first)
    slot: int | None = None
    for k in it:
        t = hash_tag(k)
        if t != tag:
            slot = key_slot(first) if slot is None else slot
            if key_slot(k) != slot:
                return False
    return True


@dataclass(frozen=True)
class Keys:
    """Key builder of one run: ``Keys(prefix="ts", run="R")``."""

    prefix: str
    run: str

    def __post_init__(self) -> None:
        validate_prefix(self.prefix)
        validate_run(self.run)

    # -- control plane: slot of {R} ------------------------------------------------

    @property
    def _c(self) -> str:
        return f"{self.prefix}:{{{self.run}}}"

    @property
    def meta(self) -> str:
        """``ts:{R}:meta`` hash: schema version, created, config."""
        return f"{self._c}:meta"

    def session(self, sid: str) -> str:
        """``ts:{R}:s:<sid>`` hash: owner, state, born, opened_ms, group."""
        return f"{self._c}:s:{validate_id('session id', sid)}"

    def owner(self, owner: str) -> str:
        """``ts:{R}:o:<owner>`` set of sids owned by ``owner``."""
        return f"{self._c}:o:{validate_id('owner tag', owner)}"

    @property
    def owners(self) -> str:
        """``ts:{R}:owners`` zset owner -> last heartbeat (ms)."""
        return f"{self._c}:owners"

    @property
    def events(self) -> str:
        """``ts:{R}:events`` stream of release events."""
        return f"{self._c}:events"

    @property
    def released(self) -> str:
        """``ts:{R}:released`` zset sid -> released ms (tombstones)."""
        return f"{self._c}:released"

    @property
    def owners_lost(self) -> str:
        """``ts:{R}:owners:lost`` zset owner -> ms when gc declared it lost (blocks resurrection)."""
        return f"{self._c}:owners:lost"

    def op(self, op_id: str) -> str:
        """``ts:{R}:op:<op_id>`` string: cached reply of a mutating script (retry idempotency)."""
        return f"{self._c}:op:{validate_id('operation id', op_id)}"

    @property
    def gate(self) -> str:
        """``ts:{R}:gate`` hash: state, version, sealed_ms."""
        return f"{self._c}:gate"

    @property
    def gate_leases(self) -> str:
        """``ts:{R}:gate:leases`` zset lease -> deadline ms."""
        return f"{self._c}:gate:leases"

    def gate_lease(self, lease: str) -> str:
        """``ts:{R}:gate:l:<lease>`` hash: sid, version, holder, admitted_ms."""
        return f"{self._c}:gate:l:{validate_id('lease id', lease)}"

    @property
    def gate_poison(self) -> str:
        """``ts:{R}:gate:poison`` hash lease -> reason (json)."""
        return f"{self._c}:gate:poison"

    @property
    def gate_signal(self) -> str:
        """``ts:{R}:gate:signal`` list pushed by the settle that empties the gate (drain wakes on it)."""
        return f"{self._c}:gate:signal"

    @property
    def route(self) -> str:
        """``ts:{R}:route`` hash sid -> entrypoint."""
        return f"{self._c}:route"

    @property
    def route_load(self) -> str:
        """``ts:{R}:route:load`` zset entrypoint -> sessions routed to it."""
        return f"{self._c}:route:load"

    @property
    def route_retired(self) -> str:
        """``ts:{R}:route:retired`` zset sid -> tombstone expiry ms (server clock)."""
        return f"{self._c}:route:retired"

    @property
    def rb_groups(self) -> str:
        """``ts:{R}:rb:groups`` hash gid -> the group's record (JSON: task, status, versions, seq...)."""
        return f"{self._c}:rb:groups"

    @property
    def rb_payloads(self) -> str:
        """``ts:{R}:rb:payloads`` hash gid -> the group's payload (JSON, as put)."""
        return f"{self._c}:rb:payloads"

    @property
    def session_prefix(self) -> str:
        """``ts:{R}:s:``: a replay script appends a sid to reach a session of a group it picked.

        Only the replay scripts use it (``lua/_lib/rb.lua``, in-script keys);
        every key so formed is a session hash in the control-plane slot ``{R}``.
        """
        return f"{self._c}:s:"

    def rb_queue(self, task: str, status: str) -> str:
        """``ts:{R}:rb:q:<task>:<status>`` zset gid -> seq (FIFO order)."""
        return f"{self._c}:rb:q:{validate_id('task', task)}:{validate_id('status', status)}"

    def rb_versions(self, task: str, status: str) -> str:
        """``ts:{R}:rb:v:<task>:<status>`` zset gid -> min_version (staleness order)."""
        return f"{self._c}:rb:v:{validate_id('task', task)}:{validate_id('status', status)}"

    @property
    def rb_seq(self) -> str:
        """``ts:{R}:rb:seq`` counter giving each put group its FIFO sequence number."""
        return f"{self._c}:rb:seq"

    @property
    def rb_tasks(self) -> str:
        """``ts:{R}:rb:tasks`` set of task names seen by the replay buffer."""
        return f"{self._c}:rb:tasks"

    @property
    def rb_sids(self) -> str:
        """``ts:{R}:rb:sids`` hash gid -> the sessions (JSON array) of every stored group."""
        return f"{self._c}:rb:sids"

    @property
    def rb_bytes(self) -> str:
        """``ts:{R}:rb:bytes`` hash ``"<status> <task>"`` -> bytes of stored group records."""
        return f"{self._c}:rb:bytes"

    @property
    def session_pattern(self) -> str:
        """SCAN pattern of every session hash ``ts:{R}:s:*`` of the run."""
        return f"{self._c}:s:*"

    def sid_of_session_key(self, key: str) -> str | None:
        """Session id of a session-hash key ``ts:{R}:s:<sid>`` of this run, or None."""
        head = f"{self._c}:s:"
        return key[len(head) :] if key.startswith(head) and len(key) > len(head) else None

    # -- data plane: slot of {R/sid} -------------------------------------------------

    def _d(self, sid: str) -> str:
        return f"{self.prefix}:{{{self.run}/{validate_id('session id', sid)}}}"

    def idx(self, sid: str) -> str:
        """``ts:{R/sid}:idx`` hash digest -> node index record."""
        return f"{self._d(sid)}:idx"

    def tok(self, sid: str) -> str:
        """``ts:{R/sid}:tok`` hash digest -> packed token payload."""
        return f"{self._d(sid)}:tok"

    def txt(self, sid: str) -> str:
        """``ts:{R/sid}:txt`` hash digest -> node text."""
        return f"{self._d(sid)}:txt"

    def dead(self, sid: str) -> str:
        """``ts:{R/sid}:dead`` tombstone written when the session's data is purged."""
        return f"{self._d(sid)}:dead"

    def data_keys(self, sid: str) -> list[str]:
        """Every data-plane key of ``sid`` except the tombstone (all in one slot)."""
        d = self._d(sid)
        return [f"{d}:idx", f"{d}:tok", f"{d}:txt"]

    # -- patterns for SCAN (operators, gc, info) ----------------------------------------

    @property
    def control_pattern(self) -> str:
        """SCAN pattern of every control-plane key of the run."""
        return f"{self.prefix}:{{{self.run}}}:*"

    def control_suffix(self, key: str) -> str | None:
        """The part of a control-plane key after ``ts:{R}:`` (checkpoint files), or None."""
        head = f"{self._c}:"
        return key[len(head) :] if key.startswith(head) and len(key) > len(head) else None

    def control_key(self, suffix: str) -> str:
        """The control-plane key ``ts:{R}:<suffix>`` (restore of a checkpoint, maybe into another run)."""
        if not isinstance(suffix, str) or not suffix or "{" in suffix or "}" in suffix:
            raise InvalidId("control key suffix", suffix, "must be a non-empty string without braces")
        return f"{self._c}:{suffix}"

    @property
    def owner_pattern(self) -> str:
        """SCAN pattern of every owner set ``ts:{R}:o:*`` of the run."""
        return f"{self._c}:o:*"

    def owner_of_key(self, key: str) -> str | None:
        """Owner tag of an owner-set key ``ts:{R}:o:<owner>`` of this run, or None."""
        head = f"{self._c}:o:"
        return key[len(head) :] if key.startswith(head) and len(key) > len(head) else None

    @property
    def data_pattern(self) -> str:
        """SCAN pattern of every data-plane key of the run."""
        return f"{self.prefix}:{{{self.run}/*}}:*"

    def sid_of_data_key(self, key: str) -> str | None:
        """Session id of a data-plane key of this run, or None for other keys."""
        head = f"{self.prefix}:{{{self.run}/"
        if not key.startswith(head):
            return None
        end = key.find("}", len(head))
        return key[len(head) : end] if end > 0 else None

    @property
    def control_slot(self) -> int:
        """Hash slot of the run's control plane."""
        return key_slot(self.meta)


def meta_pattern(prefix: str = "ts") -> str:
    """SCAN pattern matching the ``meta`` key of every run under ``prefix``."""
    return f"{validate_prefix(prefix)}:{{*}}:meta"


def run_of_meta_key(key: str, prefix: str = "ts") -> str | None:
    """Run id of a ``ts:{R}:meta`` key, or None."""
    head = f"{prefix}:{{"
    if key.startswith(head) and key.endswith("}:meta"):
        run = key[len(head) : -len("}:meta")]
        return run if is_run_id(run) else None
    return None


# The id checks live in tracestore.validate; they stay importable from here.
__all__ = [
    "Keys",
    "hash_tag",
    "key_slot",
    "meta_pattern",
    "run_of_meta_key",
    "same_slot",
    "validate_id",
    "validate_ids",
    "validate_prefix",
    "validate_run",
]
