"""``tracestore demo``."""

from __future__ import annotations

import click

from . import guarded, main, url_option


@main.command()
@url_option
@click.option("--only", default=None,
              help="Run only the sections whose name contains this text "
              "(a text that matches none lists them).")
@click.option("--keep", is_flag=True,
              help="Keep each section's run on the server (default: deleted after its table).")
@guarded
def demo(url: str | None, only: str | None, keep: bool) -> None:
    """Run a short scripted scenario and print what it did, one table per section.

    Without --url/$TRACESTORE_URL it runs on this user's default server.
    Each section runs on a run of its own, deleted once its table is printed
    unless --keep.
    """
    from ..demo import run_demo
    from ..errors import InvalidInput

    try:
        run_demo(url, only=only, echo=click.echo, keep=keep)
    except InvalidInput as exc:
        if exc.field != "only":
            raise
        raise click.BadParameter(str(exc).split(": ", 1)[1], param_hint="'--only'") from None
