"""``tracestore runs`` and ``tracestore run delete``: the runs on a server (docs/design.md section 12)."""

from __future__ import annotations

import click

from ..formatting import format_table, human_bytes, human_time
from ..store import TraceStore
from . import RunNotChosen, echo_json, json_option, main, no_run, url_option


def _owners_cell(owners: tuple[str, ...], limit: int = 3) -> str:
    if not owners:
        return "-"
    return ", ".join(owners[:limit]) + (f" +{len(owners) - limit}" if len(owners) > limit else "")


@main.command("runs")
@url_option
@click.argument("names", nargs=-1, metavar="[RUN]...")
@json_option
def runs_command(url: str | None, names: tuple[str, ...], as_json: bool) -> None:
    """The runs on the server (or RUN...): created, live sessions, owners, last activity, memory, counts.

    Memory is what the run's control plane (keys ts:{RUN}:*, one hash slot)
    takes on the server; opened / released are the run's session counters
    (`store.stats()`, never changed by gc's trimming). Times are the server's clock; --json gives them raw
    (ms since the epoch). Each run costs a SCAN of its control plane: on a
    standalone server with many runs, name the ones to show.
    """
    with TraceStore.connect(url, run="default", create_run=False) as store:
        if names:
            missing = sorted(set(names) - set(store.run_ids()))
            if missing:
                raise RunNotChosen(f"no run {missing[0]!r} on {store.url}")
        runs = store.list_runs(list(names) if names else None)
    if as_json:
        echo_json(runs)
        return
    if not runs:
        click.echo(f"no run on {store.url} (`tracestore train` makes one)")
        return
    rows = [
        [
            r.run,
            human_time(r.created_ms, r.server_ms),
            r.live_sessions,
            _owners_cell(r.owners),
            ("heartbeat now" if r.heartbeating else human_time(r.last_activity_ms, r.server_ms)),
            f"{human_bytes(r.control_bytes)} in {r.control_keys} key{'s' if r.control_keys != 1 else ''}",
            f"{r.sessions_opened} / {r.sessions_released}",
        ]
        for r in runs
    ]
    click.echo(f"runs on {store.url}")
    click.echo(format_table(
        ["run", "created", "live sessions", "owners", "last activity", "control plane", "opened / released"],
        rows,
    ))


@main.group("run")
def run_group() -> None:
    """Operate on one run (`tracestore runs` lists them)."""


@run_group.command("delete")
@url_option
@click.argument("run")
@click.option("--force", is_flag=True,
              help="Delete even while live owners hold sessions (their next writes fail or recreate keys).")
@json_option
def run_delete(url: str | None, run: str, force: bool, as_json: bool) -> None:
    """Delete RUN: its control plane and every session's data; nothing of another run.

    Refused while owners that are still alive (heartbeat not expired, not
    declared lost) hold sessions of the run, unless --force. A run whose
    record (ts:{RUN}:meta) is gone while its keys remain (the server
    restarted or was flushed under a client that kept writing) is deleted
    only with --force, on every primary of a cluster.
    """
    with TraceStore.connect(url, run=run, create_run=False) as store:
        done = store.delete_run(force=force)
        if not done.had_record and not (done.control_keys or done.data_keys or done.turn_shards):
            raise no_run(store, run)
    if as_json:
        echo_json(done)
        return
    forced = f"; overrode live owners {', '.join(done.forced_owners)}" if done.forced_owners else ""
    record = "" if done.had_record else " (it had no record)"
    click.echo(
        f"deleted run {run!r}{record} from {store.url}: {done.control_keys} control keys, "
        f"{done.data_keys} data keys of {done.sessions} sessions, {done.turn_shards} turn counter "
        f"shards{forced}"
    )
