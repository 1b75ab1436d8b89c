"""The gateway's options (``tracestore gateway`` flags map onto :class:`GatewayConfig`)."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from ..errors import ConfigError, InvalidId
from ..keys import validate_id
from .engines import engine_apis

#: ``--prompt-mode`` choices: token-exact traces (the default), or the chat template every turn.
PROMPT_MODES = ("tito", "template")
#: ``--on-weight-update`` choices: hold a stopped generation and continue it under the new
#: weights (the default), or answer 503 so that the client retries from scratch.
ON_WEIGHT_UPDATE = ("continue", "abort")


@dataclass(frozen=True)
class GatewayConfig:
    """Options of a gateway.

    ``engines``: engine base URLs, the router's entrypoints (sticky per
    session); ``engine_api``: their protocol (``sglang`` or ``vllm``, see
    :mod:`.engines`). ``prompt_mode``: ``tito`` (token-exact traces,
    :mod:`.tito`) or ``template`` (:class:`~.prompts.TemplatePrompts`).
    ``on_weight_update``: ``continue`` (a generation a weight update stops is
    held, its tokens kept, and continued under the new weights; held past
    ``hold_timeout_s`` it is answered as in ``abort`` mode) or ``abort`` (503,
    the client retries). ``owner``: owner tag of sessions opened without an
    ``X-Tracestore-Owner`` header (default :attr:`owner_tag`). ``name``: lease holder name (default
    ``gateway-<host>-<pid>``). ``model``: the model name served (default: the
    tokenizer's). ``trace_sessions``: sessions whose latest turn
    ``/v1/sessions/{sid}/trace`` can export (LRU). ``startup_checks``: probe
    the engines and the chat template before serving (:mod:`.startup`).
    ``otel``: emit OpenTelemetry spans per turn (also when
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; :mod:`.tracing`).
    """

    engines: tuple[str, ...]
    url: str | None = None
    run: str = "default"
    owner: str | None = None
    engine_api: str = "sglang"
    prompt_mode: str = "tito"
    on_weight_update: str = "continue"
    hold_timeout_s: float = 600.0
    #: A non-streamed turn whose client left goes on this long for its retry to join it (0: aborted at once).
    retry_grace_s: float = 10.0
    #: How long a turn whose engine refused or lost it (provably stopped) waits for the engine to
    #: answer again before it fails (0: fails at once).
    engine_wait_s: float = 10.0
    tokenizer: str = "builtin"
    tool_parser: str = "hermes"
    reasoning_parser: str = "none"
    model: str | None = None
    name: str | None = None
    lease_ttl_s: float = 120.0
    #: The gateway's default owner tag is heart-beaten with this ttl: a gateway gone for longer has its
    #: sessions released by the next ``gc``.
    owner_ttl_s: float = 30.0
    gate_poll_s: float = 0.05
    max_body_bytes: int = 32 << 20
    engine_timeout_s: float = 600.0
    default_max_tokens: int = 1024
    trace_sessions: int = 4096
    redis_connections: int = 256
    startup_checks: bool = True
    otel: bool = False

    def validate(self) -> GatewayConfig:
        """Check the options; raises ConfigError with a message a person can act on."""
        if not self.engines:
            raise ConfigError("at least one --engine URL is needed")
        for e in self.engines:
            if not re.match(r"https?://[^\s/]+\Z", e):
                raise ConfigError(f"--engine {e!r}: expected http://host:port (no path)")
        if len(set(self.engines)) != len(self.engines):
            raise ConfigError("--engine: the same URL is given twice")
        if self.prompt_mode not in PROMPT_MODES:
            raise ConfigError(f"--prompt-mode {self.prompt_mode!r}: choose one of {list(PROMPT_MODES)}")
        if self.on_weight_update not in ON_WEIGHT_UPDATE:
            raise ConfigError(f"--on-weight-update {self.on_weight_update!r}: choose one of {list(ON_WEIGHT_UPDATE)}")
        if self.engine_api not in engine_apis():
            raise ConfigError(f"--engine-api {self.engine_api!r}: choose one of {engine_apis()}")
        try:
            if self.owner is not None:
                validate_id("owner", self.owner)
            if self.name is not None:
                validate_id("gateway name", self.name)
        except InvalidId as exc:
            raise ConfigError(str(exc)) from None
        for name in ("lease_ttl_s", "owner_ttl_s", "gate_poll_s", "engine_timeout_s", "hold_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.retry_grace_s <= 3600:
            raise ConfigError(f"retry_grace_s must be in [0, 3600], got {self.retry_grace_s}")
        if not 0 <= self.engine_wait_s <= 3600:
            raise ConfigError(f"engine_wait_s must be in [0, 3600], got {self.engine_wait_s}")
        if self.redis_connections < 8:
            raise ConfigError(f"redis_connections must be at least 8, got {self.redis_connections}")
        for name in ("max_body_bytes", "default_max_tokens", "trace_sessions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        return self

    @property
    def holder(self) -> str:
        """The lease holder name: ``name``, else ``gateway-<host>-<pid>``."""
        return self.name or default_name()

    @property
    def owner_tag(self) -> str:
        """The owner of sessions opened without ``X-Tracestore-Owner``: ``owner``, else
        ``gateway:<host>-<pid>``. The gateway heart-beats it (``tracestore gc`` releases its
        sessions once the gateway is gone); one tag per process, because a tag whose holder died
        is declared lost and cannot be used again."""
        return self.owner or "gateway:" + default_name().removeprefix("gateway-")


def default_name() -> str:
    """``gateway-<host>-<pid>`` (the host name reduced to id characters)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:60] or "host"
    return f"gateway-{host}-{os.getpid()}"


__all__ = ["ON_WEIGHT_UPDATE", "PROMPT_MODES", "GatewayConfig", "default_name"]
