"""Server-rendered HTML of the viewer: the layout, the runs page, a run, an owner, a replay cell.

Plain HTML and inline CSS, one small inline script (:data:`SCRIPT`), inline
SVG plots (:mod:`.svg`): nothing is fetched from anywhere, so the pages work
offline. Every value from the store is escaped. Elements carry ``data-*``
attributes with the exact values (ids, versions, counts) so a page can be
checked mechanically against its JSON. The session and path pages are in
:mod:`.html_session`.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from . import svg
from .views import Overview, OwnerView, ReplayView, RunView

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#243447;color:#fff;padding:8px 16px}header a{color:#fff;text-decoration:none}
header .crumbs a{color:#cfe0f5}main{padding:8px 16px 32px}footer{color:#777;padding:8px 16px;font-size:12px}
h1{font-size:20px;margin:12px 0}h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;background:#fff;margin:4px 0}td,th{border:1px solid #e3e3e3;padding:3px 7px;
text-align:left;vertical-align:top}th{background:#f0f3f7;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#888}.ok{color:#2e7d32}.bad{color:#c62828}.warn{color:#b26a00}code{font-size:12px}
.pager a{margin-right:10px}.kv td:first-child{color:#555}.plot{background:#fff;border:1px solid #e3e3e3;margin:4px 0}
.toks{font:13px/1.9 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all}
.t{padding:1px 1px;border-radius:2px;cursor:default}.t.tr{border-bottom:2px solid #1b4f9c}.t.pr{opacity:.75}
.toks.ids .t .x{display:none}.toks:not(.ids) .t .i{display:none}.node h4{margin:10px 0 2px;font-size:13px}
td.txt{max-width:640px;white-space:pre-wrap;word-break:break-word;font:12px ui-monospace,Menlo,monospace}
.seg{font:12px ui-monospace,Menlo,monospace;color:#555;white-space:pre-wrap;word-break:break-word;
border-left:3px solid #dde3ea;padding-left:6px;margin:2px 0;max-height:8em;overflow:auto}
.cellplot{display:inline-block;margin-right:16px;vertical-align:top}.cellplot p{margin:2px 0}
#detail{position:fixed;right:12px;bottom:12px;background:#fff;border:1px solid #bbb;padding:6px 10px;
font:12px ui-monospace,monospace;display:none;max-width:420px}
"""

#: The one script: click a token to pin its details; toggle ids / text.
SCRIPT = """
document.addEventListener('click',function(e){var t=e.target.closest('.t');var d=document.getElementById('detail');
if(!t||!d)return;d.style.display='block';d.textContent=t.getAttribute('title');});
function toggleIds(){document.querySelectorAll('.toks').forEach(function(x){x.classList.toggle('ids');});}
"""


def esc(x: object) -> str:
    """``x`` as escaped HTML text (None as an em dash)."""
    return "—" if x is None else escape(str(x))


def q(x: str) -> str:
    """``x`` as one URL path segment (every reserved character escaped: ids may hold ``/``, ``?``, ``#``)."""
    return quote(x, safe="")


