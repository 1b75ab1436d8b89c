"""The session gateway as a Ray actor, for ``tracestore train --agents http``.

The gateway serves the agents (``url``) in front of the rollout workers'
engines and keeps the routed experts the engines return in its own
:class:`~tracestore.ray.RefHolder` (so they live in this actor's object
store and are dropped when their session is released); the learner borrows
them with :meth:`GatewayActor.get_refs`, as it does from local workers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
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

    def __init__(self, cfg: TrainConfig, engines: list[str], name: str = "gateway") -> None:
        self.store = TraceStore.connect(cfg.url, run=cfg.run)
        self.holder = RefHolder(self.store, name=f"holder-{name}")
        config = GatewayConfig(
            engines=tuple(engines),
            url=cfg.url,
            run=cfg.run,
            owner=f"rollout:{name}",
            name=name,  # the holder of its leases: one per gateway process
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


def merged(stats: Sequence[GatewayActorStats]) -> GatewayActorStats | None:
    """The stats of ``--gateways N`` as one (None: no gateway): counts and the loops' times summed;
    the latency percentiles are those of the gateway whose p50 overhead is the highest (a
    percentile of the union would need every sample), the p99 the highest of all."""
    if len(stats) <= 1:
        return stats[0] if stats else None
    slow = max(stats, key=lambda s: s.gateway.overhead_p50_s or 0.0)
    gws = [s.gateway for s in stats]

    def total(xs: list[float | None]) -> float | None:
        return None if any(x is None for x in xs) else sum(x for x in xs if x is not None)

    p99s = [g.overhead_p99_s for g in gws if g.overhead_p99_s is not None]
    gateway = GatewayStats(
        requests=sum(g.requests for g in gws),
        by_status=dict(sum((Counter(g.by_status) for g in gws), Counter())),
        in_flight=sum(g.in_flight for g in gws),
        overhead_p50_s=slow.gateway.overhead_p50_s,
        overhead_p99_s=max(p99s) if p99s else None,
        total_p50_s=slow.gateway.total_p50_s,
        parts_p50_s=dict(slow.gateway.parts_p50_s),
        loop_run_s=total([g.loop_run_s for g in gws]),
        loop_wait_s=total([g.loop_wait_s for g in gws]),
    )
    holder = HolderStats(**{f.name: sum(getattr(s.holder, f.name) for s in stats) for f in fields(HolderStats)})
    return GatewayActorStats(
        gateway,
        holder,
        tokens_discarded=sum(s.tokens_discarded for s in stats),
        turns_continued=sum(s.turns_continued for s in stats),
    )
