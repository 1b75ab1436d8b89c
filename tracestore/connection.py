"""Connecting: client options, timeouts, the retry policy and the clients for a URL.

URLs are parsed and masked in :mod:`tracestore.urls` (re-exported here).

Schemes: ``redis://``, ``rediss://`` (TLS), ``unix://`` and
``redis+cluster://`` / ``rediss+cluster://``. A ``redis://`` URL that points
at a cluster node is detected with ``INFO cluster`` and connected as a
cluster. A cluster URL may name several seed nodes
(``redis+cluster://h1:7001,h2:7002,h3:7003``): any one that answers is
enough to learn the cluster. User and password come from the URL
(``redis://user:pass@host``).

TLS options are ``connect`` keywords (``ssl_ca_certs``, ``ssl_certfile``,
``ssl_keyfile``, ``ssl_cert_reqs``, ``ssl_check_hostname``, ``ssl_ca_path``)
or URL query parameters of the same names (``rediss://h:6380?ssl_ca_certs=/ca.pem``);
the URL also accepts ``db``. Any other query parameter is refused
(ConfigError): redis-py would let ``?protocol=3`` or ``?decode_responses=yes``
override settings tracestore relies on.

The retry policy is explicit: ``retries`` attempts (default 3) with
exponential backoff on connection errors and timeouts only. Every mutating
script is idempotent under such a retry (DESIGN section 5, invariant 6).
RESP2 is pinned so reply shapes do not change with the server's default.

Timeouts are short (``socket_timeout_s`` 1 s): every command tracestore
sends answers in milliseconds, so a node that does not answer within a
second is treated as failed (retry, then a new slot map on a cluster) and a
hung primary costs about its failover time plus a second. Commands that
block on purpose read with their own timeout: ``drain``'s blocking pop
(its block time + 5 s) and the durability wait (``socket_timeout_s +
durability_timeout_s``). TCP keepalive is on, so a connection to a vanished
host is noticed while idle.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .default_server import ensure
from .errors import ConfigError, StorageError
from .urls import CERT_REQS as CERT_REQS
from .urls import SCHEMES as SCHEMES
from .urls import TLS_OPTIONS as TLS_OPTIONS
from .urls import ParsedUrl as ParsedUrl
from .urls import mask_url as mask_url
from .urls import parse_url as parse_url


def _load_hiredis_pack() -> Callable[[tuple[Any, ...]], bytes] | None:
    try:
        from hiredis import pack_command
    except ImportError:  # redis-py without hiredis: its pure-Python packer
        return None
    return cast("Callable[[tuple[Any, ...]], bytes]", pack_command)


_hiredis_pack = _load_hiredis_pack()

ENV_URL = "TRACESTORE_URL"


@dataclass(frozen=True)
class ConnectionOptions:
    """Client options; every field has a safe default.

    ``retries``: attempts after the first on connection errors and timeouts.
    ``socket_timeout_s``/``connect_timeout_s``: per command and per connect
    (short on purpose: see the module docstring; raise ``socket_timeout_s``
    for a server far away or overloaded). ``max_connections``: pool size per node.
    ``ssl_*``: TLS (a ``rediss://`` URL): CA bundle or directory, client
    certificate and key, ``ssl_cert_reqs`` (``required``, ``optional`` or
    ``none``) and ``ssl_check_hostname``; None leaves redis-py's default (or
    the URL's). Every field is checked on creation (ConfigError).
    """

    retries: int = 3
    backoff_base_s: float = 0.02
    backoff_cap_s: float = 0.5
    socket_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    max_connections: int = 64
    health_check_interval_s: int = 30
    client_name: str = "tracestore"
    ssl_ca_certs: str | None = None
    ssl_ca_path: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str | None = None
    ssl_check_hostname: bool | None = None

    def __post_init__(self) -> None:
        _check_options(self)

    @property
    def tls(self) -> dict[str, Any]:
        """The TLS keywords that were given (redis-py's names)."""
        return {f: getattr(self, f) for f in TLS_OPTIONS if getattr(self, f) is not None}


_CLIENT_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


def _number(name: str, v: object, lo: float, hi: float, *, integer: bool = False) -> None:
    ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float))
    if ok and isinstance(v, float):
        ok = math.isfinite(v)
    if not ok or not lo <= v <= hi:  # type: ignore[operator]
        kind = "an integer" if integer else "a number"
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
        raise ConfigError(f"{name} must be {kind} in {lo:g}..{hi:g}, got {shown}")


