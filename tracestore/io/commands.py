"""How a request becomes redis-py commands, and a reply or a redis-py error becomes a result.

Shared by both I/O layers (:mod:`~tracestore.io.sync_io`,
:mod:`~tracestore.io.async_io`) and the durable path
(:mod:`~tracestore.io.durable`): the command of a script call
(EVALSHA/EVAL, their ``_RO`` forms for ``no-writes`` scripts), redis-py's
response callbacks, which replies say "run it again", and the decoding of
script replies and batches into results or typed errors.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..acl import pattern_of_key
from ..errors import (
    NotEnoughReplicas,
    PermissionDenied,
    ScriptError,
    StorageError,
    TracestoreError,
    raise_for_code,
)
from ..replies import text
from ..scripts import Batch, Cmd, Eval, Request

#: What redis-py raises: its errors, and the cluster client's own (not a RedisError).
REDIS_ERRORS = (RedisError, RedisClusterException)

#: Replies that mean "not here" (a slot moved or is moving, a primary became a replica, the
#: cluster is reconfiguring): a call a primary's script lane sent goes the cluster client's
#: way instead, which handles them (follows the redirect, learns the new slot map).
NOT_HERE = (MovedError, AskError, TryAgainError, ClusterDownError, ReadOnlyError)


def decode_script_reply(ev: Eval, reply: Any) -> Any:
    """Strip the status word of a script reply; raise the typed error it encodes."""
    if not isinstance(reply, list) or not reply or not isinstance(reply[0], int):
        raise ScriptError(ev.script.name, f"malformed reply {reply!r:.200}")
    if reply[0] == 0:
        return reply[1:]
    raise_for_code(ev.script.name, text(reply[1]), reply[2:])
    raise AssertionError("unreachable")


def wrap_error(exc: BaseException, what: str) -> TracestoreError:
    """Map a redis-py exception to StorageError/ScriptError/PermissionDenied (caller raises ``from exc``)."""
    if isinstance(exc, TracestoreError):
        return exc
    if isinstance(exc, NoPermissionError):
        return PermissionDenied(what, str(exc))
    detail = (str(exc).strip().splitlines() or [""])[0]  # one line (cluster errors span several)
    if isinstance(exc, ResponseError) and detail.startswith("NOREPLICAS"):  # the server's error code
        return NotEnoughReplicas(
            f"{what}: the primary refused the write, fewer replicas are in sync than its "
            "min-replicas-to-write; nothing was written, retry when they are back"
        )
    if isinstance(exc, ResponseError) and what.startswith("script "):
        return ScriptError(what[len("script ") :], detail)
    return StorageError(f"{what}: {type(exc).__name__}: {detail}")


def permission_probes(req: Request) -> list[tuple[str, Cmd]]:
    """One ``EXISTS`` per ACL key pattern the keys of ``req`` fall in (what a denied call's
    user may not access is then asked of the server, never read from its error text)."""
    reqs = req.requests if isinstance(req, Batch) else (req,)
    keys = [k for r in reqs for k in (r.keys if isinstance(r, Eval) else (r.key,) if isinstance(r, Cmd) else ())]
    first: dict[str, str] = {}
    for key in keys:
        pat = pattern_of_key(key) if key else None
        if pat and pat not in first:
            first[pat] = key or ""
    return [(pat, Cmd(("EXISTS", key), key=key)) for pat, key in first.items()]


def explain_denied(err: PermissionDenied, probes: list[tuple[str, Cmd]], replies: list[Any]) -> PermissionDenied:
    """``err`` naming the key patterns its user may not access (``probes``' denied ones)."""
    denied = [pat for (pat, _), r in zip(probes, replies, strict=True) if isinstance(r, PermissionDenied)]
    pats = [pat for pat, _ in probes]
    run = pats[0].split("{", 1)[1].rstrip("*/|:}") if pats else "RUN"
    check = f"`tracestore acl {run} --check --user USER` lists what it lacks"
    if denied and len(denied) < len(pats):
        hint = f"; this user may not access keys of {' '.join('~' + p for p in denied)}: {check}"
    elif denied:
        hint = (f"; this user may not access keys of {' '.join('~' + p for p in denied)} (or may not run "
                f"EXISTS): {check}")
    else:
        hint = (f"; its keys ({' '.join('~' + p for p in pats)}) are readable: the missing grant is a "
                f"command or write access: {check}")
    return PermissionDenied(err.what, err.detail, missing_patterns=denied, hint=hint)


def acl_user(client: Any) -> str | None:
    """The ACL user a redis-py client connects as (None for the default user)."""
    try:
        user = client.get_connection_kwargs().get("username")
    except Exception:  # noqa: BLE001 - a client without the method: no hint
        return None
    name = user.decode() if isinstance(user, bytes) else user
    return name if name and name != "default" else None


def with_acl_hint(err: ScriptError, user: str, req: Request) -> ScriptError:
    """``err`` with the check that tells whether ``user`` lacks a grant the script needs.

    A command a script calls that the user may not run fails inside the
    script, in words each server version puts differently (never parsed):
    for a connection with an ACL user, the error says how to find out.
    """
    pats = [pat for pat, _ in permission_probes(req)]
    run = pats[0].split("{", 1)[1].rstrip("*/|:}") if pats else "RUN"
    return ScriptError(
        err.script,
        f"{err.detail}; if the ACL refused a command to user {user!r}, `tracestore acl {run} --check --user "
        f"{user}` lists the grants it lacks",
    )


def eval_args(ev: Eval) -> tuple[Any, ...]:
    """The arguments of a script call after its sha or source: the key count, KEYS, ARGV."""
    return (len(ev.keys), *ev.keys, *ev.args)


def script_args(ev: Eval, use_sha: bool) -> tuple[Any, ...]:
    """The command of a script call: EVALSHA/EVAL, or EVALSHA_RO/EVAL_RO for a ``no-writes`` script.

    The ``_RO`` forms let a user whose keys are granted read-only (ACL
    ``%R~``) run the read scripts (docs/security.md).
    """
    ro = "_RO" if ev.script.readonly else ""
    head = ("EVALSHA" + ro, ev.script.sha) if use_sha else ("EVAL" + ro, ev.script.source)
    return (*head, *eval_args(ev))


def command_args(r: Eval | Cmd, use_sha: bool) -> tuple[Any, ...]:
    """The command of a request on the durable path (EVALSHA/EVAL for a script, else its own)."""
    if isinstance(r, Eval):
        if use_sha:
            return ("EVALSHA", r.script.sha, *eval_args(r))
        return ("EVAL", r.script.source, *eval_args(r))
    return r.args


def queue_request(pipe: Any, r: Eval | Cmd, use_sha: bool) -> None:
    """Queue request ``r`` on a redis-py pipeline."""
    pipe.execute_command(*(script_args(r, use_sha) if isinstance(r, Eval) else r.args))


def apply_callback(callbacks: Any, args: tuple[Any, ...], reply: Any) -> Any:
    """redis-py's response callback of a plain command (the ordinary path applies them too)."""
    if isinstance(reply, BaseException) or args[0] in ("EVALSHA", "EVAL"):
        return reply
    cb = callbacks.get(str(args[0]).upper())
    return cb(reply) if cb is not None else reply


def time_ms(time_reply: Any) -> int:
    """A ``TIME`` reply ``(seconds, microseconds)`` in milliseconds."""
    sec, usec = time_reply
    return int(sec) * 1000 + int(usec) // 1000


def writes(r: Eval | Cmd) -> bool:
    """True for a call of a mutating script (one without ``no-writes``)."""
    return isinstance(r, Eval) and not r.script.readonly


def mutates(req: Request) -> bool:
    """True for a mutating script, or a batch holding one: the requests the durable path waits for."""
    if isinstance(req, Eval):
        return not req.script.readonly
    return isinstance(req, Batch) and any(writes(r) for r in req.requests)


def describe(req: Request) -> str:
    """How an error names the request: ``script <name>``, ``command <NAME>`` or its kind."""
    if isinstance(req, Eval):
        return f"script {req.script.name}"
    if isinstance(req, Cmd):
        return f"command {req.args[0]}"
    return type(req).__name__


def route_key(r: Eval | Cmd) -> str | None:
    """The key whose slot routes ``r`` on a cluster (None: any node)."""
    if isinstance(r, Eval):
        return r.keys[0] if r.keys else None
    return r.key


def is_connection_error(exc: RedisError) -> bool:
    """True for a lost connection or a timeout (the outcome of what was sent is unknown)."""
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError))


