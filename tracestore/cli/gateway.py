"""``tracestore gateway`` (the HTTP front door agents talk to) and ``tracestore engine``.

Both print one line ``listening on http://H:P`` once they serve (``GET
/health`` then answers 200) and stop on Ctrl-C / SIGTERM. The gateway needs
the extra ``tracestore[gateway]``; the engine also needs ``tracestore[ray]``
(torch). Both are imported only when the command runs.
"""

from __future__ import annotations

from typing import Any

import click

from ..errors import TracestoreError
from . import error_line, exit_code, fail, main, url_option

EXIT_CONFIG = 2


def _announce(url: str) -> None:
    click.echo(f"listening on {url}")


@main.command("gateway")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    required=True,
    metavar="URL",
    help="Engine base URL (SGLang native /generate), e.g. http://127.0.0.1:30000. Repeat for "
    "several engines: they are the router's entrypoints, sticky per session.",
)
@url_option
@click.option(
    "--run",
    envvar="TRACESTORE_RUN",
    show_envvar=True,
    default="default",
    show_default=True,
    help="Run id the gateway records into (keys ts:{RUN}:*; created if missing).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: any free port).")
@click.option(
    "--tokenizer",
    default="builtin",
    show_default=True,
    metavar="PATH|builtin",
    help="A Hugging Face tokenizer directory (chat_template inside), or 'builtin' (the reference policy's).",
)
@click.option(
    "--owner",
    default="gateway",
    show_default=True,
    help="Owner tag of sessions this gateway opens when a request has no X-Tracestore-Owner header.",
)
@click.option("--model", default=None, help="Model name served (default: the tokenizer's name).")
@click.option(
    "--tool-parser",
    type=click.Choice(["hermes", "none"]),
    default="hermes",
    show_default=True,
    help="Tool-call syntax of a Hugging Face model's answers (the builtin tokenizer has its own).",
)
@click.option("--name", default=None, help="Lease holder name (default gateway-<host>-<pid>).")
@click.option("--lease-ttl", type=float, default=120.0, show_default=True, help="Gate lease ttl, seconds (renewed while a request runs).")
@click.option(
    "--gate-poll-ms",
    type=float,
    default=50.0,
    show_default=True,
    help="While requests run, how often the gateway reads the gate to abort them when it is sealed.",
)
@click.option("--max-body-mb", type=float, default=32.0, show_default=True, help="Largest request body accepted (413 above).")
@click.option("--engine-timeout", type=float, default=600.0, show_default=True, help="Seconds before an engine call counts as lost.")
@click.option("--redis-connections", type=click.IntRange(8, None), default=256, show_default=True, help="Connection pool size to the store (per node); store calls queue beyond it.")
@click.option("--max-tokens", "default_max_tokens", type=int, default=1024, show_default=True, help="max_tokens of OpenAI requests that give none.")
def gateway(engines: tuple[str, ...], **kw: Any) -> None:
    """Serve the OpenAI/Anthropic-compatible session gateway in front of ENGINE(s).

    Agents call POST /v1/chat/completions or POST /v1/messages with a session
    id (body field session_id or header X-Session-Id); every turn is recorded
    in the run's trace store, gated against weight updates (503 + Retry-After
    while sealed) and routed to a sticky engine (410 for a retired or released
    session). Without a session id it is a plain proxy. Also GET /v1/models,
    /health, /metrics (Prometheus) and /v1/sessions/{sid}/trace. Routed
    experts are kept only by a gateway embedded in a Ray process with a
    RefHolder (tracestore.gateway.start_gateway); this command records turns
    without expert keys. See docs/gateway.md.
    """
    try:
        from ..gateway import GatewayConfig
        from ..gateway._http import serve_forever
        from ..gateway.server import make_app
    except ImportError as exc:  # pragma: no cover - depends on the install
        fail(f"the gateway needs the extra tracestore[gateway]: {exc}", EXIT_CONFIG)
        return
    from ..errors import ConfigError

    cfg = GatewayConfig(
        engines=engines,
        url=kw["url"],
        run=kw["run"],
        owner=kw["owner"],
        tokenizer=kw["tokenizer"],
        tool_parser=kw["tool_parser"],
        model=kw["model"],
        name=kw["name"],
        lease_ttl_s=kw["lease_ttl"],
        gate_poll_s=kw["gate_poll_ms"] / 1000,
        max_body_bytes=int(kw["max_body_mb"] * (1 << 20)),
        engine_timeout_s=kw["engine_timeout"],
        default_max_tokens=kw["default_max_tokens"],
        redis_connections=kw["redis_connections"],
    )
    try:
        cfg.validate()
        serve_forever(lambda: make_app(cfg), kw["host"], kw["port"], _announce)
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    except TracestoreError as exc:  # an InvalidId (--run, --owner) is a usage error too: exit 2
        fail(error_line(exc), exit_code(exc))
    except OSError as exc:
        fail(f"cannot listen on {kw['host']}:{kw['port']}: {exc.strerror or exc}")


@main.command("engine")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=30000, show_default=True, help="Port (0: any free port).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the policy's initial weights and of sampling.")
@click.option(
    "--warmup-steps",
    type=click.IntRange(0, None),
    default=0,
    show_default=True,
    help="Supervised warm start on the calculator task's format first (the trainer uses 120).",
)
@click.option("--max-len", type=click.IntRange(8, 1 << 16), default=256, show_default=True, help="Context length of the policy (the trainer's is 256).")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False), default=None, help="A torch state dict (or a trainer model.pt) to load.")
@click.option("--weight-version", type=click.IntRange(0, None), default=0, show_default=True, help="Weight version reported in replies.")
def engine(host: str, port: int, seed: int, warmup_steps: int, max_len: int, weights: str | None, weight_version: int) -> None:
    """Serve the reference policy of trainer/ over HTTP in SGLang's native shape.

    POST /generate (input_ids, sampling_params, return_logprob, stream,
    return_routed_experts), POST /abort_request, POST
    /update_weights_from_disk, POST /update_weight_version, GET /health,
    GET /get_model_info. A tiny mixture-of-experts model on the CPU: for
    tests, demos and the reference trainer, not for real models (point the
    gateway at SGLang for those).
    """
    try:
        from ..gateway._http import serve_forever
        from ..trainer.engine import build_engine
    except ImportError as exc:  # pragma: no cover - depends on the install
        fail(f"the engine needs the extras tracestore[ray,gateway] (torch, aiohttp): {exc}", EXIT_CONFIG)
        return
    eng = build_engine(seed=seed, warmup_steps=warmup_steps, max_len=max_len, version=weight_version)
    if weights:
        try:
            eng.load_file(weights, weight_version)
        except (OSError, RuntimeError, KeyError) as exc:
            fail(f"cannot load --weights {weights}: {type(exc).__name__}: {exc}", EXIT_CONFIG)

    async def make() -> Any:
        return eng.app()

    try:
        serve_forever(make, host, port, _announce)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
