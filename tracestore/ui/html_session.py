"""Server-rendered HTML of a session: its tree of nodes, and a path's per-token view.

The tree is a table in depth-first order, one row per node (``tr.node``
with ``data-num``, ``data-parent``, ``data-fork``...), indented by depth,
with the node's labels, version, expert key and text; branch points and
leaves are listed apart with links to each leaf's path. The path page shows
each token as a ``span.t`` with its id, label, logprob, version and
staleness in ``data-*`` attributes (and in its tooltip), coloured by
staleness and underlined when trained, grouped by node; plots of tokens per
turn and of the staleness of trained tokens sit above.
"""

from __future__ import annotations

from html import escape

from . import svg
from .html import age, esc, href, kv, layout, link, pager, q, table, td
from .views import NodeRow, PathView, SessionView, TokenRow

#: Indentation of the tree stops growing at this depth (a 10k-turn chain stays readable).
MAX_INDENT = 30


def _opt(x: object) -> str:
    return "" if x is None else escape(str(x))


def _node_row(run: str, sid: str, n: NodeRow) -> str:
    base = f"/runs/{q(run)}/sessions/{q(sid)}"
    pad = min(n.depth, MAX_INDENT) * 14
    text = "—" if n.text is None else escape(n.text)
    fork = f'<span class="warn">{esc(n.fork)}</span>' if n.fork else '<span class="muted">—</span>'
    num = link(href(f"{base}/path/{n.num}"), n.num)
    return (
        f'<tr class="node" data-num="{n.num}" data-id="{esc(n.id)}" data-parent="{_opt(n.parent)}" '
        f'data-depth="{n.depth}" data-end="{n.end}" data-tokens="{n.tokens}" data-labels="{esc(n.labels)}" '
        f'data-version="{n.version}" data-expert-key="{_opt(n.expert_key)}" data-fork="{_opt(n.fork)}" '
        f'data-children="{n.children}">'
        + td(num, raw=True) + td(n.parent) + td(n.depth, True) + td(n.end, True) + td(n.tokens, True)
        + td(n.labels) + td(n.version, True) + td(n.expert_key) + td(fork, raw=True) + td(n.children, True)
        + td(n.write_id) + f'<td class="txt" style="padding-left:{pad + 7}px">{text}</td></tr>'
    )


_NODE_HEADERS = ["node", "parent", "depth", "end", "tokens", "labels", "version", "expert key", "fork",
                 "children", "write", "text"]


def session_page(sv: SessionView) -> str:
    """``/runs/{run}/sessions/{sid}``: the session's record, branches, leaves and one page of its tree."""
    run_url = f"/runs/{q(sv.run)}"
    base = f"{run_url}/sessions/{q(sv.sid)}"
    owner = link(href(f"{run_url}/owners/{q(sv.owner)}"), sv.owner) if sv.owner else esc(None)
    facts = kv([
        ("state", f'<span id="state">{esc(sv.state)}</span>' + (" (trace data purged)" if sv.purged else "")),
        ("owner", owner), ("born (version)", esc(sv.born)), ("opened", age(sv.opened_ms, sv.server_ms)),
        ("group", esc(sv.group)), ("route", esc(sv.route)), ("released", age(sv.released_ms, sv.server_ms)),
        ("nodes", f'<span id="nodes-total">{sv.nodes_total}</span>'), ("tokens", f"{sv.tokens_total} ({sv.generated_total} generated)"),
        ("paths (leaves)", str(sv.leaves_total)), ("branch points", str(sv.branches_total)),
        ("index version", str(sv.index_version)),
    ])
    if not sv.nodes_total:
        body = facts + '<p class="muted" id="no-trace">No trace data.</p>'
        return layout(f"Session {sv.sid}", [(sv.run, run_url), (sv.sid, "")], body, href(f"/api{base}"), sv.server_ms)
    branches = table(
        ["at node", "end", "branches (child nodes)", "fork reasons"],
        (f'<tr class="branch" data-num="{b.num}" data-children="{" ".join(map(str, b.children))}">'
         + td(b.num, True) + td(b.end, True) + td(", ".join(map(str, b.children)))
         + td(", ".join(f or "—" for f in b.forks)) + "</tr>" for b in sv.branches),
        "branches",
    ) if sv.branches else '<p class="muted">One path: no branch.</p>'
    leaves = " ".join(
        f'<a class="leaf" data-num="{n}" href="{href(f"{base}/path/{n}")}">path to node {n}</a>' for n in sv.leaves
    )
    more = f' <span class="muted">(first {len(sv.leaves)} of {sv.leaves_total})</span>' if sv.leaves_total > len(sv.leaves) else ""
    body = (
        facts + f"<h2>Branches</h2>{branches}<h2>Paths</h2><p>{leaves}{more}</p>"
        + f"<h2>Nodes</h2>{pager(base, sv.page, sv.pages)}"
        + table(_NODE_HEADERS, (_node_row(sv.run, sv.sid, n) for n in sv.nodes), "tree")
        + pager(base, sv.page, sv.pages)
        + '<p class="muted">Depth first; a node\'s number links to the per-token view of the path from the root '
        "to it. Fork: why a node branched from its siblings, where the trace records it.</p>"
    )
    return layout(f"Session {sv.sid}", [(sv.run, run_url), (sv.sid, "")], body,
                  href(f"/api{base}", page=sv.page if sv.page > 1 else None), sv.server_ms)


