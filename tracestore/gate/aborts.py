"""Stopping a dead holder's requests at their engines over HTTP (the standard library only).

The ``abort`` of :func:`~tracestore.gate.holders.resolve_dead_holders` for
callers without an engine client of their own (``tracestore gc``): a lease
names its engine's base URL and the engine's request id
(``admit(..., engine=, request=)``). A request is *stopped* when

* the engine confirmed the abort: SGLang's ``POST /abort_request
  {"rid": ...}`` answered 2xx (it does for a request that already ended too:
  either way nothing runs under that id any more); or
* the engine is gone: its port refused the connection twice, a short while
  apart (a process that listens no more runs no request).

vLLM has no abort endpoint (it aborts a request whose client left, and the
client was the dead holder): with ``api="vllm"`` only a gone engine stops a
request; a live gateway, which holds its own connections, aborts better.
Anything else (a timeout, a 5xx, a lease without an engine or request id)
leaves the lease unresolved, never settled.
"""

from __future__ import annotations

import concurrent.futures
import errno
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence

import orjson

from ..keys import validate_id
from .holders import Abort
from .types import DeadLease

#: Engine wire shapes whose abort call this module knows (DESIGN section 13); for any other
#: adapter of the gateway, only a gone engine stops a request.
APIS = ("sglang", "vllm")
#: Pause before the second connection attempt that shows an engine gone (s).
REFUSED_RECHECK_S = 0.2


def _refused(exc: BaseException) -> bool:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, ConnectionRefusedError) or getattr(reason, "errno", None) == errno.ECONNREFUSED


def _post(url: str, body: bytes, timeout_s: float) -> bool | None:
    """POST ``body``: True on 2xx, False on another answer or a timeout, None when refused."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the lease's http(s) URL
            resp.read()
            return bool(200 <= int(resp.status) < 300)
    except urllib.error.HTTPError:
        return False
    except (urllib.error.URLError, OSError) as exc:
        return None if _refused(exc) else False


def _gone(engine: str, timeout_s: float) -> bool:
    """True when ``engine`` refuses connections, checked twice (``REFUSED_RECHECK_S`` apart)."""
    for attempt in range(2):
        if attempt:
            time.sleep(REFUSED_RECHECK_S)
        try:
            with urllib.request.urlopen(engine.rstrip("/") + "/health", timeout=timeout_s):  # noqa: S310
                return False
        except urllib.error.HTTPError:
            return False  # something answers there
        except (urllib.error.URLError, OSError) as exc:
            if not _refused(exc):
                return False
    return True


def abort_request(engine: str, request: str, *, api: str = "sglang", timeout_s: float = 5.0) -> bool:
    """Stop request ``request`` at ``engine`` (its base URL); True when it is known stopped.

    See the module docstring for what counts: an ``api`` whose abort call is
    not known here (not in :data:`APIS`) is stopped only when its engine is
    gone, as vLLM's. A few HTTP requests (one abort; two health checks when
    refused).
    """
    if api == "sglang":
        done = _post(engine.rstrip("/") + "/abort_request", orjson.dumps({"rid": request}), timeout_s)
        if done is not None:
            return done
    return _gone(engine, timeout_s)


def http_abort(api: str = "sglang", *, timeout_s: float = 5.0, workers: int = 8) -> Abort:
    """An ``abort`` for :func:`~tracestore.gate.holders.resolve_dead_holders`: HTTP, ``workers`` at a time.

    Returns the ids of the leases whose requests :func:`abort_request`
    showed stopped; a lease without an engine or request id is not.
    InvalidInput for an ``api`` that is not a name.
    """
    validate_id("engine api", api)

    def abort(leases: Sequence[DeadLease]) -> Iterable[str]:
        todo = [d for d in leases if d.engine and d.request]
        if not todo:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
            done = list(pool.map(lambda d: abort_request(d.engine or "", d.request or "", api=api,
                                                         timeout_s=timeout_s), todo))
        return [d.lease_id for d, ok in zip(todo, done, strict=True) if ok]

    return abort


__all__ = ["APIS", "abort_request", "http_abort"]