def href(path: str, **params: Any) -> str:
    """``path`` with query ``params`` (None values left out), attribute-escaped."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return escape(path + ("?" + query if query else ""))


def link(url: str, label: object) -> str:
    """An ``<a>`` to ``url`` (already escaped by :func:`href`) with text ``label``."""
    return f'<a href="{url}">{esc(label)}</a>'


def utc(ms: int | None) -> str:
    """``ms`` (server clock) as an ISO time in UTC."""
    if ms is None:
        return "—"
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def age(ms: int | None, now: int) -> str:
    """How long before ``now`` (or after, "in ...") ``ms`` was, with the absolute time on hover."""
    if ms is None:
        return '<span class="muted">—</span>'
    d = (now - ms) / 1000
    shown = _span(abs(d))
    return f'<span title="{utc(ms)}">{shown + " ago" if d >= 0 else "in " + shown}</span>'


def _span(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def nbytes(n: int | None) -> str:
    """A byte count, human-readable, exact on hover."""
    if n is None:
        return "—"
    v, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            break
        v /= 1024
    return f'<span title="{n} bytes">{v:.1f} {unit}</span>' if unit != "B" else f"{n} B"


def table(headers: Sequence[str], rows: Iterable[str], cls: str = "") -> str:
    """A table of pre-rendered ``<tr>`` rows."""
    c = f' class="{cls}"' if cls else ""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    return f"<table{c}><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def td(x: object, numeric: bool = False, raw: bool = False) -> str:
    """A cell; ``raw`` when ``x`` is HTML already."""
    inner = str(x) if raw else esc(x)
    return f'<td class="n">{inner}</td>' if numeric else f"<td>{inner}</td>"


def kv(pairs: Iterable[tuple[str, str]]) -> str:
    """A two-column table of label and (pre-rendered) value."""
    return '<table class="kv">' + "".join(f"<tr><td>{esc(k)}</td><td>{v}</td></tr>" for k, v in pairs) + "</table>"


def pager(path: str, page: int, pages: int, name: str = "page", **keep: Any) -> str:
    """Links to the previous and next page (``?page=N``)."""
    if pages <= 1:
        return ""
    parts = []
    if page > 1:
        parts.append(link(href(path, **keep, **{name: page - 1}), "‹ previous"))
    parts.append(f'<span class="muted">page {page} of {pages}</span>')
    if page < pages:
        parts.append(link(href(path, **keep, **{name: page + 1}), "next ›"))
    return f'<p class="pager">{" ".join(parts)}</p>'


def layout(title: str, crumbs: Sequence[tuple[str, str]], body: str, api: str, now_ms: int | None = None) -> str:
    """A whole page: header with breadcrumbs, ``body``, a footer linking the page's JSON (``api``)."""
    trail = " › ".join([link("/", "runs")] + [link(u, t) if u else esc(t) for t, u in crumbs])
    when = f" · server time {utc(now_ms)}" if now_ms is not None else ""
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{esc(title)} · tracestore</title><meta name=\"viewport\" content=\"width=device-width\">"
        f"<style>{CSS}</style></head><body><header><a href=\"/\"><b>tracestore</b></a> "
        f"<span class=\"crumbs\">{trail}</span></header><main><h1>{esc(title)}</h1>{body}</main>"
        f"<footer>Read-only view. This page as JSON: {link(api, api)}{when}</footer>"
        f"<div id=\"detail\"></div><script>{SCRIPT}</script></body></html>"
    )


def error_page(status: int, message: str) -> str:
    """The page of a request that failed: its status and the one-line error."""
    return layout(f"{status}", [], f'<p class="bad" id="error">{esc(message)}</p>', "/api/runs")


# -- pages ---------------------------------------------------------------------------------------------


def runs_page(ov: Overview) -> str:
    """``/``: one row per run."""
    rows = []
    for r in ov.runs:
        gate = f'<span class="{"warn" if r.gate_state == "sealed" else "ok"}">{esc(r.gate_state)}</span> v{r.gate_version}'
        rows.append(
            f'<tr data-run="{esc(r.run)}">' + td(link(href(f"/runs/{q(r.run)}"), r.run), raw=True)
            + td(age(r.created_ms, ov.server_ms), raw=True) + td(r.sessions_live, True)
            + td(r.sessions_opened, True) + td(r.sessions_released, True) + td(r.release_events, True)
            + td(f"{r.groups_put} / {r.groups_taken} / {r.groups_expired}", True) + td(gate, raw=True)
            + td(r.heartbeating, True) + td(age(r.last_activity_ms, ov.server_ms), raw=True)
            + td(nbytes(r.control_bytes), True, raw=True) + td(nbytes(r.node_used_memory), True, raw=True) + "</tr>"
        )
    listed = "fixed by --run" if ov.fixed_run else f"run list as of {age(ov.listed_ms, ov.server_ms)}"
    body = (
        f'<p>{ov.runs_total} run(s) on <code>{esc(ov.url)}</code> <span class="muted">({listed})</span></p>'
        + table(["run", "created", "live sessions", "opened", "released", "release events",
                 "groups put / taken / expired", "gate", "heartbeating owners", "last activity",
                 "control-plane memory", "server memory"], rows, "runs")
        + pager("/", ov.page, ov.pages)
        + '<p class="muted">Counters are exact (changed in the scripts that change what they count). '
        "Control-plane memory sums MEMORY USAGE of the run's aggregate keys; per-session records and trace "
        "data are not in it (docs/capacity.md). Server memory: used_memory of the node holding the run.</p>"
    )
    return layout("Runs", [], body, href("/api/runs", page=ov.page if ov.page > 1 else None), ov.server_ms)


