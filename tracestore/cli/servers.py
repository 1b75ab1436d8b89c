"""``tracestore server``, ``tracestore cluster up|down|status``, ``ping``, ``info``."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import click
import orjson

from .._table import format_table
from ..servers import EmbeddedServer, LocalCluster, node_status, redis_server_binary
from ..store import TraceStore
from . import fail, guarded, main, run_option, url_option


@main.command()
@click.option("--port", type=int, default=None, help="Port to listen on (default: a free port).")
@click.option("--aof/--no-aof", default=False, show_default=True, help="Append-only file with appendfsync always.")
@click.option("--dir", "data_dir", type=click.Path(file_okay=False), default=None, help="Data directory to keep (default: a temp dir removed on exit).")
@click.option("--redis-server", "use_redis", is_flag=True, help="Run Debian's redis-server instead of the embedded valkey-server.")
@guarded
def server(port: int | None, aof: bool, data_dir: str | None, use_redis: bool) -> None:
    """Run an embedded server in the foreground; print its URL; Ctrl-C stops it.

    Point other shells at it with: export TRACESTORE_URL=<printed url>
    """
    binary = None
    if use_redis:
        binary = redis_server_binary()
        if binary is None:
            fail("redis-server is not installed (apt-get install redis-server)")
    srv = EmbeddedServer(port=port, aof=aof, dir=data_dir, binary=binary).start()
    click.echo(srv.url, nl=True)
    click.echo(f"# data dir {srv.dir}; Ctrl-C to stop", err=True)
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop["now"] and srv.running:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
        click.echo("stopped", err=True)


def _state_path(state_file: str | None) -> Path:
    if state_file:
        return Path(state_file)
    home = os.environ.get("TRACESTORE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tracestore"
    )
    return Path(home) / "cluster.json"


state_option = click.option(
    "--state-file",
    envvar="TRACESTORE_CLUSTER_STATE",
    show_envvar=True,
    default=None,
    help="Where `cluster up` records its nodes (default: ~/.cache/tracestore/cluster.json).",
)


@main.group()
def cluster() -> None:
    """Start, inspect and stop a local Redis Cluster (embedded valkey-server)."""


@cluster.command("up")
@click.option("--primaries", type=int, default=3, show_default=True, help="Number of primaries.")
@click.option("--replicas", type=int, default=0, show_default=True, help="Replicas per primary.")
@click.option("--port", "base_port", type=int, default=None, help="First port; nodes use consecutive ports (default: free ports).")
@state_option
@guarded
def cluster_up(primaries: int, replicas: int, base_port: int | None, state_file: str | None) -> None:
    """Start a local cluster in the background and print its URL."""
    path = _state_path(state_file)
    if path.exists():
        fail(f"a cluster is already recorded in {path}; run `tracestore cluster down` first")
    n = primaries * (1 + replicas)
    ports = list(range(base_port, base_port + n)) if base_port else None
    c = LocalCluster(primaries, replicas, ports=ports).start()
    state = {
        "url": c.url,
        "nodes": [
            {"port": s.port, "pid": s.proc.pid if s.proc else None, "dir": str(s.dir)}
            for s in c.servers
        ],
        "primaries": primaries,
        "replicas": replicas,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(state, option=orjson.OPT_INDENT_2))
    click.echo(c.url)
    click.echo(f"# {n} nodes on ports {c.ports}; state in {path}", err=True)


@cluster.command("status")
@state_option
@guarded
def cluster_status(state_file: str | None) -> None:
    """Show each node of the recorded local cluster (exit 1 if any is not ok)."""
    path = _state_path(state_file)
    if not path.exists():
        fail(f"no cluster recorded in {path}; start one with `tracestore cluster up`")
    state = orjson.loads(path.read_bytes())
    rows = [node_status("127.0.0.1", node["port"]) for node in state["nodes"]]
    click.echo(state["url"])
    click.echo(format_table(["port", "role", "state", "keys"], [[r["port"], r["role"], r["state"], r["keys"]] for r in rows]))
    if any(r["state"] != "ok" for r in rows):
        raise SystemExit(1)


@cluster.command("down")
@state_option
@guarded
def cluster_down(state_file: str | None) -> None:
    """Stop every node of the recorded local cluster and remove its data."""
    path = _state_path(state_file)
    if not path.exists():
        fail(f"no cluster recorded in {path}")
    state = orjson.loads(path.read_bytes())
    for node in state["nodes"]:
        pid = node.get("pid")
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for node in state["nodes"]:
        pid = node.get("pid")
        while pid and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(node["dir"], ignore_errors=True)
    path.unlink()
    click.echo(f"stopped {len(state['nodes'])} nodes")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers kill(0); reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


@main.command()
@url_option
@guarded
def ping(url: str | None) -> None:
    """Check that the server answers (exit 0) or say why not (exit 1)."""
    start = time.perf_counter()
    with TraceStore.connect(url, run="ping", create_run=False) as st:
        st.ping()
        click.echo(f"PONG from {st.url} ({'cluster' if st.cluster else 'standalone'}) in {1000 * (time.perf_counter() - start):.1f} ms")


@main.command()
@url_option
@click.option("--prefix", default="ts", show_default=True, help="Key prefix to look for runs under.")
@guarded
def info(url: str | None, prefix: str) -> None:
    """Server engine, version, mode and the tracestore runs found on it."""
    with TraceStore.connect(url, run="info", prefix=prefix, create_run=False) as st:
        si = st.server_info(prefix)
    runs = list(si.runs)
    click.echo(format_table(["field", "value"], [
        ["url", st.url],
        ["engine", si.engine],
        ["version", si.version],
        ["mode", si.mode],
        ["primaries", si.nodes],
        ["runs", ", ".join(runs) or "(none)"],
    ]))


__all__ = ["server", "cluster", "ping", "info", "run_option"]
