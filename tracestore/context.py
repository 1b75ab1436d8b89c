"""What every operation receives: the run's keys, its configuration, its caches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from .errors import ConfigError
from .keys import Keys
from .scripts import Eval, chunks, new_op_id, script

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StoreConfig:
    """Per-client configuration of a store; every field has a safe default.

    ``store_text``: keep each node's text in ``ts:{R/sid}:txt`` (diagnostics,
    ``redis-cli``, PromptMismatch windows); off saves memory.
    ``max_payload_bytes``: refuse a single node payload above this size.
    ``cache_bytes``: bound of the client-side cache of immutable nodes.
    ``op_ttl_s``: how long the reply of a mutating script is kept for retries.
    ``replay_payload_bytes``: refuse a replay group whose payload JSON is larger.
    ``replay_declared_keys``: replay scripts get every key they touch in KEYS
    (a take or claim costs two round trips: plan, then commit), for servers
    that refuse undeclared keys in scripts (e.g. Dragonfly without
    ``allow-undeclared-keys``); off, they reach the group and session keys
    of their own slot by id (one round trip; docs/replay.md).
    """

    store_text: bool = True
    max_payload_bytes: int = 32 * 1024 * 1024
    cache_bytes: int = 64 * 1024 * 1024
    op_ttl_s: int = 600
    replay_payload_bytes: int = 64 * 1024
    replay_declared_keys: bool = False

    def __post_init__(self) -> None:
        if self.max_payload_bytes <= 0:
            raise ConfigError("max_payload_bytes must be positive")
        if self.cache_bytes < 0:
            raise ConfigError("cache_bytes must be >= 0")
        if self.replay_payload_bytes <= 0:
            raise ConfigError("replay_payload_bytes must be positive")
        if self.op_ttl_s <= 0:
            raise ConfigError("op_ttl_s must be positive")
        if not isinstance(self.replay_declared_keys, bool):
            raise ConfigError("replay_declared_keys must be a bool")

    def to_json(self) -> bytes:
        """The configuration as JSON (stored, informational, in ``ts:{R}:meta``)."""
        return orjson.dumps(self.__dict__)


@dataclass
class Context:
    """Shared by the sync and async layers of one store; holds no connection."""

    keys: Keys
    cluster: bool
    config: StoreConfig
    #: Client-side caches keyed by name (the data plane keeps its node cache here).
    caches: dict[str, Any] = field(default_factory=dict)

    def new_op(self) -> tuple[str, str]:
        """``(op_id, op key)`` of one mutating call: where every operation gets its op id.

        Drawn once per call, before the first attempt, so a retry of the same
        request carries the same id and the script replays its first reply.
        """
        op_id = new_op_id()
        return op_id, self.keys.op(op_id)

    def op_evals(
        self,
        name: str,
        items: Sequence[str],
        keys: Callable[[str, Sequence[str]], tuple[str, ...]],
        args: Callable[[Sequence[str]], tuple[Any, ...]],
        *,
        at_least_one: bool = False,
    ) -> list[Eval]:
        """The calls of a mutating variadic script: one per chunk of ``items``, each with its op id.

        ``keys(op_key, chunk)`` and ``args(chunk)`` build one call's KEYS and
        ARGV. ``at_least_one``: one call with an empty chunk when ``items``
        is empty. Each chunk is one atomic script call.
        """
        sc = script(name)
        parts: list[Sequence[str]] = list(chunks(items, sc.chunk))
        if not parts and at_least_one:
            parts = [[]]
        out = []
        for part in parts:
            op_id, op_key = self.new_op()
            out.append(Eval(sc, keys(op_key, part), args(part), op_id=op_id))
        return out

    @property
    def op_ttl_ms(self) -> int:
        """How long (ms) a mutating script keeps its reply for retries (``StoreConfig.op_ttl_s``)."""
        return self.config.op_ttl_s * 1000
