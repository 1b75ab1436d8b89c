"""The reference trainer (``tracestore train``): learning and bookkeeping figures of real runs.

Two fixed-seed runs side by side against one server (``$TRACESTORE_URL``, else
an embedded valkey-server), the same configuration except the mode:

* ``colocated``: generate a batch, then train, alternately;
* ``disaggregated``: the producer keeps generating while the learner trains
  (weight updates abort in-flight episodes into ``aborted`` groups that the
  producer claims back).

Figures per mode: batch reward over the first and last quarter of the steps
(the reward must improve), evaluation reward (32 fixed problems) at the first
and last evaluation, steps/s of the training loop, p50 turn latency, share of
the roles' busy time spent in tracestore calls, and the leak checks (sessions
leaked, refs held, release events vs sessions opened). Plots of reward and
staleness go to ``benchmarks/results/trainer_<mode>.png``.
"""

from __future__ import annotations

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
    "aborted_requests",
    "aborted_groups_claimed",
    "replay_max_abs_diff",
    "routing_replay_fallbacks",
)


def run(quick: bool) -> dict[str, Any]:
    import ray

    from tracestore.trainer.config import TrainConfig
    from tracestore.trainer.loop import run as train

    steps = 6 if quick else 24
    out: dict[str, Any] = {"steps": steps}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for mode in ("colocated", "disaggregated"):
            tmp = tempfile.mkdtemp(prefix=f"bench-trainer-{mode}-")
            try:
                rep = train(TrainConfig(mode=mode, steps=steps, seed=0, out=tmp))
                fig = {k: getattr(rep, k) for k in KEYS}
                fig["reward_gain"] = rep.reward_last - rep.reward_first
                fig["phases_s"] = rep.phases_s
                fig["groups"] = rep.groups
                fig["rewards"] = [round(h.reward, 4) for h in rep.history]
                out[mode] = fig
                shutil.copy(Path(tmp) / "report.png", results_dir(quick) / f"trainer_{mode}.png")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        ray.shutdown()
    out["disaggregated_vs_colocated_steps_per_s"] = (
        out["disaggregated"]["steps_per_s"] / out["colocated"]["steps_per_s"]
    )
    return out
