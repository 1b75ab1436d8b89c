"""``tracestore trace``: one session's trace from the shell.

Prints the session's nodes as a tree (what ``HGETALL ts:{R/sid}:idx`` holds,
docs/traces.md, Reading a session by hand), with the reason of each fork
(``client_edit``, ``template``) and each node's segment text
when the run stores text; ``--export TEXT`` prints the training trace of the
node whose key is ``TEXT`` (``store.export_training_trace``), ``--node NUM``
that of node number ``NUM``.
"""

from __future__ import annotations

from typing import Any

import click
import orjson

from .. import codec, replies
from ..errors import InvalidInput
from ..formatting import format_table
from ..traces.index import SessionIndex
from ..traces.reads import read_path
from ..traces.types import Node
from . import connect, echo_json, guarded, main, run_option, url_option

#: Characters of a node's text shown in the table.
TEXT_CHARS = 48


def _labels(node: Node) -> str:
    if node.flags & codec.EXPLICIT_LABELS:
        return "explicit"
    return "generated" if node.flags & codec.GENERATED else "prompt"


def _tree(ix: SessionIndex) -> list[tuple[int, Node]]:
    """The nodes depth first (children by end, then number), each with its depth.

    CorruptData (naming the node) when a parent is not stored or the parents form a cycle.
    """
    for n in ix.nodes.values():
        ix.path(n)
    children: dict[str | None, list[Node]] = {}
    for n in ix.nodes.values():
        parent = n.parent if n.parent in ix.nodes else None
        children.setdefault(parent, []).append(n)
    for kids in children.values():
        kids.sort(key=lambda n: (n.end, ix.nums[n.id]))
    out: list[tuple[int, Node]] = []
    stack = [(0, n) for n in reversed(children.get(None, []))]
    while stack:
        depth, n = stack.pop()
        out.append((depth, n))
        stack.extend((depth + 1, c) for c in reversed(children.get(n.id, [])))
    return out


@main.command("trace")
@url_option
@run_option
@click.argument("sid")
@click.option("--export", "export_text", metavar="TEXT", default=None,
              help="Print the training trace of the node whose key is TEXT (the full text up to its end).")
@click.option("--node", "node_num", type=click.IntRange(min=1), default=None,
              help="Print the training trace of node number NUM (its key rebuilt from the stored texts).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@guarded
def trace_command(
    url: str | None, run: str | None, sid: str, export_text: str | None, node_num: int | None, as_json: bool
) -> None:
    """Print session SID's trace: its nodes as a tree, or one node's training trace.

    Each node: its number (its field in the tok and txt hashes), parent
    number, end (characters of its key), tokens, labels (prompt, generated
    or explicit), weight version, fork (why the node starts a branch:
    client_edit, template; - when it extends its parent's path), expert key,
    the id of the write that stored it, and its segment text when the run
    stores text. Reads only.
    A released session's data is purged: it has no trace to print.
    """
    if export_text is not None and node_num is not None:
        raise click.UsageError("give --export TEXT or --node NUM, not both")
    with connect(url, run) as store:
        if node_num is not None:
            ix, _, _ = store.run(read_path(store.context, sid, lambda _ix: None))
            texts = replies.field_map(store.redis.hgetall(store.keys.txt(sid))) if ix.nodes else {}
            export_text = _key_of(ix, node_num, texts, sid)
        if export_text is not None:
            tr = store.export_training_trace(sid, export_text)
            if as_json:
                echo_json(tr)
                return
            fields = [[f, str(v)] for f, v in (
                ("nodes", len(tr.nodes)),
                ("tokens", len(tr.input_ids)),
                ("trained tokens", sum(1 for x in tr.labels if x != -100)),
                ("versions", sorted(set(tr.versions))),
                ("expert keys", tr.expert_keys),
                ("input_ids", tr.input_ids),
                ("labels", tr.labels),
                ("logprobs", [round(x, 4) for x in tr.logprobs]),
            )]
            click.echo(format_table(["training trace", sid], fields))
            return
        ix, _, _ = store.run(read_path(store.context, sid, lambda _ix: None))
        texts = replies.field_map(store.redis.hgetall(store.keys.txt(sid))) if ix.nodes else {}
    tree = _tree(ix)
    if as_json:
        echo_json({
            "sid": sid, "epoch": ix.epoch, "index_version": ix.version, "chain": ix.chain or None,
            "nodes": [_node_json(ix, n, texts) for _, n in tree],
        })
        return
    if not ix.nodes:
        click.echo(f"session {sid!r} of run {store.run_id!r} has no trace data")
        return
    tokens = sum(n.ntok for n in ix.nodes.values())
    generated = sum(n.ntok for n in ix.nodes.values() if n.flags & codec.GENERATED)
    click.echo(
        f"session {sid!r} of run {store.run_id!r}: {len(ix.nodes)} nodes, {tokens} tokens "
        f"({generated} generated), index version {ix.version}, epoch {ix.epoch}"
    )
    rows: list[list[Any]] = []
    for depth, n in tree:
        text = _text(ix, n, texts)
        shown = "-" if text is None else orjson.dumps(
            text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 3] + "..."
        ).decode()
        parent = ix.nums.get(n.parent) if n.parent else None
        rows.append([
            ix.nums[n.id], "-" if parent is None else parent, n.end, n.ntok, _labels(n), n.version,
            n.fork or "-", n.expert_key or "-", n.wid or "-", "  " * depth + shown,
        ])
    click.echo(format_table(
        ["num", "parent", "end", "tokens", "labels", "version", "fork", "expert key", "write", "text"], rows
    ))


def _key_of(ix: SessionIndex, num: int, texts: dict[str, Any], sid: str) -> str:
    """The key of node ``num``: the stored texts of its path, joined; InvalidInput when it cannot be rebuilt."""
    by_num = {v: k for k, v in ix.nums.items()}
    if num not in by_num:
        raise InvalidInput("node", f"session {sid!r} has no node {num} (it has {len(ix.nodes)})")
    parts: list[str] = []
    for node in ix.path(ix.nodes[by_num[num]]):  # (CorruptData: a parent not stored, a cycle)
        text = _text(ix, node, texts)
        if text is None:
            raise InvalidInput(
                "node", f"node {ix.nums[node.id]} of session {sid!r} has no stored text (the run was "
                "written with store_text=False): give its key with --export TEXT"
            )
        parts.append(text)
    return "".join(parts)


def _text(ix: SessionIndex, n: Node, texts: dict[str, Any]) -> str | None:
    raw = texts.get(str(ix.nums[n.id]))
    return None if raw is None else replies.text(raw)


def _node_json(ix: SessionIndex, n: Node, texts: dict[str, Any]) -> dict[str, Any]:
    parent = ix.nums.get(n.parent) if n.parent else None
    return {
        "num": ix.nums[n.id], "id": n.id, "parent": parent, "end": n.end, "tokens": n.ntok,
        "labels": _labels(n), "version": n.version, "fork": n.fork, "expert_key": n.expert_key, "write_id": n.wid or None,
        "text": _text(ix, n, texts),
    }
