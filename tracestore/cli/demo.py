"""``tracestore demo``."""

from __future__ import annotations

import click

from . import guarded, main, url_option


@main.command()
@url_option
@click.option("--only", default=None, help="Run only the sections whose name contains this text.")
@guarded
def demo(url: str | None, only: str | None) -> None:
    """Run a short scripted scenario and print what it did, one table per section.

    Without --url/$TRACESTORE_URL it starts an embedded server for the run.
    """
    from ..demo import run_demo

    run_demo(url, only=only, echo=click.echo)
