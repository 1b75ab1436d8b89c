"""Checkpoint and restore of a run to a portable file (docs/design.md section 7, invariant 4).

``store.checkpoint(path)`` writes the run's control plane (sessions, owners,
events, gate, routes, the replay buffer's indexes), the replay groups in
FIFO order, and the traces of every session the run knows, to a versioned
JSON-lines file (format in ``docs/checkpoint.md``; no pickle, readable with
``jq``). ``store.restore(path)`` writes it back into an *empty* run (the
run id may differ from the checkpointed one) and refuses otherwise with
:class:`~tracestore.errors.RunNotEmpty`.

Routed-expert refs are Ray objects and do not survive a restart of Ray:
restored nodes keep their tokens and their ``expert_key`` becomes
``lost:<original key>`` (:func:`expert_key_lost`), so the trainer can drop
the group or train it without routing replay.

Consistency: the control plane and each session are read in their own
pipelined round trips, not in one snapshot. Take a checkpoint at a quiet
point of the run (between training steps, or with the gate sealed and no
producer putting), as the reference trainer does.

Durability against a crash of the server itself is Redis' job: run it with
AOF and ``appendfsync always`` (``EmbeddedServer(aof=True)``).
"""

from __future__ import annotations

import base64
import functools
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from .context import SCHEMA_VERSION, Context
from .errors import InvalidInput, RunNotEmpty
from .replay import STORED_STATUSES
from .replies import pairs, text
from .run import server_ms, stats
from .scripts import Batch, Blocking, Cmd, Op, ScanAll, chunks
from .validate import validate_id

#: Identifies a tracestore checkpoint file (first line, ``format``).
FORMAT = "tracestore-checkpoint"
#: Version of the file format (``docs/checkpoint.md``) that checkpoint writes.
FORMAT_VERSION = 3
#: Versions restore reads (1 has no ``turns`` record: the turn count starts at 0;
#: 1 and 2 hold traces in the schema 1 layout, converted on restore: :func:`_trace_v2`).
READ_VERSIONS = (1, 2, 3)
#: The run schema (``tracestore.context.SCHEMA_VERSION``) of each file version.
_FILE_SCHEMA = {1: 1, 2: 1, 3: SCHEMA_VERSION}
#: Prefix given to the expert key of every restored node that had one.
LOST_PREFIX = "lost:"
#: Sessions read (or commands written) per pipelined round trip.
BATCH = 256


