"""The ``tracestore`` command line.

Commands are defined in the modules of this package; each module registers
its commands on :data:`main` when imported, so a new feature adds a module
(``tracestore/cli/gate.py`` -> ``tracestore gate ...``) without touching the
others. Options that name a server fall back to ``$TRACESTORE_URL``.

Every error is one line on stderr (``error: ...``) with advice in CLI terms,
never a traceback: usage mistakes exit 2 (a bad option value, a malformed id
or URL, a URL naming the wrong kind of server: :func:`exit_code`), failures
exit 1, Ctrl-C exits 130.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from ..errors import (
    ConfigError,
    GatePoisoned,
    InvalidId,
    NotDrained,
    RunInUse,
    RunNotEmpty,
    RunRecordMissing,
    StaleVersion,
    TracestoreError,
)

if TYPE_CHECKING:
    from ..store import TraceStore

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _advice(exc: TracestoreError) -> str:
    """The error's message, with the library's advice replaced by the CLI's."""
    if isinstance(exc, NotDrained):
        return (
            f"cannot install: gate is {exc.state} with {exc.live} live lease(s); "
            "run `tracestore gate seal` and `tracestore gate drain` first"
        )
    if isinstance(exc, GatePoisoned):
        ids = " ".join(exc.lease_ids[:5]) + (" ..." if len(exc.lease_ids) > 5 else "")
        return (
            f"{len(exc.lease_ids)} poisoned lease(s) block install ({ids}); resolve them with "
            "`tracestore gate clear-poison --resolution WHAT LEASE_ID...` (or --all)"
        )
    if isinstance(exc, StaleVersion):
        return (
            f"cannot install version {exc.requested}: the gate is at version {exc.current} "
            "(versions must increase; see `tracestore gate status`)"
        )
    if isinstance(exc, RunNotEmpty):
        return (
            f"run {exc.run!r} is not empty; load into a new run (--run NEW) or delete it with "
            f"`tracestore run delete {exc.run}`"
        )
    if isinstance(exc, RunRecordMissing):
        return (
            f"run {exc.run!r} has no record (ts:{{{exc.run}}}:meta is gone: the server restarted or "
            f"was flushed while a client wrote to it), but {exc.keys} of its keys remain "
            f"({exc.control_keys} control keys, {exc.data_keys} data keys of {exc.sessions} sessions, "
            f"{exc.turn_shards} turn counter shards); add --force to remove them"
        )
    if isinstance(exc, RunInUse):
        shown = ", ".join(f"{o} ({n})" for o, n in exc.owners[:5])
        return (
            f"run {exc.run!r} is in use: live owners hold sessions: {shown}; stop them "
            "(`tracestore gc` releases those whose heartbeat expired), or add --force"
        )
    return str(exc)


def error_line(exc: BaseException) -> str:
    """The one line printed for ``exc`` (without the ``error:`` prefix)."""
    from ..errors import ServerError, StorageError

    text = " ".join((_advice(exc) if isinstance(exc, TracestoreError) else str(exc)).split())
    if isinstance(exc, (ConfigError, ServerError, StorageError)) or not isinstance(
        exc, TracestoreError
    ):
        return text
    return f"{type(exc).__name__}: {text}"


def exit_code(exc: TracestoreError) -> int:
    """The exit code of a command that failed with ``exc``: 2 for a usage error, else 1.

    A malformed id (:class:`~tracestore.errors.InvalidId`, always raised
    before any I/O) and a bad URL or option (:class:`~tracestore.errors.ConfigError`:
    an unknown scheme, a port out of range, a URL naming a standalone server
    as a cluster or a plain one as TLS) are the command line's mistakes.
    """
    return EXIT_USAGE if isinstance(exc, (InvalidId, ConfigError)) else EXIT_FAILURE


