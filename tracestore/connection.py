"""Connection URLs, timeouts and the retry policy.

Schemes: ``redis://``, ``rediss://`` (TLS), ``unix://`` and
``redis+cluster://`` / ``rediss+cluster://``. A ``redis://`` URL that points
at a cluster node is detected with ``INFO cluster`` and connected as a
cluster. User and password come from the URL (``redis://user:pass@host``).

The retry policy is explicit: ``retries`` attempts (default 3) with
exponential backoff on connection errors and timeouts only. Every mutating
script is idempotent under such a retry (DESIGN section 5, invariant 6).
RESP2 is pinned so reply shapes do not change with the server's default.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .errors import ConfigError, StorageError

ENV_URL = "TRACESTORE_URL"
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class ConnectionOptions:
    """Client options; every field has a safe default.

    ``retries``: attempts after the first on connection errors and timeouts.
    ``socket_timeout_s``/``connect_timeout_s``: per command and per connect.
    ``max_connections``: pool size per node.
    """

    retries: int = 3
    backoff_base_s: float = 0.02
    backoff_cap_s: float = 0.5
    socket_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    max_connections: int = 64
    health_check_interval_s: int = 30
    client_name: str = "tracestore"

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}")
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("timeouts must be positive")


@dataclass(frozen=True)
class ParsedUrl:
    """A validated connection URL."""

    url: str  # the URL redis-py receives (cluster scheme rewritten)
    cluster: bool | None  # True: forced cluster; None: detect
    tls: bool
    display: str  # the URL with its password masked


def parse_url(url: str) -> ParsedUrl:
    """Validate ``url``; raise :class:`ConfigError` with a readable message."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("empty connection URL; expected redis://host:port, rediss://, unix:// or redis+cluster://")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"malformed connection URL {_mask(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"unsupported URL scheme {parts.scheme!r} in {_mask(url)!r}; "
            f"use one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme == "unix":
        if not parts.path:
            raise ConfigError(f"unix:// URL without a socket path: {_mask(url)!r}")
    elif not parts.hostname:
        raise ConfigError(f"URL without a host: {_mask(url)!r}")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"port out of range in {_mask(url)!r}")
    cluster: bool | None = None
    if scheme.endswith("+cluster"):
        cluster = True
        scheme = scheme.split("+", 1)[0]
    elif scheme == "unix":
        cluster = False
    if scheme == "unix":
        rewritten = url.strip()  # urlunsplit would drop the '//' of an empty netloc
    else:
        rewritten = urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))
    return ParsedUrl(rewritten, cluster, scheme == "rediss", _mask(url))


def _mask(url: str) -> str:
    try:
        parts = urlsplit(url)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
            return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        pass
    return url


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
    from .default_server import ensure

    return ensure().url


def _retry(opts: ConnectionOptions) -> Retry:
    return Retry(
        ExponentialBackoff(cap=opts.backoff_cap_s, base=opts.backoff_base_s),
        opts.retries,
        supported_errors=(RedisConnectionError, RedisTimeoutError, ConnectionResetError),
    )


def _common(opts: ConnectionOptions) -> dict[str, Any]:
    return {
        "protocol": 2,
        "socket_timeout": opts.socket_timeout_s,
        "socket_connect_timeout": opts.connect_timeout_s,
        "retry": _retry(opts),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "client_name": opts.client_name,
    }


def _cluster_enabled(info: Any) -> bool:
    return int(info.get("cluster_enabled", 0)) == 1


def _unreachable(parsed: ParsedUrl, exc: RedisError) -> StorageError:
    return StorageError(f"cannot reach {parsed.display}: {type(exc).__name__}: {exc}")


def _detect_cluster(parsed: ParsedUrl, opts: ConnectionOptions) -> bool:
    if parsed.cluster is not None:
        return parsed.cluster
    probe = redis.Redis.from_url(parsed.url, **_common(replace(opts, retries=0)))
    try:
        return _cluster_enabled(probe.info("cluster"))
    except RedisError as exc:
        raise _unreachable(parsed, exc) from exc
    finally:
        probe.close()


async def _adetect_cluster(parsed: ParsedUrl, opts: ConnectionOptions) -> bool:
    if parsed.cluster is not None:
        return parsed.cluster
    common = _common(replace(opts, retries=0))
    common["retry"] = _async_retry(replace(opts, retries=0))
    probe = redis.asyncio.Redis.from_url(parsed.url, **common)
    try:
        return _cluster_enabled(await probe.info("cluster"))
    except RedisError as exc:
        raise _unreachable(parsed, exc) from exc
    finally:
        await probe.aclose()


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

    One round trip (``INFO cluster``) unless the scheme says cluster or unix.
    """
    opts = opts or ConnectionOptions()
    parsed = parse_url(resolve_url(url))
    cluster = _detect_cluster(parsed, opts)
    common = _common(opts)
    if cluster:
        common.pop("retry_on_error")
        client: Any = RedisCluster.from_url(parsed.url, **common, max_connections=opts.max_connections)
    else:
        client = redis.Redis.from_url(
            parsed.url,
            **common,
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
    common = _common(opts)
    common["retry"] = _async_retry(opts)
    if cluster:
        common.pop("retry_on_error")
        client: Any = AsyncRedisCluster.from_url(parsed.url, **common, max_connections=opts.max_connections)
    else:
        client = redis.asyncio.Redis.from_url(
            parsed.url,
            **common,
            max_connections=opts.max_connections,
            health_check_interval=opts.health_check_interval_s,
        )
    return client, cluster, parsed.display