def _gate(rv: RunView) -> str:
    g = rv.gate
    state = f'<span class="{"warn" if g.state == "sealed" else "ok"}" id="gate-state">{esc(g.state)}</span>'
    pairs = [("state", state), ("version", f'<span id="gate-version">{g.version}</span>'),
             ("live leases", str(g.live)), ("poisoned", f'<span class="{"bad" if g.poisoned else ""}">{g.poisoned}</span>'),
             ("last install", age(g.installed_ms, rv.server_ms))]
    if g.sealed_ms is not None:
        pairs.append(("sealed", age(g.sealed_ms, rv.server_ms)))
        pairs.append(("drained", age(g.drained_ms, rv.server_ms) if g.drained_ms else "not yet"))
    out = kv(pairs)
    if g.poison:
        out += table(["poisoned lease", "reason"], (f"<tr>{td(a)}{td(b)}</tr>" for a, b in g.poison))
    rows = []
    for c in rv.cycles:
        installed = ", ".join(f"v{v}" for v in c.installed) or '<span class="muted">nothing (reopened)</span>'
        rows.append(
            f'<tr class="cycle" data-sealed="{c.sealed_ms}" data-drain-ms="{c.drain_ms}" data-to="{c.version_to}">'
            + td(age(c.sealed_ms, rv.server_ms), raw=True) + td(c.live_at_seal, True)
            + td("—" if c.drain_ms is None else f"{c.drain_ms} ms", True)
            + td(f"v{c.version_from}") + td(installed, raw=True)
            + td("still sealed" if c.reopened_ms is None else f"{c.sealed_for_ms} ms", True) + "</tr>"
        )
    out += "<h3>Recent weight-update cycles</h3>"
    if rows:
        out += svg.timeline(rv.cycles, rv.server_ms)
        out += table(["sealed", "live at seal", "drain", "from", "installed", "sealed for"], rows, "cycles")
    else:
        out += '<p class="muted" id="no-cycles">No cycle in the gate\'s log.</p>'
    return out


def _owners(rv: RunView) -> str:
    base = f"/runs/{q(rv.run)}"
    rows = []
    for o in rv.owners:
        cls = {"alive": "ok", "expired": "bad", "lost": "bad"}.get(o.heartbeat, "muted")
        beat = f'<span class="{cls}">{esc(o.heartbeat)}</span>'
        rows.append(
            f'<tr class="owner" data-owner="{esc(o.owner)}" data-sessions="{o.sessions}">'
            + td(link(href(f"{base}/owners/{q(o.owner)}"), o.owner), raw=True) + td(o.sessions, True)
            + td(beat, raw=True) + td(age(o.deadline_ms, rv.server_ms), raw=True)
            + td(age(o.lost_ms, rv.server_ms), raw=True) + "</tr>"
        )
    listed = f'<p class="muted">{rv.owners_total} owner(s). Owners without a heartbeat as of the last background discovery, {age(rv.owners_listed_ms, rv.server_ms)}; counts are live.</p>'
    return (table(["owner", "live sessions", "heartbeat", "deadline", "lost"], rows, "owners")
            + pager(base, rv.owners_page, rv.owners_pages, "owners_page") + listed)


def _replay(rv: RunView) -> str:
    cells = [c for c in rv.replay if c.groups]
    if not cells:
        return '<p class="muted" id="replay-empty">The replay buffer holds no group.</p>'
    base = f"/runs/{q(rv.run)}/replay"
    rows, plots = [], []
    n = len(cells[0].staleness)
    names = [str(s) for s in range(n)] + [f"≥{n}"]
    for c in cells:
        rows.append(
            f'<tr class="cell" data-task="{esc(c.task)}" data-status="{esc(c.status)}" data-groups="{c.groups}">'
            + td(c.task) + td(c.status) + td(link(href(f"{base}/{q(c.task)}/{q(c.status)}"), c.groups), True, raw=True)
            + td(c.oldest_version, True) + td("—" if c.oldest_version is None else rv.gate.version - c.oldest_version, True)
            + td(nbytes(c.bytes), True, raw=True) + "</tr>"
        )
        plot = svg.histogram([*c.staleness, c.older], label=f"staleness of {c.task} {c.status}", names=names)
        if plot:
            plots.append(f'<div class="cellplot"><p><b>{esc(c.task)}</b> {esc(c.status)}: groups by staleness '
                         f"(versions behind v{rv.gate.version})</p>{plot}</div>")
    return table(["task", "status", "groups", "oldest version", "max staleness", "bytes"], rows, "replay") + "".join(plots)


def _events(rv: RunView) -> str:
    r = rv.rate
    bound = "at least " if r.lower_bound else ""
    head = (f'<p>{bound}<b id="event-rate">{r.per_s:.2f}</b> release events/s over the last {r.window_s:.0f} s '
            f'({r.in_window} events; from the newest {r.read} entries of the stream). '
            f'{rv.counters.get("release_events", 0)} events ever, {rv.released_total} tombstones kept.</p>')
    spark = svg.sparkline(r.buckets, r.bucket_s)
    if spark:
        head += f'<div>last {len(r.buckets) * r.bucket_s // 60} min, per {r.bucket_s} s: {spark}</div>'
    base = f"/runs/{q(rv.run)}/sessions"
    rows = (f'<tr class="event">{td(age(e.ms, rv.server_ms), raw=True)}'
            f'{td(link(href(f"{base}/{q(e.sid)}"), e.sid), raw=True)}{td(e.owner)}{td(e.reason)}</tr>' for e in rv.events)
    return head + (table(["released", "session", "owner", "reason"], rows, "events") if rv.events else "")


