"""``tracestore gc`` and ``tracestore sessions``: the control plane from the shell.

``gc`` runs one garbage-collection pass over a run (DESIGN section 5): it
releases the sessions of owners whose heartbeat expired, purges data left
behind by a crash between release and purge, reports orphan data, trims old
tombstones, removes consumer groups of holders gone too long and trims the
event stream. It is safe on a live run. ``sessions`` lists owners and their
live sessions.
"""

from __future__ import annotations

import sys

import click
import orjson

from ..formatting import format_table
from ..gc import EVENT_RETENTION_S, GROUP_IDLE_LIMIT_S, TOMBSTONE_RETENTION_S
from ..run import server_ms
from . import connect, echo_json, guarded, main, run_option, url_option


@main.command("gc")
@url_option
@run_option
@click.option(
    "--tombstone-retention",
    "tombstone_retention_s",
    type=float,
    default=TOMBSTONE_RETENTION_S,
    show_default=True,
    help="Seconds a released session id stays tombstoned (cannot be reopened).",
)
@click.option(
    "--group-idle-limit",
    "group_idle_limit_s",
    type=float,
    default=GROUP_IDLE_LIMIT_S,
    show_default=True,
    help="Seconds after which an idle consumer group of the event stream (a gone holder) is removed.",
)
@click.option(
    "--event-retention",
    "event_retention_s",
    type=float,
    default=EVENT_RETENTION_S,
    show_default=True,
    help="Seconds of events kept when no consumer group is left.",
)
@click.option("--no-scan", is_flag=True, help="Skip the SCAN for leftover and orphan data keys.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--check", is_flag=True, help="Exit 2 when orphan data was found.")
@guarded
def gc_command(
    url: str | None,
    run: str | None,
    tombstone_retention_s: float,
    group_idle_limit_s: float,
    event_retention_s: float,
    no_scan: bool,
    as_json: bool,
    check: bool,
) -> None:
    """Run one garbage-collection pass over a run and print what it did.

    Safe on a live run: it releases only sessions of owners whose heartbeat
    expired, and trims only what is final.
    """
    with connect(url, run) as store:
        report = store.gc(
            tombstone_retention_s=tombstone_retention_s,
            group_idle_limit_s=group_idle_limit_s,
            event_retention_s=event_retention_s,
            scan_data=not no_scan,
        )
    if as_json:
        echo_json(report)
    else:
        click.echo(format_table(["gc", "count"], report.summary()))
        for title, ids in (
            ("owners declared lost", report.owners_lost),
            ("orphan data (no control record)", report.orphan_sessions),
            ("consumer groups removed", report.groups_removed),
        ):
            if ids:
                shown = ", ".join(ids[:20]) + (f" ... (+{len(ids) - 20})" if len(ids) > 20 else "")
                click.echo(f"{title}: {shown}")
    if check and report.orphan_sessions:
        sys.exit(2)


@main.command("sessions")
@url_option
@run_option
@click.option("--owner", default=None, help="List the live session ids of this owner tag.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@guarded
def sessions_command(url: str | None, run: str | None, owner: str | None, as_json: bool) -> None:
    """Owners of a run (live sessions, heartbeat, lost mark), or one owner's session ids."""
    with connect(url, run) as store:
        if owner is not None:
            sids = store.sessions(owner)
            click.echo(orjson.dumps(sids).decode() if as_json else "\n".join(sids))
            return
        infos = store.owners()
        now = store.run(server_ms(store.context))  # server clock (ms)
    if not infos and not as_json:
        click.echo(f"run {store.run_id!r} has no owner")
        return
    if as_json:
        echo_json(infos)
        return
    rows = [
        [
            o.owner,
            o.sessions,
            "-" if o.deadline_ms is None else f"{(o.deadline_ms - now) / 1000:+.1f}s",
            "lost" if o.lost_ms is not None else "",
        ]
        for o in infos
    ]
    click.echo(format_table(["owner", "live sessions", "heartbeat deadline", "state"], rows))
