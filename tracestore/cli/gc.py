"""``tracestore gc`` and ``tracestore sessions``: the control plane from the shell.

``gc`` runs one garbage-collection pass over a run (docs/design.md section 5): it
resolves the gate leases of holders whose heartbeat stopped (each request
aborted at its engine over HTTP, then the lease settled ``aborted``),
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

from ..errors import RunRecordMissing
from ..formatting import format_table
from ..gate.aborts import APIS, http_abort
from ..gc import EVENT_RETENTION_S, GROUP_IDLE_LIMIT_S, HOLDER_RETENTION_S, TOMBSTONE_RETENTION_S
from ..run import server_ms
from ..runs import RunKeys, run_keys
from ..scripts import Cmd
from ..store import TraceStore
from . import connect, echo_json, guarded, main, no_run, run_option, url_option
from ._params import Seconds


@main.command("gc")
@url_option
@run_option
@click.option(
    "--tombstone-retention",
    "tombstone_retention_s",
    type=Seconds(allow_zero=True),
    default=TOMBSTONE_RETENTION_S,
    show_default=True,
    help="Seconds a released session id stays tombstoned (cannot be reopened).",
)
@click.option(
    "--group-idle-limit",
    "group_idle_limit_s",
    type=Seconds(allow_zero=True),
    default=GROUP_IDLE_LIMIT_S,
    show_default=True,
    help="Seconds after which an idle consumer group of the event stream (a gone holder) is removed.",
)
@click.option(
    "--event-retention",
    "event_retention_s",
    type=Seconds(allow_zero=True),
    default=EVENT_RETENTION_S,
    show_default=True,
    help="Seconds of events kept when no consumer group is left.",
)
@click.option(
    "--holder-retention",
    "holder_retention_s",
    type=Seconds(allow_zero=True),
    default=HOLDER_RETENTION_S,
    show_default=True,
    help="Seconds after which a dead lease holder that holds nothing is forgotten.",
)
@click.option("--engine-api", type=click.Choice(APIS), default="sglang", show_default=True,
              help="How to abort a dead holder's requests: sglang POST /abort_request; vllm (no abort "
                   "endpoint): only an engine that refuses connections counts as stopped.")
@click.option("--no-abort", is_flag=True,
              help="Do not resolve the leases of dead holders (no HTTP to engines); only count them.")
@click.option("--no-scan", is_flag=True, help="Skip the SCAN for leftover and orphan data keys.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--check",
    is_flag=True,
    help="Dry run: change nothing, report what a pass would do; exit 2 when orphan data was found.",
)
@click.option(
    "--force",
    is_flag=True,
    help="With --run naming a run whose record (ts:{RUN}:meta) is gone but whose keys remain "
    "(a server restarted under a client that kept writing): remove every key of it.",
)
@guarded
def gc_command(
    url: str | None,
    run: str | None,
    tombstone_retention_s: float,
    group_idle_limit_s: float,
    event_retention_s: float,
    holder_retention_s: float,
    engine_api: str,
    no_abort: bool,
    no_scan: bool,
    as_json: bool,
    check: bool,
    force: bool,
) -> None:
    """Run one garbage-collection pass over a run and print what it did.

    Safe on a live run: it settles only leases of holders whose heartbeat
    stopped, once their requests are shown stopped at their engines (abort
    confirmed, or the engine gone); it releases only sessions of owners
    whose heartbeat expired, and trims only what is final. With --check nothing changes: it
    prints what a pass would do. A run whose record is gone while its keys
    remain is no run to collect: --check counts its keys, --force removes
    them (as `tracestore run delete RUN --force`).
    """
    if run is not None:
        with TraceStore.connect(url, run=run, create_run=False) as store:
            meta = store.keys.meta
            if not store.execute(Cmd(("EXISTS", meta), key=meta)):
                _recordless(store, store.run(run_keys(store.context)), check=check, force=force,
                            as_json=as_json)
                return
    with connect(url, run) as store:
        report = store.gc(
            tombstone_retention_s=tombstone_retention_s,
            group_idle_limit_s=group_idle_limit_s,
            event_retention_s=event_retention_s,
            scan_data=not no_scan,
            dry_run=check,
            abort=None if no_abort or check else http_abort(engine_api),
            holder_retention_s=holder_retention_s,
        )
    if as_json:
        echo_json(report)
    else:
        if check:
            click.echo(f"dry run on run {store.run_id!r}: nothing was changed; a pass would do this")
        click.echo(format_table(["gc" + (" --check" if check else ""), "count"], report.summary()))
        for title, ids in (
            ("owners declared lost", report.owners_lost),
            ("orphan data (no control record)", report.orphan_sessions),
            ("consumer groups removed", report.groups_removed),
            ("leases of dead holders resolved", report.leases_resolved),
            ("leases of dead holders left (their requests not shown stopped)" if not check
             else "leases of dead holders to resolve",
             tuple(x for x in report.dead_holder_leases if x not in set(report.leases_resolved))),
        ):
            if ids:
                shown = ", ".join(ids[:20]) + (f" ... (+{len(ids) - 20})" if len(ids) > 20 else "")
                click.echo(f"{title}: {shown}")
    if check and report.orphan_sessions:
        sys.exit(2)


def _recordless(store: TraceStore, left: RunKeys, *, check: bool, force: bool, as_json: bool) -> None:
    """``gc --run R`` of a run without its record: count (--check), remove (--force) or refuse.

    No key of it: the run does not exist (exit 2). --check prints what
    --force would remove and exits 2 (all of it is orphan data).
    """
    run = left.run
    if not left.total:
        raise no_run(store, run)
    if check:
        if as_json:
            echo_json(left)
        else:
            click.echo(
                f"dry run: run {run!r} has no record (ts:{{{run}}}:meta is gone); "
                f"`tracestore gc --run {run} --force` would remove its {left.total} keys ({left.describe()})"
            )
        sys.exit(2)
    if not force:
        raise RunRecordMissing(run, left.control_keys, left.data_keys, left.sessions, left.turn_shards)
    done = store.delete_run(force=True)
    if as_json:
        echo_json(done)
        return
    click.echo(
        f"removed run {run!r} (it had no record) from {store.url}: {done.control_keys} control keys, "
        f"{done.data_keys} data keys of {done.sessions} sessions, {done.turn_shards} turn counter shards"
    )


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
