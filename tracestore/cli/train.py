"""``tracestore train``: the reference agentic RL loop (:mod:`tracestore.trainer`) end to end.

Runs rollout workers, a producer and a learner as Ray actors against one
tracestore run, prints a log line per step under a progress bar, then a
report table, and writes ``report.json`` and ``report.png`` into ``--out``.
torch, Ray, matplotlib and tqdm are imported only when the command runs
(extra ``tracestore[ray]``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from .._table import format_table
from . import fail, main, url_option

if TYPE_CHECKING:
    from tracestore.trainer.report import StepRecord

EXIT_CONFIG = 2


def _log_line(rec: StepRecord) -> str:
    parts = [
        f"step {rec.step:>3}",
        f"reward {rec.reward:.3f}",
        f"staleness {rec.staleness_mean:.1f}/{rec.staleness_max}",
        f"loss {rec.loss:+.3f}",
        f"released {rec.released}",
        f"v{rec.version}",
    ]
    if rec.replay_max_abs_diff is not None:
        parts.append(f"replay |dlogp| {rec.replay_max_abs_diff:.1e}")
    if rec.eval_reward is not None:
        parts.append(f"eval {rec.eval_reward:.3f}")
    return "  ".join(parts)


def train_command(**kw: Any) -> None:
    """Shared body of ``tracestore train`` and ``python -m tracestore.trainer``."""
    try:
        from tqdm import tqdm

        from tracestore.trainer.config import ConfigError, TrainConfig
        from tracestore.trainer.loop import SimulatedCrash, run
        from tracestore.trainer.report import report_rows
    except ImportError as exc:  # pragma: no cover - depends on the install
        fail(f"the trainer needs the extra tracestore[ray] (torch, ray, tqdm): {exc}", EXIT_CONFIG)
        return
    opts = {k: v for k, v in kw.items() if v is not None}
    cfg = TrainConfig(**opts)
    try:
        cfg.validate()
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    bar = tqdm(total=cfg.steps, desc=f"train {cfg.mode}", unit="step", file=sys.stderr)

    def progress(rec: StepRecord) -> None:
        if bar.n == 0 and rec.step > 1:
            bar.update(rec.step - 1)
        bar.update(1)
        tqdm.write(_log_line(rec), file=sys.stdout)

    try:
        report = run(cfg, progress)
    except ConfigError as exc:
        bar.close()
        fail(str(exc), EXIT_CONFIG)
        return
    except SimulatedCrash as crash:
        bar.close()
        fail(f"simulated crash after step {crash.step}", 3)
        return
    bar.close()
    click.echo("")
    click.echo(format_table(["report", "value"], report_rows(report)))
    click.echo(f"\nreport: {cfg.out}/report.json, plot: {cfg.out}/report.png, run: {report.run}")
    bad = report.violations()
    if bad:
        fail("invariants violated: " + ", ".join(bad), 1)


def train_options(f: Any) -> Any:
    """The options of ``tracestore train`` (also used by ``python -m tracestore.trainer``)."""
    opts = [
        click.option(
            "--mode",
            default="colocated",
            show_default=True,
            help="colocated (generate, then train) or disaggregated (overlapped).",
        ),
        click.option("--steps", type=int, default=20, show_default=True, help="Training steps."),
        url_option,
        click.option(
            "--run",
            default=None,
            help="Run id (default: train-<unix time>; --resume reuses the checkpoint's).",
        ),
        click.option(
            "--out",
            default="train-out",
            show_default=True,
            help="Directory for report.json, report.png and checkpoints.",
        ),
        click.option("--resume", is_flag=True, help="Continue from the checkpoint in --out."),
        click.option("--seed", type=int, default=None, help="Seed (default 0)."),
        click.option("--workers", type=int, default=None, help="Rollout workers (default 2)."),
        click.option(
            "--sync-every",
            type=int,
            default=None,
            help="Weight sync through the gate every N steps (default 1).",
        ),
        click.option(
            "--checkpoint-every",
            type=int,
            default=None,
            help="Checkpoint every N steps (default 4).",
        ),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@main.command("train")
@train_options
def train(**kw: Any) -> None:
    """Run the reference agentic RL loop (tiny MoE policy, calculator task) on Ray.

    Exits 0 when the run ends with nothing leaked (no live session, no held
    ref, no poisoned lease, one release event per session), 1 otherwise, 2
    on a bad configuration (unknown mode, zero steps, unreachable server).
    """
    train_command(**kw)
