"""Upgrades do not break ACL users silently (issue 25 item 4): ``tracestore acl R --check`` and NOPERM hints.

A real ACL user on a real server (standalone and cluster: an ACL is per
node, set on every one), granted as the earlier docs said: the run's two key
patterns (no ``ts:{R|*`` for the turn counter shards) and the commands of
that version (no ``zrangebylex``, no ``hdel``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner, Result

from tests.test_ownership import prompt_of, response_of
from tracestore import PermissionDenied, ScriptError, TraceStore, acl
from tracestore.cli import main
from tracestore.scripts import Cmd

PASSWORD = "pw-check"
#: What the grant of the earlier version lacked.
NEW_COMMANDS = ("+zrangebylex", "+hdel")


def _on_every_node(st: TraceStore, *args: str) -> None:
    c: Any = st.redis
    if st.cluster:
        for node in c.get_nodes():
            c.execute_command(*args, target_nodes=node)
    else:
        c.execute_command(*args)


def _as(url: str, user: str, run: str) -> TraceStore:
    u = urlsplit(url)
    return TraceStore.connect(u._replace(netloc=f"{user}:{PASSWORD}@{u.hostname}:{u.port}").geturl(), run=run,
                              create_run=False)


@pytest.fixture
def admin(url: str, backend: str, run_id: str) -> Iterator[TraceStore]:
    if backend not in ("valkey", "cluster"):
        pytest.skip("runs on standalone and cluster (the ACL rules are the engine's)")
    st = TraceStore.connect(url, run=run_id)
    yield st
    st.close()


@pytest.fixture
def old_user(admin: TraceStore, run_id: str) -> Iterator[str]:
    """A writer granted as an earlier version did: two key patterns, that version's commands."""
    user = f"old-{uuid.uuid4().hex[:8]}"
    shards = f"~{acl.key_patterns(run_id)[2]}"
    args = [a for a in acl.grant(run_id, "writer", user=user, password=PASSWORD)
            if a != shards and a not in NEW_COMMANDS]
    _on_every_node(admin, *args)
    yield user
    _on_every_node(admin, "ACL", "DELUSER", user)


def check(url: str, run: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["acl", run, "--check", *args, "--url", url])


def test_a_nopermed_script_names_the_key_pattern_its_user_lacks(admin: TraceStore, old_user: str, url: str,
                                                                 run_id: str) -> None:
    with _as(url, old_user, run_id) as old:
        old.open_session("s1", "rollout:0")  # the control plane: granted
        m = old.lookup("s1", prompt_of("s1"))
        with pytest.raises(PermissionDenied) as ei:
            old.record_turn("s1", prompt_of("s1"), response_of("s1"), prefix=m, delta_token_ids=[1, 2],
                            response_token_ids=[3], response_logprobs=[-0.5], version=0)
        err = ei.value
        shards = acl.key_patterns(run_id)[2]
        assert err.missing_patterns == (shards,)  # the turn counter shards, asked of the server
        assert f"~{shards}" in str(err) and f"tracestore acl {run_id} --check" in str(err)
        assert f"~{acl.key_patterns(run_id)[1]}" not in str(err).split("may not access", 1)[1]  # only the missing one
        # a missing command, not a key: its keys are named accessible
        admin.gate.heartbeat("gw-gone", 0.05)
        admin.gate.admit("s1", "gw-gone", 60)
        end = time.monotonic() + 30
        while not admin.gate.dead_holder_leases():
            assert time.monotonic() < end
            time.sleep(0.02)
        # a command refused inside a script fails the script, in words each server puts its own way:
        # the error says how to find out, for the user it connects as
        with pytest.raises(ScriptError) as se:
            old.gate.dead_holder_leases()  # its script calls ZRANGEBYLEX, which that version did not grant
        assert f"tracestore acl {run_id} --check --user {old_user}" in str(se.value)
        with pytest.raises(PermissionDenied) as ei:  # a command refused to the client itself
            old.execute(Cmd(("HDEL", old.keys.gate, "x"), key=old.keys.gate))
        assert ei.value.missing_patterns == () and "the missing grant is a command" in str(ei.value)


def test_acl_check_lists_what_a_user_lacks_and_the_line_that_adds_it(admin: TraceStore, old_user: str, url: str,
                                                                      run_id: str) -> None:
    r = check(url, run_id, "--user", old_user)
    assert r.exit_code == 1, r.output
    shards = acl.key_patterns(run_id)[2]
    lines = [ln for ln in r.output.splitlines() if ln.startswith("missing ")]
    nodes = len(admin.redis.get_nodes()) if admin.cluster else 1  # type: ignore[union-attr]
    # one line per missing pattern and command (per node on a cluster: a grant is per node)
    assert sum(f"missing key pattern ~{shards} " in ln + " " for ln in lines) == nodes
    for cmd in NEW_COMMANDS:
        assert sum(ln.split(" on ")[0] == f"missing command {cmd}" for ln in lines) == nodes
    assert len(lines) == 3 * nodes
    add = next(ln for ln in r.output.splitlines() if ln.startswith("add them"))
    args = add.split("redis-cli ", 1)[1].replace("'", "").split()
    assert args[:3] == ["ACL", "SETUSER", old_user] and sorted(args[3:]) == sorted([f"~{shards}", *NEW_COMMANDS])
    _on_every_node(admin, *args)  # the line it printed, applied
    r = check(url, run_id, "--user", old_user)
    assert r.exit_code == 0 and "has every grant of the writer role" in r.output, r.output
    r = check(url, run_id, "--user", old_user, "--role", "observer")  # a writer can do what an observer does
    assert r.exit_code == 0, r.output
    with _as(url, old_user, run_id) as fixed:  # and the upgrade works for it now
        fixed.open_session("s2", "rollout:0")
        m = fixed.lookup("s2", prompt_of("s2"))
        fixed.record_turn("s2", prompt_of("s2"), response_of("s2"), prefix=m, delta_token_ids=[1, 2],
                          response_token_ids=[3], response_logprobs=[-0.5], version=0)


def test_acl_check_reads_categories_patterns_and_permissions(admin: TraceStore, url: str, run_id: str) -> None:
    obs = f"obs-{uuid.uuid4().hex[:8]}"
    broad = f"broad-{uuid.uuid4().hex[:8]}"
    _on_every_node(admin, *acl.grant(run_id, "observer", user=obs, password=PASSWORD))
    _on_every_node(admin, "ACL", "SETUSER", broad, "reset", "on", f">{PASSWORD}", "~ts:*", "+@all", "-hdel")
    try:
        r = check(url, run_id, "--user", obs, "--role", "observer")
        assert r.exit_code == 0, r.output
        r = check(url, run_id, "--user", obs)  # as a writer: read-only keys, no writes
        assert r.exit_code == 1
        assert "missing key pattern ~ts:{" in r.output and "missing command +hset" in r.output
        r = check(url, run_id, "--user", broad)  # ~ts:* covers the three patterns; @all all but hdel
        assert r.exit_code == 1, r.output
        assert [ln.split(" on ")[0] for ln in r.output.splitlines() if ln.startswith("missing")] == [
            "missing command +hdel"
        ] * (len(admin.redis.get_nodes()) if admin.cluster else 1)  # type: ignore[union-attr]
        r = check(url, run_id, "--user", "nobody-here")
        assert r.exit_code == 1 and "no ACL user 'nobody-here'" in r.output
        r = CliRunner().invoke(main, ["acl", run_id, "--check", "--url", url])
        assert r.exit_code == 2 and "--check needs --user" in r.output
    finally:
        for u in (obs, broad):
            _on_every_node(admin, "ACL", "DELUSER", u)
