"""``tracestore engine``: the reference policy of trainer/ served over HTTP, as SGLang or as vLLM.

Prints one line ``listening on http://H:P`` once it serves (``GET /health``
then answers 200) and stops on Ctrl-C / SIGTERM. Needs the extras
``tracestore[ray,gateway]`` (torch, aiohttp), imported only when it runs.
"""

from __future__ import annotations

from typing import Any

import click

from . import EXIT_USAGE, fail, main

#: ``--api`` choices: the shapes of trainer.engine (sglang) and trainer.engine_vllm (vllm).
APIS = ("sglang", "vllm")


@main.command("engine")
@click.option(
    "--api",
    type=click.Choice(APIS),
    default="sglang",
    show_default=True,
    help="HTTP shape: SGLang's native /generate, or vLLM's OpenAI-compatible /v1/completions "
    "with token ids (the gateway's --engine-api).",
)
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
@click.option(
    "--max-len",
    type=click.IntRange(8, 1 << 16),
    default=256,
    show_default=True,
    help="Context length of the policy (the trainer's is 256); reported as max_len (SGLang) "
    "or max_model_len (vLLM).",
)
@click.option("--max-batch", type=click.IntRange(1, 4096), default=64, show_default=True, help="Most requests decoded together (continuous batching); more wait for a row.")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False), default=None, help="A torch state dict (or a trainer model.pt) to load.")
@click.option("--weight-version", type=click.IntRange(0, None), default=0, show_default=True, help="Weight version reported in replies.")
def engine(
    api: str,
    host: str,
    port: int,
    seed: int,
    warmup_steps: int,
    max_len: int,
    max_batch: int,
    weights: str | None,
    weight_version: int,
) -> None:
    """Serve the reference policy of trainer/ over HTTP, in SGLang's or vLLM's shape.

    --api sglang (default): POST /generate (input_ids, sampling_params,
    return_logprob, stream, return_routed_experts), POST /abort_request,
    GET /get_model_info, GET /health. --api vllm: POST /v1/completions
    (prompt as token ids, return_token_ids, stream; a client that
    disconnects aborts its request), GET /v1/models (max_model_len), GET
    /health. Both: POST /update_weights_from_disk, POST
    /update_weight_version. Concurrent requests are decoded in one batch. A
    tiny mixture-of-experts model on the CPU: for tests, demos and the
    reference trainer, not for real models (point the gateway at SGLang or
    vLLM for those).
    """
    try:
        from ..gateway.serve import serve_forever
        from ..trainer.engine import build_engine
        from ..trainer.engine_vllm import vllm_app
    except ImportError as exc:  # pragma: no cover - depends on the install
        fail(f"the engine needs the extras tracestore[ray,gateway] (torch, aiohttp): {exc}", EXIT_USAGE)
        return
    eng = build_engine(seed=seed, warmup_steps=warmup_steps, max_len=max_len, version=weight_version, max_batch=max_batch)
    if weights:
        try:
            eng.load_file(weights, weight_version)
        except (OSError, RuntimeError, KeyError) as exc:
            eng.close()
            fail(f"cannot load --weights {weights}: {type(exc).__name__}: {exc}", EXIT_USAGE)

    async def make() -> Any:
        return vllm_app(eng) if api == "vllm" else eng.app()

    try:
        serve_forever(make, host, port, _announce)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    finally:
        eng.close()


def _announce(url: str) -> None:
    click.echo(f"listening on {url}")
