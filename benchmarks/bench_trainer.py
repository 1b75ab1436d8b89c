"""The reference trainer (``tracestore train``): learning and bookkeeping figures of real runs.

Fixed-seed runs side by side against one server (``$TRACESTORE_URL``, else
an embedded valkey-server started here), the same configuration except the
mode and what a weight update does to generations in flight:

* ``colocated``: generate a batch, then train, alternately (nothing is in
  flight during a weight update);
* ``disaggregated``: the producer keeps generating while the learner trains;
* each in ``--on-weight-update continue`` (the default: a generation the
  update stops keeps its tokens and resumes under the new weights) and in
  ``abort`` (it is thrown away; the episode comes back as an ``aborted``
  group that the producer claims back and redoes): ``<mode>`` and
  ``<mode>_abort`` in the figures, and ``on_weight_update`` side by side;
* disaggregated with ``--agents http`` (openai-SDK agents through the
  session gateway, which holds the turns in continue mode) in both too:
  ``disaggregated_http[_abort]``.

Figures per run: batch reward over the first and last quarter of the steps
(the reward must improve), evaluation reward (32 fixed problems) at the first
and last evaluation, steps/s of the training loop, p50 turn latency, share of
the roles' busy time spent in tracestore calls, the leak checks (sessions
leaked, refs held, release events vs sessions opened), and tokens generated
/ discarded, turns continued, requests aborted, aborted groups claimed back.
Plots of reward and staleness go to ``benchmarks/results/trainer_<mode>.png``
(continue mode).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import results_dir

KEYS = (
    "reward_first",
    "reward_last",
    "eval_reward_before",
    "eval_reward_first",
    "eval_reward_last",
    "steps_per_s",
    "wall_s",
    "p50_turn_latency_ms",
    "turns",
    "tracestore_time_share",
    "store_call_time_share",
    "expert_put_time_share",
    "tracestore_time_share_by_role",
    "sessions_opened",
    "sessions_leaked",
    "release_events",
    "refs_held_at_end",
    "object_store_bytes_at_end",
    "gate_cycles",
    "poisoned_leases",
    "on_weight_update",
    "aborted_requests",
    "tokens_generated",
    "tokens_discarded",
    "turns_continued",
    "aborted_groups_claimed",
    "replay_max_abs_diff",
    "routing_replay_fallbacks",
    "gateway_503s_retried",
    "agent_turns_given_up",
)


#: (mode, on_weight_update, agents) of each run, in order.
RUNS = (
    ("colocated", "continue", "local"),
    ("disaggregated", "continue", "local"),
    ("colocated", "abort", "local"),
    ("disaggregated", "abort", "local"),
    ("disaggregated", "continue", "http"),
    ("disaggregated", "abort", "http"),
)
#: The figures of ``on_weight_update``: what a weight update cost in each mode.
SIDE_BY_SIDE = (
    "tokens_generated", "tokens_discarded", "turns_continued", "aborted_requests",
    "aborted_groups_claimed", "steps_per_s", "p50_turn_latency_ms", "sessions_leaked",
    "gateway_503s_retried",
)


def _name(mode: str, on_update: str, agents: str) -> str:
    """A run's key in the figures: ``<mode>[_http][_abort]``."""
    return mode + ("_http" if agents == "http" else "") + ("" if on_update == "continue" else f"_{on_update}")


def run(quick: bool) -> dict[str, Any]:
    import ray

    from tracestore.servers import EmbeddedServer
    from tracestore.trainer.config import TrainConfig
    from tracestore.trainer.loop import run as train

    steps = 6 if quick else 24
    out: dict[str, Any] = {"steps": steps}
    url = os.environ.get("TRACESTORE_URL")
    server = None if url else EmbeddedServer().start()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for mode, on_update, agents in RUNS:
            name = _name(mode, on_update, agents)
            tmp = tempfile.mkdtemp(prefix=f"bench-trainer-{name}-")
            try:
                cfg = TrainConfig(
                    mode=mode, steps=steps, seed=0, out=tmp, url=url or (server.url if server else None),
                    on_weight_update=on_update, agents=agents,
                )
                rep = train(cfg)
                fig = {k: getattr(rep, k) for k in KEYS}
                fig["reward_gain"] = rep.reward_last - rep.reward_first
                fig["phases_s"] = rep.phases_s
                fig["groups"] = rep.groups
                fig["rewards"] = [round(h.reward, 4) for h in rep.history]
                out[name] = fig
                if on_update == "continue" and agents == "local":
                    shutil.copy(Path(tmp) / "report.png", results_dir(quick) / f"trainer_{mode}.png")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
    out["disaggregated_vs_colocated_steps_per_s"] = (
        out["disaggregated"]["steps_per_s"] / out["colocated"]["steps_per_s"]
    )
    out["on_weight_update"] = {
        _name(mode, "continue", agents): {
            on_update: {k: out[_name(mode, on_update, agents)][k] for k in SIDE_BY_SIDE}
            for on_update in ("continue", "abort")
        }
        for mode, agents in (("colocated", "local"), ("disaggregated", "local"), ("disaggregated", "http"))
    }
    return out
