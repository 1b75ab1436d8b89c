"""The replay scripts' KEYS layout and the take policies: Python and Lua agree (issue 23, item 4).

One Python helper (``tracestore/replay/layout.py``: ``INDEXES``, ``task_keys``)
builds the cells of a task for every replay script wrapper, one Lua helper
(``rb_cells`` of ``lua/_lib/rb.lua``, with ``RB_INDEXES``) reads them; the take
policies are ``POLICIES`` in ``tracestore/replay/policies.py`` and the pickers
``RB_PICK.<name>`` in Lua. These tests compare the two sides and each script's
contract header with the keys its wrapper really sends (built by the wrapper,
no I/O), and show that a call whose layout disagrees with the script is refused
by the server with nothing written.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tracestore import InvalidInput, TraceStore
from tracestore.replay import Group, claim_retry, expire, put_request, take_many
from tracestore.replay.layout import INDEXES, task_keys
from tracestore.replay.policies import POLICIES
from tracestore.scripts import Batch, Eval, lua_dir, script

RB_LIB = (lua_dir() / "_lib" / "rb.lua").read_text()


def test_the_cell_indexes_are_the_same_in_python_and_lua() -> None:
    m = re.search(r"^local RB_INDEXES = \{(.*)\}$", RB_LIB, re.M)
    assert m, "lua/_lib/rb.lua defines no RB_INDEXES"
    assert tuple(re.findall(r"'(\w+)'", m.group(1))) == INDEXES


def test_every_take_policy_has_one_picker_and_one_entry() -> None:
    pickers = re.findall(r"^function RB_PICK\.(\w+)\(", RB_LIB, re.M)
    assert sorted(pickers) == sorted(POLICIES) and len(pickers) == len(set(pickers))
    for name, pol in POLICIES.items():
        assert pol.name == name and pol.reads and set(pol.reads) <= set(INDEXES)
        body = RB_LIB.split(f"function RB_PICK.{name}(", 1)[1].split("\nend\n", 1)[0]
        assert {i for i in INDEXES if f"c.{i}" in body} <= set(pol.reads), f"{name} reads an index it does not list"


def _header(name: str) -> tuple[list[re.Pattern[str]], list[str]]:
    """A replay script's fixed keys (each ``-- KEYS[i] = pattern`` line, ``<x>`` any id) and CELLS."""
    src = script(name).source.split("-- begin include")[0]
    fixed: list[re.Pattern[str]] = []
    for i, pat in re.findall(r"^-- KEYS\[(\d+)\] = (\S+)", src, re.M):
        assert int(i) == len(fixed) + 1, f"{name}: KEYS[{i}] out of order"
        parts = re.split(r"(<[^>]+>)", pat)
        fixed.append(re.compile("".join(r"[^{}\s]+" if p.startswith("<") else re.escape(p) for p in parts) + "$"))
    cells = re.search(r"^-- CELLS: (.+)$", src, re.M)
    assert cells, f"{name}: no '-- CELLS:' line"
    return fixed, cells.group(1).split()


def _first_eval(op: Iterator[Any]) -> Eval:
    req = next(op)
    if isinstance(req, Batch):
        req = req.requests[0]
    assert isinstance(req, Eval)
    return req


def _calls(store: TraceStore) -> dict[str, tuple[Eval, list[tuple[str, str]]]]:
    """Each replay script's call as its wrapper builds it, with the (task, status) of each cell."""
    ctx = store.context
    g = Group("g1", "math", ("s1", "s2"), status="aborted", min_version=0, payload={"priority": 2})
    return {
        "rb_put": (put_request(ctx, g, "rollout:0"), [("math", "aborted"), ("math", "expired")]),
        "rb_take": (
            _first_eval(take_many(ctx, {"math": 1, "code": 2}, owner="train:0", policy="priority")),
            [("math", "completed"), ("math", "expired"), ("code", "completed"), ("code", "expired")],
        ),
        "rb_claim": (_first_eval(claim_retry(ctx, "math", 3, "rollout:0")), [("math", "aborted"), ("math", "expired")]),
        "rb_expire": (
            _first_eval(expire(ctx, 9, 1, task="math", statuses=("aborted",))),
            [("math", "aborted"), ("math", "expired")],
        ),
    }


def test_each_wrapper_sends_the_keys_its_script_header_declares(store: TraceStore) -> None:
    calls = _calls(store)
    assert sorted(calls) == sorted(n for n in ("rb_put", "rb_take", "rb_claim", "rb_expire"))
    for name, (ev, cells) in calls.items():
        assert ev.script.name == name
        fixed, labels = _header(name)
        keys = [k.replace(f"{{{store.keys.run}}}", "{R}") for k in ev.keys]
        for i, pat in enumerate(fixed):
            assert pat.match(keys[i]), f"{name}: KEYS[{i + 1}] is {keys[i]!r}, the header says {pat.pattern}"
        at = len(fixed)
        statuses = [s for _, s in cells]
        for j, status in enumerate(statuses):
            want = labels[j % len(labels)]
            assert want in (status, "<status>"), f"{name}: cell {j} is {status}, the header says {want}"
        for task, status in cells:
            block = keys[at : at + len(INDEXES)]
            assert block == [
                k.replace(f"{{{store.keys.run}}}", "{R}") for k in task_keys(store.keys, task, (status,))
            ], f"{name}: the cell {task} {status} at KEYS[{at + 1}] is {block}"
            at += len(INDEXES)
        assert all(":s:" in k for k in keys[at:]), f"{name}: after the cells only session keys"
        nfixed = script(name).nkeys
        assert nfixed in (len(fixed), len(fixed) + len(INDEXES) * len(labels)), f"{name}: KEYS: {nfixed}"


def test_a_call_whose_layout_disagrees_is_refused_with_nothing_written(store: TraceStore) -> None:
    """The cells given in the wrong order (or an index missing) are refused by rb_cells."""
    store.open_sessions(["s1", "s2"], "rollout:0")
    g = Group("g1", "math", ("s1", "s2"), min_version=0, payload={"priority": 1})
    good = put_request(store.context, g, "rollout:0")
    n = len(INDEXES)
    head, cells, tail = good.keys[:12], good.keys[12 : 12 + 2 * n], good.keys[12 + 2 * n :]
    swapped = Eval(good.script, (*head, *cells[n:], *cells[:n], *tail), good.args)
    with pytest.raises(InvalidInput, match="layout of the client and the script disagree"):
        store.execute(swapped)
    shifted = Eval(good.script, (*head, *cells[1:], *tail), good.args)  # an index missing
    with pytest.raises(InvalidInput, match="layout"):
        store.execute(shifted)
    k = store.keys
    assert store.replay.count() == 0 and store.sessions("rollout:0") == ["s1", "s2"]
    assert store.redis.exists(k.rb_groups, k.rb_seq, k.rb_tasks, *cells) == 0
    store.execute(good)  # the wrapper's own layout
    assert [x.gid for x in store.replay.groups("math")] == ["g1"]
