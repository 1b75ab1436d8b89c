"""The one module that builds key names (docs/design.md section 3).

Nothing else in tracestore concatenates key strings. Every builder validates
its ids first and raises :class:`~tracestore.errors.InvalidId` before any I/O.

Control-plane keys of a run share the hash tag ``{R}`` (one slot per run);
the data keys of a session share ``{R/sid}`` (one slot per session), so every
script's KEYS land in one slot on a Redis Cluster. The run's turn counter is
sharded by slot: ``{R|<tag>}``, with a 4-character tag chosen so that the
shard of a session lands in the session's own slot (:func:`slot_tag`).
"""

from __future__ import annotations

from binascii import crc_hqx
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache

from redis.crc import key_slot as _key_slot

from .errors import InvalidId
from .validate import is_run_id, validate_id, validate_ids, validate_prefix, validate_run


def key_slot(key: str | bytes) -> int:
    """Redis Cluster hash slot of ``key`` (CRC16 of its hash tag, mod 16384)."""
    return int(_key_slot(key.encode() if isinstance(key, str) else key))


#: Hash slots of a Redis Cluster.
SLOTS = 16384
#: Sessions whose data-key head a :class:`Keys` remembers (``Keys._heads``).
_HEADS_MAX = 8192
#: A session's data keys, by suffix (the tombstone ``dead`` aside).
_DATA_PARTS = ("idx", "tok", "txt", "part", "ans", "resp")


@cache
def _tag_basis() -> dict[int, tuple[int, int]]:
    """Echelon basis of the map from a tag's 16 free bits to its slot bits.

    A tag is 4 bytes ``0x40 | nibble`` ('@'..'O'), so its bytes are affine in
    16 free bits, and CRC16 (init 0, no final xor) is linear in the bytes of
    a fixed-length message: ``crc(P + tag) = crc(P + "@@@@") ^ crc(nibbles)``.
    Returns ``{pivot bit: (slot bits, tag bits)}`` for the 14 slot bits.
    """
    basis: dict[int, tuple[int, int]] = {}
    for j in range(16):
        t = 1 << j
        v = crc_hqx(_nibbles(t), 0) & (SLOTS - 1)
        while v:
            p = v.bit_length() - 1
            if p not in basis:
                basis[p] = (v, t)
                break
            bv, bt = basis[p]
            v, t = v ^ bv, t ^ bt
    if len(basis) != SLOTS.bit_length() - 1:  # never: CRC16 reaches every slot with 16 bits
        raise AssertionError("slot tags do not span every slot")
    return basis


def _nibbles(t: int) -> bytes:
    return bytes((t >> (4 * i)) & 0xF for i in range(4))


@lru_cache(maxsize=256)
def _tag_base(head: str) -> int:
    return crc_hqx(head.encode() + b"@@@@", 0) & (SLOTS - 1)


def slot_tag(head: str, slot: int) -> str:
    """A 4-character tag (``@``..``O``) such that the hash tag ``head + tag`` lands in ``slot``.

    Solved in closed form (no search): see :func:`_tag_basis`.
    """
    v, t = (slot ^ _tag_base(head)) & (SLOTS - 1), 0
    basis = _tag_basis()
    while v:
        bv, bt = basis[v.bit_length() - 1]
        v, t = v ^ bv, t ^ bt
    return bytes(0x40 | b for b in _nibbles(t)).decode()


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
    start = first.find("{")
    end = first.find("}", start + 1) if start > -1 else -1
    if end > start + 1:
        # Fast path (thousands of keys of one run on a hot path): a key that starts
        # with the first key's text up to its tag's "}" has the same tag.
        head = first[: end + 1]
        rest = [k for k in it if not k.startswith(head)]
        if not rest:
            return True
        it = iter(rest)
    tag = hash_tag(first)
    slot: int | None = None
    for k in it:
        t = hash_tag(k)
        if t != tag:
            slot = _tag_slot(tag) if slot is None else slot
            if _tag_slot(t) != slot:
                return False
    return True


@lru_cache(maxsize=4096)
def _tag_slot(tag: str) -> int:
    """The slot of a hash tag (a key's :func:`hash_tag`), remembered: the run's turn
    shards recur in every ``record_turn``'s keys."""
    return key_slot(tag)


