"""Free TCP ports on this machine, for servers started locally."""

from __future__ import annotations

import errno
import socket

from ..errors import ServerError


def _family(host: str) -> socket.AddressFamily:
    """Address family of ``host``; ServerError when it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ServerError(f"cannot listen on host {host!r}: {reason}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (and its +10000 cluster bus port too).

    Raises ServerError when ``host`` is not an address of this machine.
    """
    family = _family(host)
    for _ in range(100):
        with socket.socket(family) as s:
            try:
                s.bind((host, 0))
            except OSError as exc:
                raise ServerError(f"cannot listen on host {host!r}: {exc.strerror}") from None
            port = int(s.getsockname()[1])
        if port + 10000 < 65536 and port_is_free(port + 10000, host):
            return port
    raise ServerError("could not find a free port")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on ``host:port``.

    Raises ServerError when ``host`` is not an address of this machine (that
    is not "in use"), or the port is out of range.
    """
    if not 0 < port < 65536:
        raise ServerError(f"port {port} is out of range (1..65535)")
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except PermissionError:
            raise ServerError(f"port {port} needs privileges on this machine (use a port above 1023)") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise ServerError(f"cannot listen on {host!r} port {port}: {exc.strerror}") from None
    return True
