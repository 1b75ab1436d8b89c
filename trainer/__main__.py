"""``python -m tracestore.trainer``: the same command as ``tracestore train``."""

from __future__ import annotations

from typing import Any

import click

from tracestore.cli.train import train_command, train_options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@train_options
def main(**kw: Any) -> None:
    """Run the reference agentic RL loop (see ``tracestore train --help``)."""
    train_command(**kw)


if __name__ == "__main__":
    main()
