"""``tracestore gate status|seal|drain|install|reopen|clear-poison`` and ``tracestore routes``.

Operator commands for the request gate and session affinity of one run
(docs/design.md section 6). They work on a live run: sealing from the shell stops
admissions for every entrypoint of the run at once.
"""

from __future__ import annotations

import dataclasses
import sys

import click

from ..formatting import format_table, human_duration, human_time
from ..gate import DeadLease, GateStatus, PoisonEntry
from ..router import route_table
from ..store import TraceStore
from ..validate import MAX_VERSION, validate_id, validate_ids
from . import connect, echo_json, guarded, json_option, main, run_option, url_option
from ._params import Seconds


def _deadline(st: GateStatus) -> str:
    if not st.next_deadline_ms:
        return "-"
    left = st.next_deadline_ms - st.server_ms
    return f"in {human_duration(left)}" if left >= 0 else f"passed {human_duration(left)} ago"


def _status_rows(st: GateStatus) -> list[list[object]]:
    """The table of ``gate status``: times in local time with their age (raw ms with --json)."""
    return [
        ["state", st.state],
        ["version", st.version],
        ["live leases", st.live],
        ["poisoned leases", st.poisoned],
        ["sealed at", human_time(st.sealed_ms, st.server_ms)],
        ["installed at", human_time(st.installed_ms, st.server_ms)],
        ["next lease deadline", _deadline(st)],
        ["install possible now", "yes" if st.installable else "no"],
    ]


def poison_line(p: PoisonEntry) -> str:
    """One poisoned lease in one line: id, why and since when, and whom to ask (session, holder, engine, request)."""
    ago = "" if p.ago_ms is None else f" {human_duration(p.ago_ms)} ago"
    return (
        f"poisoned lease {p.lease_id}: {p.reason}{ago}; session {p.sid or '?'}, holder {p.holder or '?'}, "
        f"engine {p.engine or '-'}, request {p.request or '-'}, version {'?' if p.version is None else p.version}"
    )


def dead_line(d: DeadLease) -> str:
    """One live lease of a holder whose heartbeat stopped, in one line."""
    return (
        f"lease of a dead holder {d.lease_id}: {d.state}; holder {d.holder} stopped heart-beating "
        f"{human_duration(max(0, d.server_ms - d.holder_deadline_ms))} ago; session {d.sid}, "
        f"engine {d.engine or '-'}, request {d.request or '-'} (`tracestore gc` aborts and settles it)"
    )


def _echo_status(store: TraceStore, st: GateStatus, as_json: bool) -> None:
    poison = store.gate.poisoned_leases() if st.poisoned else []
    dead = store.gate.dead_holder_leases()
    if as_json:
        doc = {
            **dataclasses.asdict(st),
            "poisoned_leases": [{**dataclasses.asdict(p), "ago_ms": p.ago_ms} for p in poison],
            "dead_holder_leases": [dataclasses.asdict(d) for d in dead],
        }
        echo_json(doc)
        return
    click.echo(format_table(["gate", "value"], _status_rows(st)))
    if poison or dead:
        click.echo("")
    for p in poison:
        click.echo(poison_line(p))
    for d in dead:
        if d.state != "poisoned":  # (a poisoned one has its line above)
            click.echo(dead_line(d))


@main.group()
def gate() -> None:
    """Inspect and operate the request gate of a run (weight-update fencing)."""


@gate.command("status")
@url_option
@run_option
@click.option("--json", "as_json", is_flag=True,
              help="Print the status as JSON (times raw: ms since the epoch, server clock).")
@click.option("--check", is_flag=True, help="Exit 2 unless install would succeed now.")
@guarded
def gate_status(url: str | None, run: str | None, as_json: bool, check: bool) -> None:
    """State, version, live and poisoned leases: one line per poisoned lease.

    Each line names the lease, why its outcome is unknown (expired, unknown,
    overdue) and since when, its session, holder, engine and engine request
    id; live leases of holders whose heartbeat stopped get a line too.
    Times are shown in local time with their age, from the server's clock.
    """
    with connect(url, run) as store:
        st = store.gate.status()
        _echo_status(store, st, as_json)
    if check and not st.installable:
        sys.exit(2)


@gate.command("seal")
@url_option
@run_option
@click.option("--retry-after-ms", type=click.IntRange(1, 3_600_000), default=500, show_default=True,
              help="Retry hint that refused admissions carry.")