def run_page(rv: RunView) -> str:
    """``/runs/{run}``: counters, the gate and its cycles, owners, the replay buffer, releases."""
    c = rv.counters
    counters = kv([(k.replace("_", " "), f'<span data-counter="{esc(k)}">{v}</span>') for k, v in c.items()]
                  + [("created", age(rv.created_ms, rv.server_ms)),
                     ("control-plane memory", nbytes(rv.control_bytes)), ("server memory", nbytes(rv.node_used_memory))])
    body = (
        f'<form method="get" action="/runs/{esc(q(rv.run))}/go">Session id: <input name="sid" size="40"> '
        '<button>open</button></form>'
        f"<h2>Counters</h2>{counters}<h2>Gate</h2>{_gate(rv)}<h2>Owners</h2>{_owners(rv)}"
        f"<h2>Replay buffer</h2>{_replay(rv)}<h2>Releases</h2>{_events(rv)}"
    )
    return layout(f"Run {rv.run}", [(rv.run, "")], body, href(f"/api/runs/{q(rv.run)}"), rv.server_ms)


def owner_page(ov: OwnerView) -> str:
    """``/runs/{run}/owners/{owner}``: a page of the owner's live sessions."""
    base = f"/runs/{q(ov.run)}"
    rows = (
        f'<tr class="session" data-sid="{esc(s.sid)}">'
        + td(link(href(f"{base}/sessions/{q(s.sid)}"), s.sid), raw=True) + td(s.state) + td(s.born, True)
        + td(age(s.opened_ms, ov.server_ms), raw=True) + td(s.group) + td(s.nodes, True) + "</tr>"
        for s in ov.sessions
    )
    nxt = (link(href(f"{base}/owners/{q(ov.owner)}", cursor=ov.next_cursor), "next ›")
           if ov.next_cursor != "0" else '<span class="muted">last page</span>')
    first = link(href(f"{base}/owners/{q(ov.owner)}"), "‹ first") if ov.cursor != "0" else ""
    body = (
        f"<p>{ov.sessions_total} live session(s); heartbeat deadline {age(ov.deadline_ms, ov.server_ms)}.</p>"
        + table(["session", "state", "born (version)", "opened", "group", "nodes"], rows, "sessions")
        + f'<p class="pager">{first} {nxt}</p>'
    )
    return layout(f"Owner {ov.owner}", [(ov.run, base), (ov.owner, "")], body,
                  href(f"/api/runs/{q(ov.run)}/owners/{q(ov.owner)}", cursor=ov.cursor if ov.cursor != "0" else None),
                  ov.server_ms)


def replay_page(rv: ReplayView) -> str:
    """``/runs/{run}/replay/{task}/{status}``: a page of the cell's groups, FIFO order."""
    base = f"/runs/{q(rv.run)}"
    rows = (
        f'<tr class="group" data-gid="{esc(g.gid)}">' + td(g.gid) + td(g.seq, True) + td(g.min_version, True)
        + td(g.staleness, True) + td("yes" if g.retryable else "no")
        + td(" ".join(link(href(f"{base}/sessions/{q(s)}"), s) for s in g.sids), raw=True)
        + f'<td class="txt">{esc(g.payload)}</td></tr>'
        for g in rv.groups
    )
    per = max(1, len(rv.groups))
    page, pages = rv.offset // per + 1, max(1, -(-rv.total // per))
    path = f"{base}/replay/{q(rv.task)}/{q(rv.status)}"
    nav = []
    if rv.offset > 0:
        nav.append(link(href(path, offset=max(0, rv.offset - per)), "‹ previous"))
    if rv.offset + len(rv.groups) < rv.total:
        nav.append(link(href(path, offset=rv.offset + len(rv.groups)), "next ›"))
    body = (
        f"<p>{rv.total} group(s), staleness against gate version {rv.gate_version}; page {page} of {pages}.</p>"
        + table(["group", "seq", "min version", "staleness", "retryable", "sessions", "payload"], rows, "groups")
        + f'<p class="pager">{" ".join(nav)}</p>'
    )
    return layout(f"Replay {rv.task} / {rv.status}", [(rv.run, base), (f"replay {rv.task} {rv.status}", "")], body,
                  href(f"/api/runs/{q(rv.run)}/replay/{q(rv.task)}/{q(rv.status)}", offset=rv.offset or None),
                  rv.server_ms)


__all__ = [
    "age", "error_page", "esc", "href", "kv", "layout", "link", "nbytes", "owner_page", "pager", "q",
    "replay_page", "run_page", "runs_page", "table", "td", "utc",
]
