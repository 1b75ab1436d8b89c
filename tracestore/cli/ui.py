"""``tracestore ui``: the read-only web viewer of a server's runs (docs/viewer.md).

Prints ``listening on http://H:P`` once it serves and stops on Ctrl-C /
SIGTERM. Needs the extra ``tracestore[gateway]`` (aiohttp), imported only
when the command runs.
"""

from __future__ import annotations

import click

from ..errors import ConfigError
from ..validate import is_run_id
from . import EXIT_USAGE, connect, fail, main, url_option


def _run_id(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--run``: a run id, else a usage error (exit 2)."""
    if value is not None and not is_run_id(value):
        raise click.BadParameter(f"invalid run id {value!r}: use [A-Za-z0-9._-], 1..64 characters")
    return value


@main.command("ui")
@url_option
@click.option("--run", envvar="TRACESTORE_RUN", show_envvar=True, default=None, callback=_run_id,
              help="Show only this run (default: every run on the server).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port (0: any free port; the 'listening on' line tells which).")
@click.option("--tokenizer", default=None, metavar="PATH|builtin",
              help="Show token texts: a Hugging Face tokenizer directory, or 'builtin' (the reference "
              "policy's). Default: token ids only.")
@click.option("--rescan", "rescan_s", type=click.FloatRange(min=1.0), default=60.0, show_default=True,
              help="Seconds before the run list and owner tags (found by SCAN, in the background, never "
              "per request) are looked for again.")
def ui_command(url: str | None, run: str | None, host: str, port: int, tokenizer: str | None, rescan_s: float) -> None:
    """Serve a read-only web view of the server's runs, with its data as JSON under /api.

    Pages: / (runs: counters, memory, activity), /runs/RUN (owners and
    heartbeats, the gate and its recent cycles, the replay buffer, release
    rate), /runs/RUN/sessions/SID (the session's tree, branches, fork
    reasons) and /runs/RUN/sessions/SID/path/NUM (per token: trained,
    logprob, version and staleness, expert key). Works with the observer
    ACL role (a user from `tracestore acl RUN --role observer`).
    """
    try:
        from ..ui.app import UiConfig, serve_forever
    except ImportError as exc:  # pragma: no cover - depends on the install
        fail(f"the viewer needs the extra tracestore[gateway]: {exc}", EXIT_USAGE)
    if run is not None:
        connect(url, run).close()  # an unknown run is a usage error (exit 2), named with the candidates
    cfg = UiConfig(url=url, run=run, tokenizer=tokenizer, rescan_s=rescan_s)
    try:
        serve_forever(cfg, host, port, lambda u: click.echo(f"listening on {u}", nl=True))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_USAGE)
