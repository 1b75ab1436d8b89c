"""``tracestore replay stats`` and ``tracestore checkpoint save|load``.

Operator commands for the replay buffer of one run (docs/design.md section 7):
what is buffered per task and status, how old it is, how many bytes it
takes, and moving a whole run to or from a checkpoint file
(``docs/checkpoint.md``).
"""

from __future__ import annotations

from pathlib import Path

import click

from ..formatting import format_table
from . import connect, echo_json, fail, guarded, main, run_option, url_option


@main.group()
def replay() -> None:
    """Inspect the replay buffer of a run."""


@replay.command("stats")
@url_option
@run_option
@click.option("--task", default=None, help="Only this task.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@guarded
def replay_stats(url: str | None, run: str | None, task: str | None, as_json: bool) -> None:
    """Groups per task and status, oldest weight version, bytes of group records."""
    with connect(url, run) as store:
        cells = store.replay.stats(task)
    if as_json:
        echo_json(cells)
        return
    if not cells:
        click.echo(f"replay buffer of run {store.run_id!r} is empty (no task seen)")
        return
    rows = [
        [c.task, c.status, c.groups, "-" if c.oldest_version is None else c.oldest_version, c.bytes]
        for c in cells
    ]
    click.echo(format_table(["task", "status", "groups", "oldest version", "bytes"], rows))
    click.echo(f"total: {sum(c.groups for c in cells)} groups, {sum(c.bytes for c in cells)} bytes")


@main.group()
def checkpoint() -> None:
    """Save a run to a portable file, or load one into an empty run."""


@checkpoint.command("save")
@url_option
@run_option
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite PATH when it exists.")
@guarded
def checkpoint_save(url: str | None, run: str | None, path: Path, force: bool) -> None:
    """Write the run (control plane, replay groups, traces) to PATH.

    Refused when PATH exists, unless --force (the file is replaced only once
    the new one is complete).
    """
    if path.exists() and not force:
        fail(f"{path} exists ({_describe(path)}); add --force to overwrite it, or give another PATH")
    with connect(url, run) as store:
        info = store.checkpoint(path)
    click.echo(
        f"saved run {store.run_id!r} to {info.path}: {info.keys} control keys, {info.groups} groups, "
        f"{info.sessions} sessions, {info.nodes} nodes, {info.bytes} bytes"
    )


def _describe(path: Path) -> str:
    """What the file at ``path`` is, for the refusal to overwrite it."""
    from ..checkpoint import read_header
    from ..errors import InvalidInput

    try:
        head = read_header(path)
    except InvalidInput:
        return "not a tracestore checkpoint"
    return f"a checkpoint of run {head.get('run')!r}"


@checkpoint.command("load")
@url_option
@run_option
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@guarded
def checkpoint_load(url: str | None, run: str | None, path: Path) -> None:
    """Restore PATH into a run that is empty or new (expert keys are marked lost).

    --run defaults to the run the checkpoint was saved from.
    """
    from ..checkpoint import read_header
    from ..store import TraceStore

    run = run or str(read_header(path)["run"])
    with TraceStore.connect(url, run=run, create_run=False) as store:
        info = store.restore(path)
    click.echo(
        f"loaded {info.path} into run {run!r}: {info.groups} groups, {info.sessions} sessions, "
        f"{info.nodes} nodes; {info.lost_expert_keys} expert keys marked lost"
    )