def expert_key_lost(key: str | None) -> bool:
    """True for an expert key that a restore marked lost (its Ray object is gone)."""
    return key is not None and key.startswith(LOST_PREFIX)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint file holds (returned by checkpoint and restore)."""

    path: str
    run: str
    keys: int
    groups: int
    sessions: int
    nodes: int
    bytes: int
    lost_expert_keys: int = 0


# -- value encoding -------------------------------------------------------------------------


def _b(x: Any) -> bytes:
    if isinstance(x, bytes):
        return x
    return str(x).encode()


def enc(x: Any) -> Any:
    """A Redis value as JSON: a string when it is UTF-8, else ``{"b64": ...}``."""
    b = _b(x)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(b).decode()}


def dec(v: Any) -> bytes:
    """Inverse of :func:`enc`."""
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, dict) and isinstance(v.get("b64"), str):
        return base64.b64decode(v["b64"])
    raise InvalidInput("checkpoint", f"malformed value {v!r:.80}")


# -- checkpoint -----------------------------------------------------------------------------

_READ = {
    "hash": lambda k: ("HGETALL", k),
    "set": lambda k: ("SMEMBERS", k),
    "zset": lambda k: ("ZRANGE", k, 0, -1, "WITHSCORES"),
    "string": lambda k: ("GET", k),
    "list": lambda k: ("LRANGE", k, 0, -1),
    "stream": lambda k: ("XRANGE", k, "-", "+"),
}


def _encode_value(typ: str, reply: Any) -> Any:
    if typ == "hash":
        return [[enc(f), enc(v)] for f, v in pairs(reply)]
    if typ == "zset":
        return [[enc(m), float(s)] for m, s in pairs(reply)]
    if typ == "set":
        return sorted(enc(m) for m in reply)
    if typ == "list":
        return [enc(m) for m in reply]
    if typ == "stream":
        return [[text(i), [[enc(f), enc(v)] for f, v in pairs(fields)]] for i, fields in reply]
    return enc(reply)


class _Writer:
    """Collects the file's lines; :meth:`flush` hands them to the runner as one Blocking write.

    The file (``path + ".tmp"``) is opened on the first write and renamed to
    ``path`` by :meth:`finish`; the operation itself never touches the disk,
    so the asyncio runner writes in a worker thread.
    """

    def __init__(self, target: Path) -> None:
        self.target = target
        self.tmp = target.with_name(target.name + ".tmp")
        self.fh: IO[bytes] | None = None
        self.pending: list[bytes] = []
        self.bytes = 0

    def line(self, rec: dict[str, Any]) -> None:
        data = orjson.dumps(rec) + b"\n"
        self.pending.append(data)
        self.bytes += len(data)

    def flush(self) -> Blocking:
        data, self.pending = b"".join(self.pending), []
        return Blocking(functools.partial(self._write, data))

    def _write(self, data: bytes) -> None:
        if self.fh is None:
            try:
                self.fh = open(self.tmp, "wb")  # noqa: SIM115 - closed by finish() or abort()
            except OSError as exc:
                raise InvalidInput("path", f"cannot write {self.tmp}: {exc.strerror or exc}") from None
        self.fh.write(data)

    def finish(self) -> Blocking:
        def done() -> None:
            self._write(b"".join(self.pending))
            assert self.fh is not None
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            os.replace(self.tmp, self.target)

        return Blocking(done)

    def abort(self) -> None:
        if self.fh is not None:
            self.fh.close()


def checkpoint(ctx: Context, path: str | os.PathLike[str]) -> Op[CheckpointInfo]:
    """Write the run to ``path`` (see the module docstring and ``docs/checkpoint.md``).

    The file is written to ``path + ".tmp"`` and renamed when complete, so a
    crash never leaves a truncated file under ``path``. File writes are
    Blocking requests (in a worker thread under asyncio). Raises
    StorageError. Round trips: a SCAN of the control plane, two per 256 of
    its keys, two per 256 groups and one per 256 sessions; the file is
    written as it is read, so memory stays bounded by one batch.
    """
    k = ctx.keys
    w = _Writer(Path(_path(path)))
    found = yield ScanAll(k.control_pattern)
    op_head = k.control_suffix(k.op("x"))
    assert op_head is not None
    skip = op_head[:-1]  # retry caches
    groups = {k.rb_groups, k.rb_sids, k.rb_payloads}  # written as group records
    # the run's lock names a live process: it is not part of the run's state
    keys = sorted({key for key in found if not (k.control_suffix(key) or "").startswith(skip)} - groups - {k.lock})
    now = yield from server_ms(ctx)
    w.line(
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "schema": SCHEMA_VERSION,
            "prefix": k.prefix,
            "run": k.run,
            "created_ms": now,
        }
    )
    try:
        nkeys, sids, tasks = yield from _write_control(ctx, w, keys)
        w.line({"k": "turns", "recorded": (yield from stats(ctx)).turns_recorded})
        ngroups = yield from _write_groups(ctx, w, tasks)
        nnodes = yield from _write_traces(ctx, w, sids)
        counts = {"keys": nkeys, "groups": ngroups, "sessions": len(sids), "nodes": nnodes}
        w.line({"k": "end", "counts": counts})
        yield w.finish()
    except BaseException:
        w.abort()
        raise
    return CheckpointInfo(str(w.target), k.run, nkeys, ngroups, len(sids), nnodes, w.bytes)


def _write_control(ctx: Context, w: _Writer, keys: list[str]) -> Op[tuple[int, list[str], list[str]]]:
    """The control plane, BATCH keys per round trip (TYPE, then value and TTL).

    Returns (keys written, the run's session ids, the replay buffer's tasks).
    The session ids are those of the live sessions' hashes and of the release
    tombstones (a released session has no hash; its data tombstone is written
    with its trace record).
    """
    k = ctx.keys
    sids: list[str] = []
    tasks: list[str] = []
    nkeys = 0
    for part in chunks(keys, BATCH):
        types = [text(t) for t in (yield Batch(tuple(Cmd(("TYPE", key), key=key) for key in part)))]
        readable = [(key, t) for key, t in zip(part, types, strict=True) if t in _READ]
        reads: list[Cmd] = []
        for key, t in readable:
            reads.append(Cmd(_READ[t](key), key=key))
            reads.append(Cmd(("PTTL", key), key=key))
        replies = yield Batch(tuple(reads))
        for j, (key, t) in enumerate(readable):
            value, ttl = replies[2 * j], int(replies[2 * j + 1])
            if value is None or ttl == -2:
                continue  # expired between SCAN and the read
            suffix = k.control_suffix(key)
            w.line({"k": "key", "key": suffix, "type": t, "ttl_ms": ttl, "value": _encode_value(t, value)})
            nkeys += 1
            if t == "hash" and (sid := k.sid_of_session_key(key)):
                sids.append(sid)
            if key == k.released:
                sids += [text(m) for m, _ in pairs(value)]
            if key == k.rb_tasks:
                tasks = sorted(text(m) for m in value)
        yield w.flush()
    return nkeys, list(dict.fromkeys(sids)), tasks


def _write_groups(ctx: Context, w: _Writer, tasks: list[str]) -> Op[int]:
    """The replay groups, queue by queue, in FIFO order; returns how many."""
    k = ctx.keys
    ngroups = 0
    for task in tasks:
        for status in STORED_STATUSES:
            q = k.rb_queue(task, status)
            members = yield Cmd(("ZRANGE", q, 0, -1), key=q)
            gids = [text(g) for g in members]
            for part in chunks(gids, BATCH):
                cols = yield Batch(
                    tuple(Cmd(("HMGET", h, *part), key=h) for h in (k.rb_groups, k.rb_sids, k.rb_payloads))
                )
                for gid, rec, sids, payload in zip(part, *cols, strict=True):
                    if rec is not None and sids is not None and payload is not None:
                        fields = [["rec", enc(rec)], ["sids", enc(sids)], ["payload", enc(payload)]]
                        w.line({"k": "group", "gid": gid, "fields": fields})
                        ngroups += 1
                yield w.flush()
    return ngroups


def _write_traces(ctx: Context, w: _Writer, sids: list[str]) -> Op[int]:
    """The traces of every session of the run; returns how many nodes."""
    k = ctx.keys
    nnodes = 0
    for part in chunks(sids, BATCH):
        cmds: list[Cmd] = []
        for sid in part:
            for key in (k.idx(sid), k.tok(sid), k.txt(sid)):
                cmds.append(Cmd(("HGETALL", key), key=key))
            cmds.append(Cmd(("GET", k.dead(sid)), key=k.dead(sid)))
        data = yield Batch(tuple(cmds))
        for i, sid in enumerate(part):
            idx, tok, txt, dead = data[4 * i : 4 * i + 4]
            if not idx and not tok and not txt and dead is None:
                continue
            idx_p = pairs(idx)
            nnodes += sum(1 for f, _ in idx_p if not text(f).startswith("#"))
            w.line(
                {
                    "k": "trace",
                    "sid": sid,
                    "idx": [[enc(f), enc(v)] for f, v in idx_p],
                    "tok": [[enc(f), base64.b64encode(_b(v)).decode()] for f, v in pairs(tok)],
                    "txt": [[enc(f), enc(v)] for f, v in pairs(txt)],
                    "dead": None if dead is None else enc(dead),
                }
            )
        yield w.flush()
    return nnodes


# -- restore --------------------------------------------------------------------------------


def _path(path: object) -> str | os.PathLike[str]:
    """``path`` if it is a non-empty str or path object; else InvalidInput (before any I/O)."""
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not name or (b"\x00" if isinstance(name, bytes) else "\x00") in name:
        raise InvalidInput("path", f"must be a file path (str or os.PathLike), got {path!r:.80}")
    return path  # type: ignore[return-value]


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The first line of a checkpoint file; raises InvalidInput if it is not one this version reads."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
    except OSError as exc:
        raise InvalidInput("path", f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    try:
        head = orjson.loads(first)
    except orjson.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise InvalidInput("checkpoint", f"{path} is not a tracestore checkpoint file")
    if head.get("version") not in READ_VERSIONS:
        raise InvalidInput(
            "checkpoint", f"{path} has format version {head.get('version')!r}; this tracestore reads {READ_VERSIONS}"
        )
    want = _FILE_SCHEMA[head["version"]]
    if head.get("schema") != want:
        raise InvalidInput(
            "checkpoint", f"{path} has schema {head.get('schema')!r}, expected {want} in a version "
            f"{head['version']} file"
        )
    return head


def _lost(record: bytes) -> tuple[bytes, bool]:
    """An index record ``num[.wid],parent_num,end,ntok,flags,version,expert_key`` with its key marked lost."""
    parts = record.split(b",", 6)
    if len(parts) == 7 and parts[6] and not parts[6].startswith(LOST_PREFIX.encode()):
        parts[6] = LOST_PREFIX.encode() + parts[6]
        return b",".join(parts), True
    return record, False


def _trace_v2(rec: dict[str, Any]) -> dict[str, Any]:
    """A trace record of a version 1 or 2 file (schema 1 layout) in today's layout.

    Schema 1 keyed ``idx``, ``tok`` and ``txt`` by the 32-hex blake2b-128
    digest of the node's key, with the parent's digest in the record
    (``parent,end,ntok,flags,version,expert_key``). Today's id is that
    digest's first 16 hex characters, ``tok`` and ``txt`` are keyed by node
    number and the record starts ``num,parent_num,``. Numbers are given in
    the order of the nodes' ends (a parent before its children). Raises
    InvalidInput when two nodes of the session share a 16-hex id or a record,
    payload or text names a node the index lacks.
    """
    sid = rec.get("sid")
    meta: list[list[Any]] = []
    nodes: list[tuple[int, bytes, bytes, bytes]] = []  # (end, digest, parent, rest)
    for f, v in rec["idx"]:
        fb, vb = dec(f), dec(v)
        if fb.startswith(b"#"):
            meta.append([f, v])
            continue
        parent, end, rest = vb.split(b",", 2)
        nodes.append((int(end), fb, parent, end + b"," + rest))
    nodes.sort()
    num = {digest: i + 1 for i, (_, digest, _, _) in enumerate(nodes)}
    short = {digest[:16] for digest in num}
    if len(short) != len(num):
        raise InvalidInput("checkpoint", f"session {sid!r}: two node ids share their first 64 bits; "
                           "this tracestore cannot restore it")
    idx: list[list[Any]] = []
    for _, digest, parent, fields in nodes:
        if parent and parent not in num:
            raise InvalidInput("checkpoint", f"session {sid!r}: node {digest.decode()} has no stored parent")
        pnum = str(num[parent]).encode() if parent else b""
        idx.append([enc(digest[:16]), enc(str(num[digest]).encode() + b"," + pnum + b"," + fields)])

    def renumber(pairs_: list[list[Any]], what: str) -> list[list[Any]]:
        out = []
        for f, v in pairs_:
            digest = dec(f)
            if digest not in num:
                raise InvalidInput("checkpoint", f"session {sid!r}: {what} of node {digest.decode()} "
                                   "that the index does not list")
            out.append([str(num[digest]), v])
        return out

    return {**rec, "idx": idx + meta, "tok": renumber(rec["tok"], "payload"),
            "txt": renumber(rec["txt"], "text")}


def _group_fields_v0(f: dict[str, bytes]) -> dict[str, bytes]:
    """A group written by a tracestore whose groups were hashes ``ts:{R}:rb:g:<gid>`` (task,
    status, sids, min_version, seq, retryable, payload, ...), as today's record, sids, payload."""
    sids = orjson.loads(f["sids"])
    minv = int(f["min_version"])
    rec = {
        "task": f["task"].decode(), "status": f["status"].decode(), "min_version": minv,
        "seq": int(f["seq"]), "retryable": int(f.get("retryable", b"0") == b"1"), "agentic": 0,
        "mv": [minv] * len(sids), "reroll": [], "put_ms": int(f.get("put_ms", b"0")),
        "producer": f.get("producer", b"").decode(),
    }
    return {"rec": orjson.dumps(rec), "sids": f["sids"], "payload": f.get("payload", b"{}")}


