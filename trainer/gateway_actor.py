"""The session gateway as a Ray actor, for ``tracestore train --agents http``.

The gateway serves the agents (``url``) in front of the rollout workers'
engines and keeps the routed experts the engines return in its own
:class:`~tracestore.ray.RefHolder` (so they live in this actor's object
store and are dropped when their session is released); the learner borrows
them with :meth:`GatewayActor.get_refs`, as it does from local workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracestore import TraceStore
from tracestore.gateway import GATEWAY, Gateway, GatewayConfig, start_gateway
from tracestore.gateway.serve import tune_gc
from tracestore.gateway.server import GatewayStats
from tracestore.ray import HolderStats, RefHolder

from .actors import node_id, serve_host
from .config import TrainConfig


@dataclass(frozen=True)
class GatewayActorStats:
    """The gateway's request counters and its holder; from its Prometheus metrics, the tokens
    it discarded (``tracestore_gateway_tokens_total{kind="discarded"}``) and the turns it held
    across a weight update and continued (``tracestore_gateway_held_total{event="continued"}``)."""

    gateway: GatewayStats
    holder: HolderStats
    tokens_discarded: int = 0
    turns_continued: int = 0


def _counter(gw: Gateway, name: str, labels: dict[str, str]) -> int:
    """The value of counter ``name`` (with ``labels``) in ``gw``'s metrics; 0 before its first count."""
    return int(gw.metrics.registry.get_sample_value(name, labels) or 0)


class GatewayActor:
    """A Ray actor (threaded: the learner borrows refs while agents are served)."""

    def __init__(self, cfg: TrainConfig, engines: list[str]) -> None:
        self.store = TraceStore.connect(cfg.url, run=cfg.run)
        self.holder = RefHolder(self.store, name="holder-gateway")
        config = GatewayConfig(
            engines=tuple(engines),
            url=cfg.url,
            run=cfg.run,
            owner="rollout:gateway",
            name="gateway",
            lease_ttl_s=cfg.lease_ttl_s,
            on_weight_update=cfg.on_weight_update,
            hold_timeout_s=cfg.hold_timeout_s,
        )
        self.server = start_gateway(config, holder=self.holder, host=serve_host(cfg))
        tune_gc()  # the actor's process is the gateway's: its collector set as tracestore gateway's

    def node_id(self) -> str:
        """The Ray node the gateway runs on."""
        return node_id()

    def url(self) -> str:
        """The gateway's base URL (agents use ``<url>/v1``)."""
        return self.server.url

    def get_refs(self, keys: list[str]) -> list[Any]:
        """Lend the ObjectRefs of ``keys`` (the caller borrows them; Ray counts the borrow)."""
        return self.holder.get(keys)

    def stats(self) -> GatewayActorStats:
        """The gateway's counters and its holder's."""
        assert self.server.app is not None
        gw = self.server.app[GATEWAY]
        return GatewayActorStats(
            gw.stats(),
            self.holder.stats(),
            tokens_discarded=_counter(gw, "tracestore_gateway_tokens_total", {"kind": "discarded"}),
            turns_continued=_counter(gw, "tracestore_gateway_held_total", {"event": "continued"}),
        )

    def close(self) -> None:
        """Stop serving, stop the holder (its consumer group removed), close the store."""
        self.server.stop()
        self.holder.close(destroy_group=True)
        self.store.close()
