"""``tracestore train``: the reference agentic RL loop (:mod:`tracestore.trainer`) end to end.

Runs rollout workers, a producer and a learner as Ray actors against one
tracestore run, prints a log line per step under a progress bar, then a
report table, and writes ``report.json`` and ``report.png`` into ``--out``.
torch, Ray, matplotlib and tqdm are imported only when the command runs
(extra ``tracestore[ray]``).
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from ..formatting import format_table
from . import fail, main, url_option

if TYPE_CHECKING:
    from tracestore.trainer.report import StepRecord

#: Exit codes of ``tracestore train`` (docs/trainer.md).
EXIT_OK = 0
EXIT_INVARIANT = 1
EXIT_CONFIG = 2
EXIT_UNREACHABLE = 3
EXIT_ROLE_LOST = 4
EXIT_INTERRUPTED = 130


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


def _resume_command(out: str) -> str:
    return f"tracestore train --resume --out {shlex.quote(out)}"


def _inspect_commands(url: str, run: str) -> str:
    """The commands that look at ``run`` from another shell (printed when the run starts)."""
    from ..connection import mask_url
    from ..default_server import is_default

    where = "" if is_default(url) or os.environ.get("TRACESTORE_URL") == url else (
        f" --url {shlex.quote(mask_url(url))}"
    )
    return "; ".join(
        f"tracestore {cmd}{where}"
        for cmd in ("runs", f"sessions --run {run}", f"gate status --run {run}", f"replay stats --run {run}")
    )


def _config(kw: dict[str, Any]) -> Any:
    """The run's TrainConfig: the options given, or with --resume the checkpoint's (see resumed)."""
    from tracestore.trainer.checkpoint import ckpt_dir, load_state
    from tracestore.trainer.config import ConfigError, TrainConfig

    from ..connection import mask_url

    override = bool(kw.pop("override", False))
    resume = bool(kw.pop("resume", False))
    given = {k: v for k, v in kw.items() if v is not None}
    if override and not resume:
        raise ConfigError("--override only applies with --resume")
    if not resume:
        return TrainConfig(**given)
    out = given.pop("out", TrainConfig.out)
    state = load_state(TrainConfig(out=out))
    if state is None:
        raise ConfigError(f"--resume: no checkpoint in {ckpt_dir(TrainConfig(out=out))}")
    ctx = click.get_current_context(silent=True)
    if ctx is not None and "url" in given and ctx.get_parameter_source("url") == ParameterSource.ENVIRONMENT:
        if given["url"] != state.cfg.url and not override:
            raise ConfigError(
                f"$TRACESTORE_URL {mask_url(given['url'])!r} disagrees with the checkpoint, which "
                f"ran with {mask_url(state.cfg.url or '')!r}; unset it to resume as it was, or add "
                "--override to change it"
            )
    cfg = state.cfg.resumed(given, override=override)
    cfg.out = out
    return cfg


def train_command(**kw: Any) -> None:
    """Shared body of ``tracestore train`` and ``python -m tracestore.trainer``.

    One line and an exit code for every way a run ends early: a bad
    configuration (2), the store unreachable at the start or mid-run, or
    its run lost by a server restarted without its data (3),
    Ctrl-C (130), with the command that resumes it.
    """
    try:
        from tqdm import tqdm

        from tracestore.errors import ConfigError as StoreConfigError
        from tracestore.errors import RunLocked
        from tracestore.runlock import RunLost
        from tracestore.trainer.config import ConfigError
        from tracestore.trainer.loop import (
            Interrupted,
            RoleLost,
            RunFinished,
            StoreUnreachable,
            run,
        )
        from tracestore.trainer.report import report_rows
    except ImportError as exc:  # pragma: no cover - depends on the install
        fail(f"the trainer needs the extra tracestore[ray] (torch, ray, tqdm): {exc}", EXIT_CONFIG)
    # Errors of tasks whose results nobody reads any more (the run is ending) are not news.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    _export_durability(kw)
    try:
        cfg = _config(dict(kw)).validate()
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    bars: list[Any] = []  # the progress bar, shown once the store answers

    def started(url: str, run_id: str) -> None:
        click.echo(f"# run {run_id}; inspect it with: {_inspect_commands(url, run_id)}", err=True)
        bars.append(tqdm(total=cfg.steps, desc=f"train {cfg.mode}", unit="step", file=sys.stderr))

    def progress(rec: StepRecord) -> None:
        bar = bars[0]
        if bar.n == 0 and rec.step > 1:
            bar.update(rec.step - 1)
        bar.update(1)
        tqdm.write(_log_line(rec), file=sys.stdout)

    def notice(line: str) -> None:
        (tqdm.write if bars else click.echo)(f"# {line}", file=sys.stderr)

    try:
        try:
            report = run(cfg, progress, started, notice)
        finally:
            for bar in bars:
                bar.close()
    except (ConfigError, StoreConfigError) as exc:  # the store's: e.g. a level the server cannot give
        fail(str(exc), EXIT_CONFIG)
    except RunFinished as exc:
        click.echo(
            f"run {exc.run} already finished at step {exc.step}: nothing to resume, nothing changed "
            f"(report: {exc.out}/report.json); to train further: "
            f"{_resume_command(exc.out)} --steps N (N > {exc.step})"
        )
        sys.exit(EXIT_OK)
    except RunLocked as exc:
        fail(_locked_line(exc, started=bool(bars)), EXIT_CONFIG)
    except Interrupted as exc:
        click.echo("", err=True)
        if exc.checkpoint is None:
            click.echo(
                f"interrupted at step {exc.step}, before the run's first checkpoint: nothing to "
                f"resume (`tracestore run delete {cfg.run}` removes what it wrote)",
                err=True,
            )
        else:
            click.echo(
                f"interrupted at step {exc.step}; resume with: {_resume_command(cfg.out)}"
                + (f" (from the checkpoint of step {exc.checkpoint})" if exc.checkpoint != exc.step else ""),
                err=True,
            )
        sys.exit(EXIT_INTERRUPTED)
    except RunLost as exc:  # the server restarted without its data: the checkpoint brings it back
        fail(f"{exc.what}; stopped: resume with {_resume_command(cfg.out)}", EXIT_UNREACHABLE)
    except RoleLost as exc:
        resume = (
            f"resume on the nodes left with: {_resume_command(cfg.out)}"
            if exc.checkpoint is not None
            else "the run had no checkpoint yet; start it again"
        )
        fail(f"{exc}; {resume}", EXIT_ROLE_LOST)
    except StoreUnreachable as exc:
        if exc.step is None:
            fail(f"cannot reach the store at {exc.url}: {exc.reason}", EXIT_UNREACHABLE)
        resume = (
            f"once it is back, resume with: {_resume_command(cfg.out)}"
            if exc.checkpoint is not None
            else "the run had no checkpoint yet; start it again"
        )
        fail(f"store unreachable at {exc.url} after step {exc.step} ({exc.reason}); {resume}",
             EXIT_UNREACHABLE)
    click.echo("")
    click.echo(format_table(["report", "value"], report_rows(report)))
    if len(set(report.placement.values())) > 1:  # a cluster: where each role ran, each node's store
        click.echo("\n" + format_table(["role", "Ray node"], [[r, n] for r, n in report.placement.items()]))
        used = report.object_store_bytes_per_node_at_end
        click.echo(
            "\n" + format_table(["Ray node", "object store bytes at end"], [[n, b] for n, b in used.items()])
        )
    click.echo(f"\nreport: {cfg.out}/report.json, plot: {cfg.out}/report.png, run: {report.run}")
    bad = report.violations()
    if bad:
        fail("invariants violated: " + ", ".join(bad), EXIT_INVARIANT)


def _locked_line(exc: Any, *, started: bool) -> str:
    """The line of a run another process holds (``exc``: a RunLocked): who, where, since when."""
    who = f"{exc.what or 'another process'} (pid {exc.pid} on {exc.host}, since {exc.since})"
    if started:  # it took the lock while this trainer could not renew it (the store was away)
        return (
            f"run {exc.run} was taken over by {who} while this trainer could not renew its lock; "
            "this one stopped (its roles are killed)"
        )
    return (
        f"run {exc.run} is being trained by {who}; wait for it to end, or train another run "
        "(--run NEW)"
    )


def _export_durability(kw: dict[str, Any]) -> None:
    """Move the --durability options out of ``kw`` into the environment every role inherits.

    The store reads them in each process at ``connect`` (and the trainer
    hands the driver's variables to roles on other nodes), so a run's calls
    are all acknowledged on the same terms. A combination the store refuses
    ends here with exit 2, before Ray starts.
    """
    from tracestore.durability import ENV_DURABILITY, ENV_REPLICAS, ENV_TIMEOUT, Durability
    from tracestore.errors import ConfigError as StoreConfigError

    given = {
        ENV_DURABILITY: kw.pop("durability", None),
        ENV_REPLICAS: kw.pop("durability_replicas", None),
        ENV_TIMEOUT: kw.pop("durability_timeout", None),
    }
    for name, value in given.items():
        if value is not None:
            os.environ[name] = str(value)
    try:
        Durability.from_options({})
    except StoreConfigError as exc:
        fail(str(exc), EXIT_CONFIG)


def train_options(f: Any) -> Any:
    """The options of ``tracestore train`` (also used by ``python -m tracestore.trainer``)."""
    opts = [
        click.option(
            "--mode",
            default=None,
            help="colocated (generate, then train; the default) or disaggregated (overlapped).",
        ),
        click.option(
            "--agents",
            default=None,
            help="local (each worker runs its agents against its policy in process; the default) or "
            "http (agents are asyncio tasks of the openai SDK calling a session gateway in front of "
            "the workers' engines, with tool calls; needs tracestore[gateway]; make train uses it).",
        ),
        click.option("--steps", type=int, default=None, help="Training steps (default 20)."),
        url_option,
        click.option(
            "--run",
            default=None,
            help="Run id (default: train-<unix time>-<6 hex>; --resume reuses the checkpoint's). "
            "One trainer per run: a second one is refused, naming the first.",
        ),
        click.option(
            "--out",
            default="train-out",
            show_default=True,
            help="Directory for report.json, report.png and checkpoints.",
        ),
        click.option(
            "--resume",
            is_flag=True,
            help="Continue from the checkpoint in --out, with its URL, run and mode.",
        ),
        click.option(
            "--override",
            is_flag=True,
            help="With --resume: let --url and --mode replace the checkpoint's "
            "(without it, a disagreement is an error).",
        ),
        click.option("--seed", type=int, default=None, help="Seed (default 0)."),
        click.option("--workers", type=int, default=None, help="Rollout workers (default 2)."),
        click.option(
            "--prompts-per-step",
            type=int,
            default=None,
            help="Prompts a step samples (default 4). With --agents http each turn reaches the "
            "gateway as one burst of prompts x group size requests (docs/capacity.md).",
        ),
        click.option(
            "--group-size",
            type=int,
            default=None,
            help="Samples per prompt, the group GRPO compares (default 8, at least 2).",
        ),
        click.option(
            "--gateways",
            type=int,
            default=None,
            help="With --agents http: session gateway processes (default 1). Each session sticks to "
            "one; a step's burst of requests is split between them (docs/capacity.md).",
        ),
        click.option(
            "--sync-every",
            type=int,
            default=None,
            help="Weight sync through the gate every N steps (default 1).",
        ),
        click.option(
            "--on-weight-update",
            type=click.Choice(["continue", "abort"]),
            default=None,
            help="What a weight update does to generations in flight: continue (the default: "
            "their tokens are kept and they resume under the new weights, one turn recorded with "
            "the version of each token) or abort (they are thrown away and the turn is redone).",
        ),
        click.option(
            "--checkpoint-every",
            type=int,
            default=None,
            help="Checkpoint every N steps (default 4).",
        ),
        click.option(
            "--ray-address",
            envvar="RAY_ADDRESS",
            default=None,
            metavar="ADDR",
            help="Join this Ray cluster instead of starting a private local Ray: HOST:PORT of its "
            "head, `auto` (the cluster `ray start` runs on this machine) or ray://HOST:PORT (Ray "
            "Client); `local` forces a private Ray. Falls back to $RAY_ADDRESS. On a cluster with "
            "nodes on other hosts, --url must name a server they all reach (docs/deploy.md).",
        ),
        click.option(
            "--placement",
            type=click.Choice(["spread", "pack"]),
            default=None,
            help="Rollout workers over the nodes: spread (round-robin over the nodes that offer "
            "--worker-resources, each pinned; the default) or pack (Ray places them by resources).",
        ),
        click.option(
            "--worker-resources",
            default=None,
            metavar="NAME=N,...",
            help="Ray resources each rollout worker claims, e.g. GPU=1 or rollout=1 (a custom "
            "resource the rollout nodes declare). Default: none.",
        ),
        click.option(
            "--durability",
            type=click.Choice(["none", "replicas", "aof", "replicas+aof"]),
            default=None,
            help="What every role's mutating calls wait for (docs/durability.md): none (the "
            "default), replicas (WAIT), aof (WAITAOF) or replicas+aof. Falls back to "
            "$TRACESTORE_DURABILITY; the server must be able to give it.",
        ),
        click.option(
            "--durability-replicas",
            type=click.IntRange(1, 16),
            default=None,
            metavar="N",
            help="Replicas a write must reach with --durability replicas (default 1, or "
            "$TRACESTORE_DURABILITY_REPLICAS).",
        ),
        click.option(
            "--durability-timeout",
            type=click.FloatRange(0, 60, min_open=True),
            default=None,
            metavar="SECONDS",
            help="How long a call waits for that confirmation before it raises "
            "DurabilityUnconfirmed (default 1, or $TRACESTORE_DURABILITY_TIMEOUT_S).",
        ),
        click.option(
            "--learner-resources",
            default=None,
            metavar="NAME=N,...",
            help="Ray resources the learner claims (its evaluation runs in it), e.g. GPU=1 or "
            "learner=1. Default: none (beside the driver).",
        ),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@main.command("train")
@train_options
def train(**kw: Any) -> None:
    """Run the reference agentic RL loop (tiny MoE policy, calculator task) on Ray.

    \b
    Exit codes:
      0    the run ended with nothing leaked (no live session, no held ref,
           no poisoned lease, one release event per session)
      1    a leak or a violated invariant
      0    also: --resume of a run that already finished (it says so, and
           changes nothing)
      2    a bad configuration (unknown mode, --steps 0, a --resume flag that
           disagrees with the checkpoint, no checkpoint to resume), or a run
           another trainer holds (the message names it: host, pid, since when)
      3    the store is unreachable (at the start, from the driver or from a
           Ray node, or mid-run: the message names the URL and the command
           that resumes)
      4    the learner, the producer or every rollout worker was lost (its
           Ray node died); a lost rollout worker alone does not end the run
      130  interrupted (Ctrl-C): the message gives the command that resumes
    """
    train_command(**kw)