def _check_options(o: ConnectionOptions) -> None:
    """Every field of ``o`` of the right type and range; else ConfigError naming it."""
    _number("retries", o.retries, 0, 100, integer=True)
    _number("backoff_base_s", o.backoff_base_s, 0, 60)
    _number("backoff_cap_s", o.backoff_cap_s, 0, 600)
    _number("socket_timeout_s", o.socket_timeout_s, 0.001, 86400)
    _number("connect_timeout_s", o.connect_timeout_s, 0.001, 86400)
    _number("max_connections", o.max_connections, 1, 100_000, integer=True)
    _number("health_check_interval_s", o.health_check_interval_s, 0, 86400, integer=True)
    if not isinstance(o.client_name, str) or not 0 < len(o.client_name) <= 64 or not set(o.client_name) <= _CLIENT_NAME_OK:
        raise ConfigError(f"client_name must be 1..64 characters of [A-Za-z0-9._:-], got {o.client_name!r:.80}")
    for f in ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile"):
        v = getattr(o, f)
        if v is not None and (not isinstance(v, str) or not v or "\x00" in v):
            raise ConfigError(f"{f} must be a file path (str), got {v!r:.80}")
    if o.ssl_cert_reqs is not None and o.ssl_cert_reqs not in CERT_REQS:
        raise ConfigError(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}, got {o.ssl_cert_reqs!r:.80}")
    if o.ssl_check_hostname is not None and not isinstance(o.ssl_check_hostname, bool):
        raise ConfigError(f"ssl_check_hostname must be a bool, got {o.ssl_check_hostname!r:.80}")


def resolve_url(url: str | None) -> str:
    """``url``, else ``$TRACESTORE_URL``, else the default server of this user.

    The default server is one embedded server per machine and user, shared by
    every process and started on first use (:mod:`tracestore.default_server`).
    """
    if url:
        return url
    env = os.environ.get(ENV_URL)
    if env:
        return env
    return ensure().url


def _retry(opts: ConnectionOptions) -> Retry:
    return Retry(
        ExponentialBackoff(cap=opts.backoff_cap_s, base=opts.backoff_base_s),
        opts.retries,
        supported_errors=(RedisConnectionError, RedisTimeoutError, ConnectionResetError),
    )


def _common(opts: ConnectionOptions, parsed: ParsedUrl | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "protocol": 2,
        "socket_timeout": opts.socket_timeout_s,
        "socket_connect_timeout": opts.connect_timeout_s,
        "retry": _retry(opts),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "client_name": opts.client_name,
    }
    if parsed is not None:
        out.update(_url_and_tls(parsed, opts))
    return out


class FastPacker:
    """Packs a command with one ``hiredis.pack_command`` call on its arguments as they are.

    redis-py's hiredis packer first walks every argument in Python (to turn a
    bytearray or memoryview into bytes), which is most of the client's cost of
    a command with tens of thousands of arguments (the ``UNLINK`` and ``MSET``
    of a release's purge, the keys of a release script). A command hiredis
    refuses (a bytearray, a memoryview) or whose name redis-py would split
    (``"CONFIG RESETSTAT"``; any whitespace in a str name, leading or
    trailing too, a space in a bytes one) goes through
    redis-py's own packer, so the bytes on the wire are the same.
    """

    def __init__(self) -> None:
        from redis.connection import HiredisRespSerializer

        self._slow = HiredisRespSerializer()

    def pack(self, *args: Any) -> list[bytes]:
        """The RESP encoding of one command (a list of one bytes, as redis-py's packers return)."""
        head = args[0]
        if _hiredis_pack is not None and (
            # redis-py splits a str name at any whitespace, a bytes one only at spaces
            head.split() == [head] if isinstance(head, str) else isinstance(head, bytes) and b" " not in head
        ):
            try:
                return [_hiredis_pack(args)]
            except TypeError:  # a bytearray or memoryview argument
                pass
        out: list[bytes] = self._slow.pack(*args)
        return out


def fast_packer() -> FastPacker | None:
    """A :class:`FastPacker` when hiredis is there, else None (redis-py's default packer)."""
    return FastPacker() if _hiredis_pack is not None else None


