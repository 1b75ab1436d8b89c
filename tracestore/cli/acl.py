"""``tracestore acl``: the ACL grant of a run's writer or observer user, and ``--check`` of a user's (docs/security.md)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from .. import acl
from ..errors import StorageError
from ..store import TraceStore
from ..validate import validate_id, validate_run
from . import guarded, main, url_option


def _nodes(store: TraceStore) -> list[tuple[str, Any]]:
    """(name, target) of every node of the server (an ACL is per node; replicas too)."""
    c: Any = store.redis
    if not store.cluster:
        return [("", None)]
    return sorted(((n.name, n) for n in c.get_nodes()), key=lambda x: x[0])


def _ask(store: TraceStore, target: Any, *args: str) -> Any:
    c: Any = store.redis
    try:
        return c.execute_command(*args) if target is None else c.execute_command(*args, target_nodes=target)
    except Exception as exc:  # a redis-py error: name the node and what the connection may not do
        raise StorageError(f"{' '.join(args[:2])}: {type(exc).__name__}: {exc}") from exc


def _categories(store: TraceStore, target: Any) -> Callable[[str], set[str]]:
    """The commands of an ACL category on one node (``ACL CAT name``), asked once per category."""
    cats: dict[str, set[str]] = {}

    def members(cat: str) -> set[str]:
        if cat not in cats:
            got = _ask(store, target, "ACL", "CAT", cat)
            cats[cat] = {(x.decode() if isinstance(x, bytes) else str(x)).lower() for x in got}
        return cats[cat]

    return members


def _check(url: str | None, run: str, role: str, user: str, prefix: str) -> None:
    """Print what ``user`` lacks of ``role``'s grant on ``run``, per node; exit 1 when anything."""
    with TraceStore.connect(url, run=run, create_run=False, prefix=prefix) as store:
        lacking: dict[str, list[acl.Missing]] = {}
        for name, target in _nodes(store):
            reply = _ask(store, target, "ACL", "GETUSER", user)
            where = f" on {name}" if name else ""
            if reply is None:
                click.echo(f"no ACL user {user!r}{where}: create it with `tracestore acl {run} --role {role} "
                           f"--user {user}`", err=True)
                sys.exit(1)
            rules = acl.UserRules.from_getuser(reply)
            lacking[name] = acl.missing_grants(rules, run, role, _categories(store, target), prefix=prefix)
            if not rules.enabled:
                click.echo(f"user {user!r} is off{where} (ACL SETUSER {user} on)")
    missing = {m for ms in lacking.values() for m in ms}
    if not missing:
        click.echo(f"user {user!r} has every grant of the {role} role on run {run!r} "
                   f"({len(acl.commands(role))} commands, 3 key patterns)"
                   + (f" on {len(lacking)} nodes" if len(lacking) > 1 else ""))
        return
    for name, ms in lacking.items():
        for m in ms:
            click.echo(m.line() + (f" on {name}" if name else ""))
    order = [m for ms in lacking.values() for m in ms]
    click.echo("add them (on every node): " + acl.add_line(user, dict.fromkeys(order)))
    sys.exit(1)


@main.command("acl")
@click.argument("run")
@click.option("--role", type=click.Choice(acl.ROLES), default="writer", show_default=True,
              help="writer: the whole API on RUN; observer: reads only (keys granted read-only).")
@click.option("--user", default=None, help="ACL user name.  [default: RUN-ROLE]")
@click.option("--password", default="CHANGE-ME", show_default=True, help="The user's password.")
@click.option("--prefix", default="ts", show_default=True, help="Key prefix of the run.")
@click.option("--check", is_flag=True,
              help="Read --user's rules on the server (ACL GETUSER, every node) and print, one line each, "
                   "the key patterns and commands it lacks for ROLE in this version; exit 1 when any.")
@url_option
@guarded
def acl_command(run: str, role: str, user: str | None, password: str, prefix: str, check: bool,
                url: str | None) -> None:
    """Print the redis-cli command that creates RUN's ACL user for ROLE (or --check a user's).

    Run it on every node of the server (ACL users are per node): it grants the
    run's key patterns and exactly the commands tracestore sends, including
    those its Lua scripts call. Connect as that user with
    redis://USER:PASSWORD@host:port (an observer with create_run=False).
    After an upgrade, `--check --user U --url URL` (as a user allowed ACL
    GETUSER and ACL CAT) says what U lacks: a user granted by an earlier
    version may lack a key pattern or a command the new version needs.
    """
    validate_run(run)  # InvalidId: a usage error (exit 2), as for the two below
    if user is not None:
        validate_id("ACL user", user)  # it goes into redis://USER:PASSWORD@host:port
    if check:
        if user is None:
            raise click.UsageError("--check needs --user USER (the ACL user to check)")
        _check(url, run, role, user, prefix)
        return
    if not password:
        raise click.BadParameter("the user needs a password", param_hint="'--password'")
    click.echo(acl.grant_line(run, role, user=user or f"{run}-{role}", password=password, prefix=prefix))