@guarded
def gate_seal(url: str | None, run: str | None, retry_after_ms: int) -> None:
    """Seal the gate: every admission is refused (GateSealed) until reopen."""
    with connect(url, run) as store:
        st = store.gate.seal(retry_after_ms)
        _echo_status(store, st, False)


@gate.command("drain")
@url_option
@run_option
@click.option("--timeout", "timeout_s", type=Seconds(allow_zero=True), default=60.0, show_default=True,
              help="Seconds to wait for live leases to settle.")
@guarded
def gate_drain(url: str | None, run: str | None, timeout_s: float) -> None:
    """Wait until no lease is live (or the timeout); exit 2 unless drained and unpoisoned."""
    with connect(url, run) as store:
        res = store.gate.drain(timeout_s)
    click.echo(format_table(["drain", "value"], [
        ["drained", "yes" if res.drained else "no"],
        ["live leases", res.live],
        ["poisoned leases", res.poisoned],
        ["poisoned by this drain", len(res.newly_poisoned)],
        ["waited (s)", round(res.waited_s, 3)],
        ["gate", f"{res.state}, version {res.version}"],
    ]))
    if res.poisoned_ids:
        click.echo("poisoned: " + " ".join(res.poisoned_ids))
    if not res.ok:
        sys.exit(2)


@gate.command("install")
@url_option
@run_option
@click.argument("version", type=click.IntRange(0, MAX_VERSION))
@guarded
def gate_install(url: str | None, run: str | None, version: int) -> None:
    """Install weight VERSION (the gate must be sealed, drained and unpoisoned)."""
    with connect(url, run) as store:
        prev = store.gate.install(version)
    click.echo(f"installed version {version} (was {prev})")


@gate.command("reopen")
@url_option
@run_option
@guarded
def gate_reopen(url: str | None, run: str | None) -> None:
    """Reopen the gate: admissions resume under the current version."""
    with connect(url, run) as store:
        st = store.gate.reopen()
        _echo_status(store, st, False)


@gate.command("clear-poison")
@url_option
@run_option
@click.argument("lease_ids", nargs=-1)
@click.option("--all", "clear_all", is_flag=True, help="Clear every poisoned lease.")
@click.option("--resolution", required=True,
              help="What happened to those requests (kept on the lease record), e.g. aborted.")
@guarded
def gate_clear_poison(url: str | None, run: str | None, lease_ids: tuple[str, ...], clear_all: bool,
                      resolution: str) -> None:
    """Resolve poisoned leases (LEASE_IDS, or --all) so install can proceed."""
    if not lease_ids and not clear_all:
        raise click.UsageError("give the LEASE_IDS to clear, or --all")
    validate_ids("lease id", list(lease_ids))  # InvalidId: exit 2, before any I/O
    validate_id("resolution", resolution)
    with connect(url, run) as store:
        ids = list(lease_ids)
        cleared = store.gate.clear_poison(ids, resolution) if ids else []
        while clear_all:  # status() lists the poison set 100 at a time
            batch = [p.lease_id for p in store.gate.status().poison]
            got = store.gate.clear_poison(batch, resolution) if batch else []
            ids += batch
            cleared += got
            if not got:
                break
        if not ids:
            click.echo("nothing to clear: no lease is poisoned")
            return
    click.echo(f"cleared {len(cleared)} of {len(ids)} lease(s): {' '.join(cleared)}")


@main.command()
@url_option
@run_option
@click.argument("sids", nargs=-1)
@json_option
@guarded
def routes(url: str | None, run: str | None, sids: tuple[str, ...], as_json: bool) -> None:
    """Session affinity: load per entrypoint, and the entrypoint of each of SIDS."""
    with connect(url, run) as store:
        table = store.run(route_table(store.context, list(sids)))
    if as_json:
        echo_json(table)
        return
    click.echo(format_table(["entrypoint", "sessions"], sorted(table.load.items())))
    click.echo(f"routed sessions: {table.routed}; retired (tombstoned): {table.retired}")
    if sids:
        click.echo("")
        rows = [[s, {None: "(not routed)", "!retired": "(retired: 410 Gone)"}.get(e, e)]
                for s, e in table.routes.items()]
        click.echo(format_table(["session", "entrypoint"], rows))