@dataclass(frozen=True)
class Keys:
    """Key builder of one run: ``Keys(prefix="ts", run="R")``."""

    prefix: str
    run: str
    #: Turn counter shard of each slot, made on first use (slot -> key).
    _shards: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: Validated session ids -> (their data-key head ``ts:{R/sid}``, its turn shard or None),
    #: so the keys of a session's every call skip the id check and the slot's CRC (bounded:
    #: emptied at :data:`_HEADS_MAX` sessions).
    _heads: dict[str, list[str | None]] = field(default_factory=dict, init=False, repr=False, compare=False)

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

    @property
    def session_head(self) -> str:
        """``ts:{R}:s:``, the head of every session hash key (the sid follows it)."""
        return f"{self._c}:s:"

    def session_keys(self, sids: Sequence[str]) -> list[str]:
        """``ts:{R}:s:<sid>`` of each of ``sids`` (validated in one pass)."""
        head = f"{self._c}:s:"
        return [head + s for s in validate_ids("session id", sids)]

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
    def stats(self) -> str:
        """``ts:{R}:stats`` hash: the run's exact counters (sessions opened, released...)."""
        return f"{self._c}:stats"

    @property
    def owners_lost(self) -> str:
        """``ts:{R}:owners:lost`` zset owner -> ms when gc declared it lost (blocks resurrection)."""
        return f"{self._c}:owners:lost"

    @property
    def lock(self) -> str:
        """``ts:{R}:lock`` hash: the run's lock (one trainer per run): holder, host, boot, pid, since."""
        return f"{self._c}:lock"

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
    def gate_holders(self) -> str:
        """``ts:{R}:gate:holders`` zset holder -> heartbeat deadline ms (server clock; ``gate.heartbeat``)."""
        return f"{self._c}:gate:holders"

    @property
    def gate_held(self) -> str:
        """``ts:{R}:gate:held`` zset (scores 0) of ``<holder> <lease id>``: each holder's unsettled leases.

        Read by range (``ZRANGEBYLEX``) per holder: a holder tag holds no
        whitespace, so the space ends it.
        """
        return f"{self._c}:gate:held"

    @property
    def gate_log(self) -> str:
        """``ts:{R}:gate:log`` stream: one entry per seal, install and reopen (the gate's cycles, capped)."""
        return f"{self._c}:gate:log"

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

    def rb_priorities(self, task: str, status: str) -> str:
        """``ts:{R}:rb:p:<task>:<status>`` zset ``<seq, 10 digits>:<gid>`` -> -priority (priority order).

        Only groups whose payload has a ``priority`` are members; ascending
        order is highest priority first, then put order (the member's seq).
        """
        return f"{self._c}:rb:p:{validate_id('task', task)}:{validate_id('status', status)}"

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

    def _head(self, sid: str) -> list[str | None]:
        got = self._heads.get(sid) if type(sid) is str else None
        if got is None:
            got = [f"{self.prefix}:{{{self.run}/{validate_id('session id', sid)}}}", None]
            if len(self._heads) >= _HEADS_MAX:
                self._heads.clear()
            self._heads[sid] = got
        return got

    def _d(self, sid: str) -> str:
        return self._head(sid)[0]  # type: ignore[return-value]

    def idx(self, sid: str) -> str:
        """``ts:{R/sid}:idx`` hash node id -> node index record (``num.wid,parent_num,end,...``)."""
        return f"{self._d(sid)}:idx"

    def tok(self, sid: str) -> str:
        """``ts:{R/sid}:tok`` hash node number -> packed token payload."""
        return f"{self._d(sid)}:tok"

    def txt(self, sid: str) -> str:
        """``ts:{R/sid}:txt`` hash node number -> node text."""
        return f"{self._d(sid)}:txt"

    def part(self, sid: str) -> str:
        """``ts:{R/sid}:part`` hash prompt node id -> tokens kept of a turn a weight update stopped."""
        return f"{self._d(sid)}:part"

    def ans(self, sid: str) -> str:
        """``ts:{R/sid}:ans`` hash retry digest -> the answer of a recorded turn (a retry replays it)."""
        return f"{self._d(sid)}:ans"

    def resp(self, sid: str) -> str:
        """``ts:{R/sid}:resp`` hash Responses-API response id -> its items (``previous_response_id``)."""
        return f"{self._d(sid)}:resp"

    def dead(self, sid: str) -> str:
        """``ts:{R/sid}:dead`` tombstone written when the session's data is purged."""
        return f"{self._d(sid)}:dead"

    def dead_keys(self, sids: Sequence[str]) -> list[str]:
        """The data tombstone of each of ``sids`` (validated in one pass)."""
        head = f"{self.prefix}:{{{self.run}/"
        return [f"{head}{s}}}:dead" for s in validate_ids("session id", sids)]

    def data_keys_of(self, sids: Sequence[str]) -> list[str]:
        """:meth:`data_keys` of each of ``sids``, in one list (validated in one pass)."""
        head = f"{self.prefix}:{{{self.run}/"
        return [f"{head}{s}}}:{part}" for s in validate_ids("session id", sids) for part in _DATA_PARTS]
    def data_op(self, sid: str, op_id: str) -> str:
        """``ts:{R/sid}:op:<op_id>`` string: recorded reply of a data-plane write with a caller's op id."""
        return f"{self._d(sid)}:op:{validate_id('operation id', op_id)}"

    @staticmethod
    def is_trace_data(key: str) -> bool:
        """True for a session's trace keys (``idx``, ``tok``, ``txt``), not its tombstone or op records."""
        end = key.find("}:")
        return end > 0 and key[end + 2 :] in ("idx", "tok", "txt")

    def data_keys(self, sid: str) -> list[str]:
        """Every data-plane key of ``sid`` except the tombstone (all in one slot)."""
        d = self._d(sid)
        return [f"{d}:{part}" for part in _DATA_PARTS]

    # -- turn counter shards: slot of the session they count -------------------------

    def turn_shard(self, sid: str) -> str:
        """``ts:{R|<tag>}:turns``: the run's turn counter shard in the slot of ``sid``'s data.

        ``record_turn`` increments it in the same script that writes the turn
        (one slot on a cluster); the run's count is the sum over the shards.
        """
        head = self._head(sid)
        shard = head[1]
        if shard is None:
            shard = head[1] = self.turn_shard_of_slot(key_slot(head[0]))  # type: ignore[arg-type]
        return shard

    def turn_shard_of_slot(self, slot: int) -> str:
        """The turn counter shard of hash slot ``slot`` (0..16383)."""
        key = self._shards.get(slot)
        if key is None:
            head = f"{self.run}|"
            key = f"{self.prefix}:{{{head}{slot_tag(head, slot)}}}:turns"
            self._shards[slot] = key
        return key

    def turn_shards(self) -> list[str]:
        """Every turn counter shard of the run, one per hash slot (16,384 keys)."""
        return [self.turn_shard_of_slot(s) for s in range(SLOTS)]

    @property
    def turn_shard_pattern(self) -> str:
        """SCAN pattern of the run's turn counter shards."""
        return f"{self.prefix}:{{{self.run}|*}}:turns"

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
