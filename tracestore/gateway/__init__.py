"""The session gateway: the OpenAI/Anthropic-compatible HTTP endpoint agents talk to (DESIGN section 10).

``tracestore gateway --engine URL`` serves it; see ``docs/gateway.md``.
Rooms: :mod:`.server` (the aiohttp application: routes, the middleware that
counts status and latency, start-up and shutdown), :mod:`.turn` (one
request's path as a :class:`~.turn.Turn`: admit and prepare, engine, record,
settle), :mod:`.admission` (gate leases, coalesced admissions and
settlements, the seal watcher, held turns), :mod:`.failures` (one table from
an error to the HTTP answer and the lease's outcome), :mod:`.config`; the
wire formats :mod:`.openai`, :mod:`.anthropic`, :mod:`.responses`,
:mod:`.completions` over :mod:`.chat` (the wire-independent request, answer
and error); the prompt modes :mod:`.tito` (token-exact, the default),
:mod:`.prompts` (``template``) and :mod:`.idprompts` (token-id prompts);
:mod:`.retries` (a retry of a turn is one turn); :mod:`.engines` (the
engine contract and its SGLang and vLLM adapters); :mod:`.tokenizer` and
:mod:`.parsers` (chat templates, reasoning and tool-call parsers);
:mod:`.startup` (the start-up checks); :mod:`.liveness`; :mod:`.tracing`
(OpenTelemetry); :mod:`.metrics` (Prometheus).

Needs the extra ``tracestore[gateway]`` (aiohttp, prometheus_client,
transformers for Hugging Face tokenizers); ``import tracestore`` never
imports this package.
"""

from .chat import ApiError, ChatRequest
from .server import GATEWAY, Gateway, GatewayConfig, make_app, start_gateway

__all__ = ["GATEWAY", "ApiError", "ChatRequest", "Gateway", "GatewayConfig", "make_app", "start_gateway"]
