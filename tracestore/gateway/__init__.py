"""The session gateway: the OpenAI/Anthropic-compatible HTTP endpoint agents talk to (DESIGN section 10).

``tracestore gateway --engine URL`` serves it; see ``docs/gateway.md``.
Modules: :mod:`.server` (the aiohttp application and the per-request flow),
:mod:`.openai` and :mod:`.anthropic` (one per wire format), :mod:`.chat`
(the wire-independent request, answer and error), :mod:`.tokenizer`
(chat templates, token ids, tool-call parsing), :mod:`.engine` (the
SGLang-protocol engine client), :mod:`.metrics` (Prometheus).

Needs the extra ``tracestore[gateway]`` (aiohttp, prometheus_client,
transformers for Hugging Face tokenizers); ``import tracestore`` never
imports this package.
"""

from .chat import ApiError, ChatRequest
from .server import GATEWAY, Gateway, GatewayConfig, make_app, start_gateway

__all__ = ["GATEWAY", "ApiError", "ChatRequest", "Gateway", "GatewayConfig", "make_app", "start_gateway"]