def _fast_packer() -> dict[str, Any]:
    """``command_packer=FastPacker()`` when hiredis is there (redis-py's default packer otherwise)."""
    packer = fast_packer()
    return {"command_packer": packer} if packer is not None else {}


def _url_and_tls(parsed: ParsedUrl, opts: ConnectionOptions) -> dict[str, Any]:
    """The URL's options and the TLS keywords, merged; ConfigError when they disagree or need TLS."""
    tls = opts.tls
    if tls and not parsed.tls:
        raise ConfigError(f"TLS options {sorted(tls)} need a TLS URL (rediss://), got {parsed.display!r}")
    out = dict(parsed.options)
    for name, value in tls.items():
        if name in out and out[name] != value:
            raise ConfigError(f"{name} is given as a keyword ({value!r}) and in the URL ({out[name]!r})")
        out[name] = value
    return out


def failure_reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words that do not repeat the URL.

    redis-py's connection errors embed the address; the operating system's
    reason (``Connection refused``) is the useful part, kept on the chained
    ``OSError``.
    """
    if isinstance(exc, AuthenticationError):
        return "authentication failed (wrong or missing password; give it in the URL: redis://:PASSWORD@host:port)"
    if isinstance(exc, RedisTimeoutError):
        return "timed out"
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and not isinstance(cur, RedisError) and cur.strerror:
            return str(cur.strerror)
        cur = cur.__cause__ or cur.__context__
    return str(exc) or type(exc).__name__


def _unreachable(parsed: ParsedUrl, exc: BaseException) -> StorageError:
    reason = (failure_reason(exc).strip().splitlines() or [type(exc).__name__])[0]
    if "reachable node: " in reason:  # redis-py's cluster client names the last seed it tried
        reason = reason.split("reachable node: ", 1)[1]
    what = "any seed of " if len(parsed.seeds) > 1 else ""
    return StorageError(f"cannot reach {what}{parsed.display}: {reason}")


def _check_tls(parsed: ParsedUrl, opts: ConnectionOptions) -> None:
    """Raise ConfigError when a ``rediss://`` URL names a plain server (one short TCP probe).

    A TLS client would otherwise wait out a handshake that a plain server
    never answers (the whole connect timeout) and report no reason.
    """
    parts = urlsplit(parsed.url)
    if not parsed.tls or not parts.hostname:
        return
    try:
        timeout = min(1.0, opts.connect_timeout_s)
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            first = s.recv(1)
    except OSError:
        return  # unreachable, or a TLS server closing on plain text: let TLS decide
    if first in (b"+", b"-"):  # a RESP reply
        raise ConfigError(
            f"{parsed.display} is a plain (non-TLS) server: use redis:// instead of rediss://"
        )


def _cluster_enabled(parsed: ParsedUrl, info: Any) -> bool:
    enabled = int(info.get("cluster_enabled", 0)) == 1
    if parsed.cluster and not enabled:
        plain = parsed.display.replace("+cluster", "", 1)
        raise ConfigError(f"{parsed.display} is a standalone server, not a cluster node: use {plain}")
    return enabled


def _seed_urls(parsed: ParsedUrl) -> list[str]:
    """The URL of each seed of ``parsed`` (just ``parsed.url`` for a URL naming one host)."""
    if len(parsed.seeds) < 2:
        return [parsed.url]
    parts = urlsplit(parsed.url)
    user = parts.netloc.rpartition("@")[0]
    out = []
    for host, port in parsed.seeds:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        out.append(urlunsplit(parts._replace(netloc=f"{user}@{where}" if user else where)))
    return out


def _is_unix(parsed: ParsedUrl) -> bool:
    return urlsplit(parsed.url).scheme == "unix"


def detect_cluster(parsed: ParsedUrl, opts: ConnectionOptions) -> bool:
    """True when ``parsed`` names a cluster node (one ``INFO cluster`` round trip).

    Raises ConfigError when the URL cannot work as written (``rediss://`` to a
    plain server, ``redis+cluster://`` to a standalone one) and StorageError
    when the server cannot be reached. A unix socket is never a cluster node.
    """
    _check_tls(parsed, opts)
    if _is_unix(parsed):
        return False
    failed: RedisError | None = None
    for url in _seed_urls(parsed):  # any seed that answers will do
        probe = redis.Redis.from_url(url, **_common(replace(opts, retries=0), parsed))
        try:
            return _cluster_enabled(parsed, probe.info("cluster"))
        except RedisError as exc:
            failed = exc
        finally:
            probe.close()
    assert failed is not None
    raise _unreachable(parsed, failed) from failed


async def _adetect_cluster(parsed: ParsedUrl, opts: ConnectionOptions) -> bool:
    """The asyncio counterpart of :func:`detect_cluster` (the TLS probe runs in a thread)."""
    if parsed.tls:
        await asyncio.to_thread(_check_tls, parsed, opts)
    if _is_unix(parsed):
        return False
    common = _common(replace(opts, retries=0), parsed)
    common["retry"] = _async_retry(replace(opts, retries=0))
    failed: RedisError | None = None
    for url in _seed_urls(parsed):
        probe = redis.asyncio.Redis.from_url(url, **common)
        try:
            return _cluster_enabled(parsed, await probe.info("cluster"))
        except RedisError as exc:
            failed = exc
        finally:
            await probe.aclose()
    assert failed is not None
    raise _unreachable(parsed, failed) from failed


def _async_retry(opts: ConnectionOptions) -> AsyncRetry:
    # redis.asyncio awaits its retry object: the sync Retry would return the
    # coroutine unawaited from inside its loop, so a lost reply was never retried.
    return AsyncRetry(
        ExponentialBackoff(cap=opts.backoff_cap_s, base=opts.backoff_base_s),
        opts.retries,
        supported_errors=(RedisConnectionError, RedisTimeoutError),
    )


def sync_client(
    url: str | None = None, opts: ConnectionOptions | None = None
) -> tuple[redis.Redis | RedisCluster, bool, str]:
    """A redis-py client for ``url``: ``(client, is_cluster, masked_url)``.

    One round trip (``INFO cluster``) unless the URL is a unix socket.
    Raises ConfigError (bad URL, TLS to a plain server, cluster scheme to a
    standalone server) or StorageError (unreachable).
    """
    opts = opts or ConnectionOptions()
    parsed = parse_url(resolve_url(url))
    cluster = detect_cluster(parsed, opts)
    common = _common(opts, parsed)
    if not parsed.url.startswith("unix:"):
        common["socket_keepalive"] = True  # an idle connection to a vanished host is noticed
    if cluster:
        common.pop("retry_on_error")
        try:
            client: Any = RedisCluster.from_url(
                parsed.url,
                startup_nodes=[ClusterNode(h, p) for h, p in parsed.seeds[1:]],
                **common,
                max_connections=opts.max_connections,
            )
        except (RedisError, RedisClusterException) as exc:
            raise _unreachable(parsed, exc) from exc
    else:
        client = redis.Redis.from_url(
            parsed.url,
            **common,
            **_fast_packer(),
            max_connections=opts.max_connections,
            health_check_interval=opts.health_check_interval_s,
        )
    return client, cluster, parsed.display


async def async_client(
    url: str | None = None, opts: ConnectionOptions | None = None
) -> tuple[redis.asyncio.Redis | AsyncRedisCluster, bool, str]:
    """The asyncio counterpart of :func:`sync_client`; never blocks the event loop.

    Cluster detection is an asyncio round trip; finding (or starting) the
    embedded server when no URL is given runs in a worker thread.
    """
    opts = opts or ConnectionOptions()
    parsed = parse_url(url if url else await asyncio.to_thread(resolve_url, None))
    cluster = await _adetect_cluster(parsed, opts)
    common = _common(opts, parsed)
    common["retry"] = _async_retry(opts)
    if not parsed.url.startswith("unix:"):
        common["socket_keepalive"] = True
    if cluster:
        common.pop("retry_on_error")
        client: Any = AsyncRedisCluster.from_url(
            parsed.url,
            startup_nodes=[AsyncClusterNode(h, p) for h, p in parsed.seeds[1:]],
            **common,
            max_connections=opts.max_connections,
            health_check_interval=opts.health_check_interval_s,
        )
        try:
            await client.initialize()  # learn the slot map now: an unreachable cluster fails here
        except (RedisError, RedisClusterException) as exc:
            await client.aclose()
            raise _unreachable(parsed, exc) from exc
    else:
        client = redis.asyncio.Redis.from_url(
            parsed.url,
            **common,
            max_connections=opts.max_connections,
            health_check_interval=opts.health_check_interval_s,
        )
    return client, cluster, parsed.display
