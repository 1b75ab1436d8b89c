"""Connection URLs: the schemes tracestore accepts, their checks, and passwords masked for messages.

Schemes: ``redis://``, ``rediss://`` (TLS), ``unix://`` and
``redis+cluster://`` / ``rediss+cluster://``; a cluster URL may name several
seed nodes (``redis+cluster://h1:7001,h2:7002``). A URL's query accepts
``db`` and the TLS options (:data:`TLS_OPTIONS`), nothing else.
:func:`parse_url` checks a URL before anything connects (ConfigError);
:func:`mask_url` hides its password in messages and logs. No I/O here: the
connection (:mod:`tracestore.connection`) and the default server
(:mod:`tracestore.default_server`) both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from .errors import ConfigError

#: The URL schemes :func:`parse_url` accepts.
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


#: TLS options, as ``connect`` keywords and URL query parameters (redis-py's names).
TLS_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


#: The values of ``ssl_cert_reqs``.
CERT_REQS = ("required", "optional", "none")


@dataclass(frozen=True)
class ParsedUrl:
    """A validated connection URL."""

    url: str  # the URL redis-py receives (cluster scheme rewritten, query removed; the first seed)
    cluster: bool | None  # True: forced cluster; None: detect
    tls: bool
    display: str  # the URL with its password masked
    #: every seed ``(host, port)`` of a cluster URL naming several; empty otherwise
    seeds: tuple[tuple[str, int], ...] = ()
    options: dict[str, Any] = field(default_factory=dict)  # the URL's query options, checked


def _split_seeds(url: str) -> tuple[str, list[str]]:
    """``(url naming only its first host, every host[:port] of a comma-separated list)``."""
    scheme, sep, rest = url.partition("://")
    cut = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    end = min(cut) if cut else len(rest)
    userinfo, at, hosts = rest[:end].rpartition("@")
    seeds = hosts.split(",")
    if len(seeds) == 1:
        return url, []
    return f"{scheme}{sep}{userinfo}{at}{seeds[0]}{rest[end:]}", seeds


def _seed(scheme: str, item: str, shown: str) -> tuple[str, int]:
    try:
        parts = urlsplit(f"{scheme}://{item}")
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"malformed seed {item!r} in {shown!r}: {exc}") from None
    if not parts.hostname:
        raise ConfigError(f"empty seed in {shown!r}; expected host:port,host:port,...")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"port out of range in seed {item!r} of {shown!r}")
    return parts.hostname, port or 6379


def parse_url(url: str) -> ParsedUrl:
    """Validate ``url``; raise :class:`ConfigError` with a readable message.

    A cluster URL may list several seeds (``redis+cluster://h1:p1,h2:p2``).
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("empty connection URL; expected redis://host:port, rediss://, unix:// or redis+cluster://")
    first, seed_items = _split_seeds(url.strip())
    try:
        parts = urlsplit(first)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"malformed connection URL {mask_url(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"unsupported URL scheme {parts.scheme!r} in {mask_url(url)!r}; "
            f"use one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme == "unix":
        if not parts.path:
            raise ConfigError(f"unix:// URL without a socket path: {mask_url(url)!r}")
    elif not parts.hostname:
        raise ConfigError(f"URL without a host: {mask_url(url)!r}")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"port out of range in {mask_url(url)!r}")
    cluster: bool | None = None
    if scheme.endswith("+cluster"):
        cluster = True
        scheme = scheme.split("+", 1)[0]
    elif scheme == "unix":
        cluster = False
    seeds: tuple[tuple[str, int], ...] = ()
    if seed_items:
        if not cluster or scheme == "unix":
            raise ConfigError(
                f"{mask_url(url)!r} names several hosts; only a cluster URL may "
                f"(redis+cluster://h1:p1,h2:p2 or rediss+cluster://...)"
            )
        seeds = tuple(_seed(scheme, item, mask_url(url)) for item in seed_items)
    options = _url_options(parts.query, scheme == "rediss", mask_url(url))
    if scheme == "unix":
        rewritten = url.strip().split("?", 1)[0]  # urlunsplit would drop the '//' of an empty netloc
    else:
        rewritten = urlunsplit((scheme, parts.netloc, parts.path, "", ""))
    return ParsedUrl(rewritten, cluster, scheme == "rediss", mask_url(url), seeds, options)


def _url_options(query: str, tls: bool, shown: str) -> dict[str, Any]:
    """The URL's query parameters: TLS options and ``db``, checked; anything else is ConfigError."""
    out: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"malformed query string in {shown!r}") from None
    for name, value in pairs:
        if name in out:
            raise ConfigError(f"URL option {name!r} given twice in {shown!r}")
        if name == "db":
            if not value.isdigit() or int(value) > 1_000_000:
                raise ConfigError(f"URL option db must be a database number, got {value!r:.40}")
            out[name] = int(value)
        elif name in TLS_OPTIONS:
            if not tls:
                raise ConfigError(f"URL option {name!r} needs a TLS URL (rediss://), got {shown!r}")
            if name == "ssl_check_hostname":
                flag = value.lower()
                if flag not in ("true", "false", "1", "0", "yes", "no"):
                    raise ConfigError(f"URL option ssl_check_hostname must be true or false, got {value!r:.40}")
                out[name] = flag in ("true", "1", "yes")
            else:
                out[name] = value
        else:
            raise ConfigError(
                f"URL option {name!r} is not accepted (in {shown!r}): tracestore sets the protocol, "
                "decoding and timeouts itself (pass timeouts as connect keywords, e.g. "
                f"socket_timeout_s=5); the URL accepts db and {', '.join(TLS_OPTIONS)}"
            )
    if "ssl_cert_reqs" in out and out["ssl_cert_reqs"] not in CERT_REQS:
        raise ConfigError(f"URL option ssl_cert_reqs must be one of {', '.join(CERT_REQS)}")
    return out


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
            return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        pass
    return url
