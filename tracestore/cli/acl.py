"""``tracestore acl``: the ACL grant of a run's writer or observer user (docs/security.md)."""

from __future__ import annotations

import click

from .. import acl
from ..validate import validate_id, validate_run
from . import guarded, main


@main.command("acl")
@click.argument("run")
@click.option("--role", type=click.Choice(acl.ROLES), default="writer", show_default=True,
              help="writer: the whole API on RUN; observer: reads only (keys granted read-only).")
@click.option("--user", default=None, help="ACL user name.  [default: RUN-ROLE]")
@click.option("--password", default="CHANGE-ME", show_default=True, help="The user's password.")
@click.option("--prefix", default="ts", show_default=True, help="Key prefix of the run.")
@guarded
def acl_command(run: str, role: str, user: str | None, password: str, prefix: str) -> None:
    """Print the redis-cli command that creates RUN's ACL user for ROLE.

    Run it on every node of the server (ACL users are per node): it grants the
    run's key patterns and exactly the commands tracestore sends, including
    those its Lua scripts call. Connect as that user with
    redis://USER:PASSWORD@host:port (an observer with create_run=False).
    """
    validate_run(run)  # InvalidId: a usage error (exit 2), as for the two below
    if user is not None:
        validate_id("ACL user", user)  # it goes into redis://USER:PASSWORD@host:port
    if not password:
        raise click.BadParameter("the user needs a password", param_hint="'--password'")
    click.echo(acl.grant_line(run, role, user=user or f"{run}-{role}", password=password, prefix=prefix))