def _write_cmds(ctx: Context, rec: dict[str, Any], version: int) -> tuple[list[Cmd], int]:
    """The commands that write one record of a file of format ``version``, and how many
    expert keys it marked lost."""
    k = ctx.keys
    kind = rec.get("k")
    cmds: list[Cmd] = []
    if kind == "key":
        key = k.control_key(rec["key"])
        if key == k.meta:
            cmds.append(Cmd(("DEL", key), key=key))
        t, v = rec["type"], rec["value"]
        if t == "hash":
            flat = [dec(x) for pair in v for x in pair]
            for i in range(0, len(flat), 2000):
                cmds.append(Cmd(("HSET", key, *flat[i : i + 2000]), key=key))
        elif t == "set":
            for i in range(0, len(v), 2000):
                cmds.append(Cmd(("SADD", key, *(dec(m) for m in v[i : i + 2000])), key=key))
        elif t == "zset":
            for i in range(0, len(v), 1000):
                args = [x for m, s in v[i : i + 1000] for x in (repr(float(s)), dec(m))]
                cmds.append(Cmd(("ZADD", key, *args), key=key))
        elif t == "list":
            for i in range(0, len(v), 2000):
                cmds.append(Cmd(("RPUSH", key, *(dec(m) for m in v[i : i + 2000])), key=key))
        elif t == "stream":
            for entry_id, fields in v:
                cmds.append(Cmd(("XADD", key, entry_id, *(dec(x) for p in fields for x in p)), key=key))
        elif t == "string":
            cmds.append(Cmd(("SET", key, dec(v)), key=key))
        else:
            raise InvalidInput("checkpoint", f"unknown key type {t!r} of {rec['key']!r}")
        ttl = int(rec.get("ttl_ms", -1))
        if ttl > 0:
            cmds.append(Cmd(("PEXPIRE", key, ttl), key=key))
        if key == k.meta:  # the restored run has today's layout (older traces are converted)
            cmds.append(Cmd(("HSET", key, "schema", SCHEMA_VERSION), key=key))
        return cmds, 0
    if kind == "turns":
        recorded = int(rec["recorded"])
        if recorded < 0:
            raise InvalidInput("checkpoint", f"negative turn count {recorded}")
        # the count goes into one shard: the run's figure is the sum of its shards
        shard = k.turn_shard_of_slot(k.control_slot)
        return ([Cmd(("INCRBY", shard, recorded), key=shard)] if recorded else []), 0
    if kind == "group":
        gid = validate_id("group id", rec["gid"])
        f = {dec(a).decode(): dec(b) for a, b in rec["fields"]}
        if "rec" not in f:
            f = _group_fields_v0(f)
        return [Cmd(("HSET", h, gid, f[name]), key=h)
                for h, name in ((k.rb_groups, "rec"), (k.rb_sids, "sids"), (k.rb_payloads, "payload"))], 0
    if kind == "trace":
        if version < 3:
            rec = _trace_v2(rec)
        sid = rec["sid"]
        lost = 0
        idx: list[bytes] = []
        for f, v in rec["idx"]:
            fb, vb = dec(f), dec(v)
            if not fb.startswith(b"#"):
                vb, was = _lost(vb)
                lost += was
            idx += [fb, vb]
        if idx:
            cmds.append(Cmd(("HSET", k.idx(sid), *idx), key=k.idx(sid)))
        tok = [x for f, v in rec["tok"] for x in (dec(f), base64.b64decode(v))]
        if tok:
            cmds.append(Cmd(("HSET", k.tok(sid), *tok), key=k.tok(sid)))
        txt = [dec(x) for pair in rec["txt"] for x in pair]
        if txt:
            cmds.append(Cmd(("HSET", k.txt(sid), *txt), key=k.txt(sid)))
        if rec.get("dead") is not None:
            cmds.append(Cmd(("SET", k.dead(sid), dec(rec["dead"])), key=k.dead(sid)))
        return cmds, lost
    raise InvalidInput("checkpoint", f"unknown record kind {kind!r}")