def is_redirect(exc: RedisError) -> bool:
    """True for a cluster redirect (MOVED, ASK, TRYAGAIN): the request did not run there."""
    return isinstance(exc, (MovedError, AskError, TryAgainError))


def retryable(reply: Any) -> bool:
    """A reply that says "run it again, elsewhere or later": lost connection, redirect, cluster down."""
    return isinstance(reply, RedisError) and (
        is_connection_error(reply) or is_redirect(reply) or isinstance(reply, ClusterDownError)
    )


def finish_batch(batch: Batch, replies: list[Any]) -> list[Any]:
    """Decode a batch's replies in order; raise the first error unless ``batch.errors_in_place``."""
    out: list[Any] = []
    first: BaseException | None = None
    for req, reply in zip(batch.requests, replies, strict=True):
        what = f"script {req.script.name}" if isinstance(req, Eval) else f"command {req.args[0]}"
        if isinstance(reply, Exception):
            err = wrap_error(reply, what)
            if err is not reply:  # a typed error (DurabilityUnconfirmed) keeps its own cause
                err.__cause__ = reply
            first = first or err
            out.append(err if batch.errors_in_place else None)
            continue
        if isinstance(req, Eval):
            try:
                out.append(decode_script_reply(req, reply))
            except TracestoreError as err:
                first = first or err
                out.append(err if batch.errors_in_place else None)
        else:
            out.append(reply)
    if first is not None and not batch.errors_in_place:
        raise first
    return out
