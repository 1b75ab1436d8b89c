"""Sync and asyncio I/O layers: execute the requests that operations yield against Redis.

The stores drive operations (:mod:`tracestore.twin`); each request they
meet comes here. Both layers do the same four things, and nothing else:

* run :class:`~tracestore.scripts.Eval` with EVALSHA, and on NOSCRIPT (the
  script cache empties on restart and failover) re-run it once with EVAL,
  which also reloads the cache of that node;
* pipeline a :class:`~tracestore.scripts.Batch` (redis-py's cluster pipeline
  groups it by node; MOVED/ASK are followed by redis-py);
* strip the script status word and turn error results into typed errors;
* wrap redis-py exceptions into :class:`~tracestore.errors.StorageError`
  (connection, timeout) or :class:`~tracestore.errors.ScriptError`
  (a failing script), raised ``from`` the original.

(and they call a :class:`~tracestore.scripts.Blocking` request's function:
in place, or in a worker thread under asyncio).

With a durability level other than ``"none"`` (:mod:`tracestore.durability`),
a request holding a mutating script takes the *durable path*: per node, its
requests and then ``WAIT``/``WAITAOF`` are written on one pooled connection
of that node and read back in the same round trip; a mutating script whose
wait fell short answers :class:`~tracestore.errors.DurabilityUnconfirmed`.


The package is split by what it holds: :mod:`~tracestore.io.commands`
(requests as commands, replies and errors as results),
:mod:`~tracestore.io.durable` (the durable path), :mod:`~tracestore.io.sync_io`
(:class:`SyncIO`) and :mod:`~tracestore.io.async_io` (:class:`AsyncIO`).
"""

from __future__ import annotations

from .async_io import AsyncIO
from .commands import REDIS_ERRORS, decode_script_reply, wrap_error
from .sync_io import SyncIO

__all__ = ["REDIS_ERRORS", "AsyncIO", "SyncIO", "decode_script_reply", "wrap_error"]
