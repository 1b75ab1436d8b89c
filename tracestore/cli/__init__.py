"""The ``tracestore`` command line.

Commands are defined in the modules of this package; each module registers
its commands on :data:`main` when imported, so a new feature adds a module
(``tracestore/cli/gate.py`` -> ``tracestore gate ...``) without touching the
others. Options that name a server fall back to ``$TRACESTORE_URL``.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..errors import TracestoreError

if TYPE_CHECKING:
    from ..store import TraceStore

F = TypeVar("F", bound=Callable[..., Any])


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tracestore")
def main() -> None:
    """tracestore: a Redis-backed trace store for agentic RL.

    Multi-turn rollout traces, session ownership with exactly-once release
    events, the weight-update gate and the replay buffer, kept in Redis or a
    Redis Cluster. Every command that talks to a server takes --url (default:
    $TRACESTORE_URL, else an embedded server started for the command).
    """


def url_option(f: F) -> F:
    """``--url`` falling back to ``$TRACESTORE_URL`` (else the embedded server)."""
    return click.option(
        "--url",
        envvar="TRACESTORE_URL",
        show_envvar=True,
        default=None,
        help="Server URL: redis://, rediss:// (TLS), unix:// or redis+cluster://. "
        "Unset: an embedded valkey-server is started for this command.",
    )(f)


def run_option(f: F) -> F:
    """``--run`` falling back to ``$TRACESTORE_RUN``."""
    return click.option(
        "--run",
        envvar="TRACESTORE_RUN",
        show_envvar=True,
        default="default",
        show_default=True,
        help="Run id (namespace of keys ts:{RUN}:*).",
    )(f)


def connect(url: str | None, run: str) -> TraceStore:
    """A store of the existing run ``run`` (operator commands never create a run)."""
    from ..store import TraceStore

    return TraceStore.connect(url, run=run, create_run=False)


def fail(message: str, code: int = 1) -> None:
    """Print ``message`` to stderr and exit with ``code``."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def guarded(f: F) -> F:
    """Turn TracestoreError into a readable message and exit code 1."""
    import functools

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except TracestoreError as exc:
            fail(f"{type(exc).__name__}: {exc}")

    return wrapper  # type: ignore[return-value]


def _load_commands() -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_load_commands()
