"""tracestore benchmarks: ``python -m benchmarks [name ...]`` (or ``make bench``).

Each ``benchmarks/bench_<name>.py`` exposes ``run(quick: bool) -> dict`` and
is run side by side with its baselines in one process; figures are written to
``benchmarks/results/<name>.json`` and summarised in ``docs/benchmarks.md``.
A ``--quick`` smoke run writes to ``benchmarks/results/quick/`` instead (not
committed), so it never overwrites the figures of a full run.
Benchmarks are never part of the test suite: on shared 2-core machines only
ratios measured in one run are meaningful.
"""

from pathlib import Path

_RESULTS = Path(__file__).resolve().parent / "results"


_OUT: list[Path] = []  # set by ``python -m benchmarks --out DIR``


def results_dir(quick: bool) -> Path:
    """Where a run writes its figures: ``--out DIR`` if given, else ``results/`` (full)
    or ``results/quick/`` (smoke)."""
    d = _OUT[-1] if _OUT else _RESULTS / "quick" if quick else _RESULTS
    d.mkdir(parents=True, exist_ok=True)
    return d