class Cli(click.Group):
    """The top-level group: one-line errors instead of tracebacks and usage blocks."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
            fail(f"{exc.format_message()}{where}", EXIT_USAGE)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except (click.Abort, KeyboardInterrupt):
            click.echo("", err=True)
            fail("interrupted", EXIT_INTERRUPTED)
        except TracestoreError as exc:
            fail(error_line(exc), exit_code(exc))
        except BrokenPipeError:  # `tracestore runs | head`
            sys.stderr.close()
            sys.exit(EXIT_FAILURE)
        except Exception as exc:
            # redis-py errors that escaped the library's wrapping: still one line
            from redis.exceptions import RedisClusterException, RedisError

            if isinstance(exc, (RedisError, RedisClusterException)):
                fail(f"{type(exc).__name__}: {' '.join(str(exc).split())}")
            raise
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(
    cls=Cli,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="tracestore")
def main() -> None:
    """tracestore: a Redis-backed trace store for agentic RL.

    Multi-turn rollout traces, session ownership with exactly-once release
    events, the weight-update gate and the replay buffer, kept in Redis or a
    Redis Cluster. Every command that talks to a server takes --url (default:
    $TRACESTORE_URL, else this user's default server, started on first use
    and shared by every process; `tracestore server status|stop`).
    """


def url_option(f: F) -> F:
    """``--url`` falling back to ``$TRACESTORE_URL`` (else the default server)."""
    return click.option(
        "--url",
        envvar="TRACESTORE_URL",
        show_envvar=True,
        default=None,
        help="Server URL: redis://, rediss:// (TLS), unix:// or redis+cluster://. "
        "Unset: this user's default server (one per machine and user, started on first use).",
    )(f)


def run_option(f: F) -> F:
    """``--run`` falling back to ``$TRACESTORE_RUN``, else the only run on the server."""
    return click.option(
        "--run",
        envvar="TRACESTORE_RUN",
        show_envvar=True,
        default=None,
        help="Run id (keys ts:{RUN}:*). Default: the only run on the server; "
        "`tracestore runs` lists them.",
    )(f)


def json_option(f: F) -> F:
    """``--json``: print the command's result as JSON instead of a table."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


class RunNotChosen(click.ClickException):
    """No run given and not exactly one on the server, or the given run does not exist (exit 2)."""

    exit_code = EXIT_USAGE


def echo_json(doc: Any) -> None:
    """Print ``doc`` (dataclasses, lists, dicts) as indented JSON: what ``--json`` prints."""
    import orjson

    click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())


def _run_list(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def connect(url: str | None, run: str | None) -> TraceStore:
    """A store of an existing run: ``run``, else the only run on the server.

    Operator commands never create a run. Raises :class:`RunNotChosen`
    (exit 2) naming the candidates when ``run`` is not given and the server
    holds several runs (or none), and when ``run`` does not exist there.
    """
    from ..scripts import Cmd
    from ..store import TraceStore

    store = TraceStore.connect(url, run=run or "default", create_run=False)
    try:
        meta = store.keys.meta
        if run is not None and store.execute(Cmd(("EXISTS", meta), key=meta)):
            return store  # one round trip; the SCAN for candidates only when needed
        runs = store.run_ids()
    except BaseException:
        store.close()
        raise
    if run is not None:
        try:
            raise no_run(store, run, runs)
        finally:
            store.close()
    store.close()
    where = store.url
    if not runs:
        raise RunNotChosen(f"no run on {where} (start one with `tracestore train`, or give --url)")
    if len(runs) > 1:
        raise RunNotChosen(
            f"{len(runs)} runs on {where}: {_run_list(runs)}; choose one with --run "
            "(or $TRACESTORE_RUN)"
        )
    return TraceStore.connect(url, run=runs[0], create_run=False)


def no_run(store: TraceStore, run: str, runs: Sequence[str] | None = None) -> click.ClickException:
    """The error for a command naming ``run``, which has no record on ``store``'s server.

    :class:`RunNotChosen` (exit 2) listing the runs there; when keys of the
    run remain without its record (the server restarted or was flushed while
    a client wrote to it), an error (exit 1) that counts them and gives the
    command that removes them. Reads only (a SCAN per key family).
    """
    from ..runs import run_keys

    left = store.run(run_keys(store.context))
    if left.total:
        return click.ClickException(  # exit 1: the run exists in part, it is no usage error
            f"run {run!r} on {store.url} has no record (ts:{{{run}}}:meta is gone: the server "
            f"restarted or was flushed while a client wrote to it), but {left.total} of its keys "
            f"remain ({left.describe()}); `tracestore run delete {run} --force` removes them"
        )
    names = store.run_ids() if runs is None else runs
    known = f"runs there: {_run_list(names)}" if names else "it holds no run"
    return RunNotChosen(f"no run {run!r} on {store.url}; {known}")


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print ``error: message`` (one line) to stderr and exit with ``code``."""
    click.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(code)


def guarded(f: F) -> F:
    """Turn TracestoreError into a one-line message and its exit code (:func:`exit_code`).

    Kept for commands invoked outside :data:`main` (``python -m trainer``);
    :class:`Cli` does the same for every command it runs.
    """

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except TracestoreError as exc:
            fail(error_line(exc), exit_code(exc))

    return wrapper  # type: ignore[return-value]


def _load_commands() -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_load_commands()