def _token(t: TokenRow) -> str:
    trained = "1" if t.trained else "0"
    title = (f"#{t.i} id {t.id}{'' if t.text is None else ' ' + repr(t.text)} · "
             f"{'trained' if t.trained else 'prompt'} · logprob {t.logprob!r} · v{t.version} "
             f"(staleness {t.staleness}) · node {t.node}{'' if t.expert_key is None else ' · expert ' + t.expert_key}")
    shown = f'<span class="i">{t.id} </span>' + (f'<span class="x">{escape(t.text)}</span>' if t.text is not None else "")
    return (
        f'<span class="t {"tr" if t.trained else "pr"}" style="background:{svg.staleness_colour(t.staleness)}" '
        f'data-i="{t.i}" data-id="{t.id}" data-trained="{trained}" data-label="{t.label}" data-lp="{t.logprob!r}" '
        f'data-v="{t.version}" data-staleness="{t.staleness}" data-node="{t.node}" '
        f'data-ek="{_opt(t.expert_key)}" title="{escape(title)}">{shown}</span>'
    )


#: Most bars of the tokens-per-turn plot: a longer path shows consecutive turns summed per bar.
MAX_BARS = 240


def _turn_bars(pv: PathView) -> list[tuple[str, int, int]]:
    turns = pv.turns
    if len(turns) <= MAX_BARS:
        return [(str(b.turn), b.prompt, b.generated) for b in turns]
    per = -(-len(turns) // MAX_BARS)
    out = []
    for i in range(0, len(turns), per):
        part = turns[i : i + per]
        out.append((f"turns {part[0].turn}-{part[-1].turn}", sum(b.prompt for b in part), sum(b.generated for b in part)))
    return out


def path_page(pv: PathView) -> str:
    """``/runs/{run}/sessions/{sid}/path/{num}``: a window of the path's tokens, with plots of the whole path."""
    run_url = f"/runs/{q(pv.run)}"
    sess = f"{run_url}/sessions/{q(pv.sid)}"
    base = f"{sess}/path/{pv.num}"
    turns = svg.stacked_bars(_turn_bars(pv), label="tokens per turn")
    n = len(pv.staleness)
    stale = svg.histogram(list(pv.staleness), label="staleness of trained tokens",
                          names=[str(s) for s in range(n - 1)] + [f"≥{n - 1}"])
    facts = kv([
        ("nodes on the path", str(pv.path_nodes)), ("tokens", f'<span id="tokens-total">{pv.tokens_total}</span>'),
        ("trained tokens", str(pv.trained_total)), ("gate version", f'<span id="gate-version">{pv.gate_version}</span>'),
        ("tokenizer", esc(pv.tokenizer) if pv.tokenizer else '<span class="muted">none (token ids shown)</span>'),
    ])
    blocks = []
    by_node: dict[int, list[str]] = {}
    for t in pv.tokens:
        by_node.setdefault(t.node, []).append(_token(t))
    for node in pv.nodes:
        if node.num not in by_node:
            continue
        fork = f' · fork <span class="warn">{esc(node.fork)}</span>' if node.fork else ""
        blocks.append(
            f'<section class="node" data-num="{node.num}"><h4>node {node.num} · {esc(node.labels)} · '
            f'{node.tokens} tokens · v{node.version} (staleness {pv.gate_version - node.version})'
            f'{"" if node.expert_key is None else " · expert key " + esc(node.expert_key)}{fork}</h4>'
            + ("" if node.text is None else f'<div class="seg">{esc(node.text)}</div>')
            + f'<div class="toks{"" if pv.tokenizer else " ids"}">{"".join(by_node[node.num])}</div></section>'
        )
    nav = []
    if pv.offset > 0:
        nav.append(link(href(base, offset=max(0, pv.offset - pv.count), count=pv.count), "‹ previous tokens"))
    end = pv.offset + len(pv.tokens)
    nav.append(f'<span class="muted">tokens {pv.offset}..{max(pv.offset, end - 1)} of {pv.tokens_total}</span>')
    if end < pv.tokens_total:
        nav.append(link(href(base, offset=end, count=pv.count), "next tokens ›"))
    legend = ("<p class=\"muted\">Underlined: trained (label = token id); faded: prompt (label -100). Background: "
              "weight version's staleness against the gate, green (current) to red (8 or more behind). Hover or "
              'click a token for its id, logprob, version and expert key. <button onclick="toggleIds()">'
              "ids / text</button></p>")
    path_rows = table(_NODE_HEADERS, (_node_row(pv.run, pv.sid, n) for n in pv.nodes), "path")
    body = (
        facts + "<h2>Tokens per turn</h2>" + (turns or '<p class="muted">no tokens</p>')
        + "<h2>Staleness of trained tokens</h2>" + (stale or '<p class="muted">no trained token</p>')
        + f'<h2>Tokens</h2>{legend}<p class="pager">{" ".join(nav)}</p>{"".join(blocks)}'
        + f'<p class="pager">{" ".join(nav)}</p><h2>Nodes of these tokens</h2>{path_rows}'
    )
    return layout(f"Path to node {pv.num} of {pv.sid}", [(pv.run, run_url), (pv.sid, sess), (f"path {pv.num}", "")],
                  body, href(f"/api{base}", offset=pv.offset or None), pv.server_ms)


__all__ = ["path_page", "session_page"]