def _records(path: str | os.PathLike[str]) -> Generator[dict[str, Any], None, None]:
    with open(path, "rb") as fh:
        fh.readline()
        for line in fh:
            if line.strip():
                yield orjson.loads(line)


def _next_records(records: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """Up to BATCH more records (file reads: run as a Blocking request)."""
    return [rec for _, rec in zip(range(BATCH), records, strict=False)]


def _validate(path: str | os.PathLike[str], ctx: Context, version: int) -> dict[str, Any]:
    """Read the whole file once (streaming) and return its end record; raise InvalidInput if bad."""
    end: dict[str, Any] | None = None
    try:
        for rec in _records(path):
            if end is not None:
                raise InvalidInput("checkpoint", f"{path}: records after the end record")
            if rec.get("k") == "end":
                end = rec
                continue
            _write_cmds(ctx, rec, version)  # builds (and so validates) the record's commands
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, InvalidInput):
            raise
        raise InvalidInput("checkpoint", f"{path}: malformed record ({type(exc).__name__}: {exc})") from None
    if end is None:
        raise InvalidInput("checkpoint", f"{path} is truncated (no end record)")
    return end


def restore(ctx: Context, path: str | os.PathLike[str]) -> Op[CheckpointInfo]:
    """Write the checkpoint at ``path`` into this run, which must be empty.

    The run may have another id than the checkpointed one. The whole file is
    validated (format, version, complete up to its end record, known record
    kinds) before anything is written. Data is written first, the replay
    groups next, then the control plane, the meta record last. Expert keys
    of restored nodes are marked lost (:func:`expert_key_lost`). The file is
    streamed (read once to validate, then once per phase), so memory stays
    bounded by one batch; file reads are Blocking requests (a worker thread
    under asyncio).

    Raises InvalidInput (not a checkpoint, other version, truncated or
    malformed file), RunNotEmpty (the run holds keys other than its meta
    record and its lock), StorageError. Restore is not atomic: a crash in the middle
    leaves a partial run; delete it and restore again. Round trips: two SCANs
    (emptiness), then one per 256 commands.
    """
    k = ctx.keys
    head = yield Blocking(functools.partial(read_header, _path(path)))
    version = int(head["version"])
    end = yield Blocking(functools.partial(_validate, path, ctx, version))
    found = yield ScanAll(k.control_pattern, count=1000)
    others = sorted(key for key in found if key not in (k.meta, k.lock))  # the restorer may hold the lock
    if not others:
        others = (yield ScanAll(k.data_pattern, count=1000))[:5]
    if not others and (yield from stats(ctx)).turns_recorded:
        others = [k.turn_shard_pattern]
    if others:
        raise RunNotEmpty(k.run, others[:5])
    meta_suffix = k.control_suffix(k.meta)
    phases: list[Callable[[dict[str, Any]], bool]] = [
        lambda r: r["k"] == "trace",
        lambda r: r["k"] == "group",
        lambda r: (r["k"] == "key" and r["key"] != meta_suffix) or r["k"] == "turns",
        lambda r: r["k"] == "key" and r["key"] == meta_suffix,
    ]
    lost = 0
    for phase in phases:
        pending: list[Cmd] = []
        records = _records(path)
        try:
            while chunk := (yield Blocking(functools.partial(_next_records, records))):
                for rec in chunk:
                    if rec.get("k") == "end" or not phase(rec):
                        continue
                    cmds, n = _write_cmds(ctx, rec, version)
                    lost += n
                    pending += cmds
                    if len(pending) >= BATCH:
                        yield Batch(tuple(pending))
                        pending = []
        finally:
            records.close()
        if pending:
            yield Batch(tuple(pending))
    c = end.get("counts", {})
    size = yield Blocking(functools.partial(os.path.getsize, path))
    return CheckpointInfo(
        str(path), k.run, int(c.get("keys", 0)), int(c.get("groups", 0)), int(c.get("sessions", 0)),
        int(c.get("nodes", 0)), size, lost,
    )
