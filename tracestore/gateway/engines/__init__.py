"""Engine adapters behind one contract (:mod:`.base`): ``sglang`` (SGLang's native ``/generate``),
``vllm`` (vLLM's OpenAI-compatible ``/v1/completions`` with token ids). ``--engine-api`` picks one."""

from .base import (
    Chunk,
    Engine,
    EngineError,
    EngineInfo,
    EngineLost,
    EngineOutput,
    EngineRefused,
    EngineRejected,
    EngineRequest,
    Sampling,
    close_engines,
    engine_apis,
    engine_class,
    extend_ids,
    register,
)

__all__ = [
    "Chunk",
    "Engine",
    "EngineError",
    "EngineInfo",
    "EngineLost",
    "EngineOutput",
    "EngineRefused",
    "EngineRejected",
    "EngineRequest",
    "Sampling",
    "close_engines",
    "engine_apis",
    "engine_class",
    "extend_ids",
    "register",
]
