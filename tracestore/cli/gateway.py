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
    help="Engine base URL, e.g. http://127.0.0.1:30000. Repeat for several engines: they are the "
    "router's entrypoints, sticky per session.",
)
@click.option(
    "--prompt-mode",
    type=click.Choice(["tito", "template"]),
    default="tito",
    show_default=True,
    help="tito: token-exact traces (the stored ids of earlier turns, only the new messages rendered); "
    "template: the chat template over the whole conversation every turn (docs/gateway.md).",
)
@click.option(
    "--on-weight-update",
    type=click.Choice(["continue", "abort"]),
    default="continue",
    show_default=True,
    help="continue: a generation a weight update stops is held (its tokens kept in the store) and "
    "continued under the new weights, one answer to the client; abort: answer 503 and let the client retry.",
)
@click.option(
    "--retry-grace",
    type=click.FloatRange(min=0.0, max=3600.0),
    default=10.0,
    show_default=True,
    help="Seconds a non-streamed turn whose client left goes on, so that the client's retry joins it (0: abort at once).",
)
@click.option(
    "--engine-wait",
    type=click.FloatRange(min=0.0, max=3600.0),
    default=10.0,
    show_default=True,
    help="Seconds a turn whose engine refused it, or died under it, waits for the engine to answer "
    "again and then goes on (a stream where it was cut); past that, or with 0, it fails with 502.",
)
@click.option(
    "--hold-timeout",
    type=click.FloatRange(min=0.001),
    default=600.0,
    show_default=True,
    help="Seconds a held generation waits for the gate to reopen before it is answered as in abort mode.",
)
@click.option(
    "--engine-api",
    default="sglang",
    show_default=True,
    help="The engines' protocol, an adapter of tracestore.gateway.engines: sglang (SGLang's native "
    "/generate) or vllm (vLLM's OpenAI-compatible /v1/completions with token ids).",
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
    "--reuse-port",
    is_flag=True,
    help="Let several gateway processes of the run serve this port (SO_REUSEPORT): the kernel spreads "
    "connections over them, and a client whose gateway died retries onto another, which resumes "
    "its held turn. Needs an explicit --port.",
)
@click.option(
    "--tokenizer",
    default="builtin",
    show_default=True,
    metavar="PATH|builtin",
    help="A Hugging Face tokenizer directory (chat_template inside), or 'builtin' (the reference policy's).",
)
@click.option(
    "--owner",
    default=None,
    help="Owner tag of sessions this gateway opens when a request has no X-Tracestore-Owner header "
    "(default gateway:<host>-<pid>; the gateway heart-beats it, so tracestore gc releases them once it is gone).",
)
@click.option("--model", default=None, help="Model name served (default: the tokenizer's name).")
@click.option(
    "--tool-parser",
    type=click.Choice(["hermes", "llama3", "deepseek", "glm", "mistral", "none"]),
    default="hermes",
    show_default=True,
    help="Tool-call syntax of the model family's answers (docs/gateway.md, Model families; the builtin "
    "tokenizer has its own).",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(["none", "qwen3", "deepseek-r1"]),
    default="none",
    show_default=True,
    help="Reasoning syntax: qwen3 and deepseek-r1 split <think>...</think> out of answers into "
    "reasoning_content (OpenAI) / thinking blocks (Anthropic).",
)
@click.option(
    "--otel",
    is_flag=True,
    help="Emit an OpenTelemetry span per turn (tracestore.turn with admit, engine, record, settle) to the "
    "OTLP/HTTP exporter the OTEL_* variables configure; also on when OTEL_EXPORTER_OTLP_ENDPOINT is set. "
    "Needs the extra tracestore[otel].",
)
@click.option("--name", default=None, help="Lease holder name (default gateway-<host>-<pid>).")
@click.option("--lease-ttl", type=float, default=120.0, show_default=True, help="Gate lease ttl, seconds (renewed while a request runs).")
@click.option(
    "--owner-ttl",
    type=float,
    default=30.0,
    show_default=True,
    help="Heartbeat ttl of the gateway's default owner tag, seconds: once a gateway is gone this long, "
    "`tracestore gc` releases the sessions it opened.",
)
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
        from ..gateway.serve import serve_forever
        from ..gateway.server import make_app
    except ImportError as exc:  # pragma: no cover - depends on the install
        fail(f"the gateway needs the extra tracestore[gateway]: {exc}", EXIT_CONFIG)
        return
    from ..errors import ConfigError

    cfg = GatewayConfig(
        engines=engines,
        engine_api=kw["engine_api"],
        prompt_mode=kw["prompt_mode"],
        on_weight_update=kw["on_weight_update"],
        hold_timeout_s=kw["hold_timeout"],
        retry_grace_s=kw["retry_grace"],
        engine_wait_s=kw["engine_wait"],
        otel=kw["otel"],
        url=kw["url"],
        run=kw["run"],
        owner=kw["owner"],
        tokenizer=kw["tokenizer"],
        tool_parser=kw["tool_parser"],
        reasoning_parser=kw["reasoning_parser"],
        model=kw["model"],
        name=kw["name"],
        lease_ttl_s=kw["lease_ttl"],
        owner_ttl_s=kw["owner_ttl"],
        gate_poll_s=kw["gate_poll_ms"] / 1000,
        max_body_bytes=int(kw["max_body_mb"] * (1 << 20)),
        engine_timeout_s=kw["engine_timeout"],
        default_max_tokens=kw["default_max_tokens"],
        redis_connections=kw["redis_connections"],
    )
    try:
        cfg.validate()
        if kw["reuse_port"] and not kw["port"]:
            fail("--reuse-port needs an explicit --port (with 0 each process would pick its own)", EXIT_CONFIG)
            return
        serve_forever(lambda: make_app(cfg), kw["host"], kw["port"], _announce, reuse_port=kw["reuse_port"])
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    except TracestoreError as exc:  # an InvalidId (--run, --owner) is a usage error too: exit 2
        fail(error_line(exc), exit_code(exc))
    except OSError as exc:
        fail(f"cannot listen on {kw['host']}:{kw['port']}: {exc.strerror or exc}")
