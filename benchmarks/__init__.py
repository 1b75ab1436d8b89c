"""tracestore benchmarks: ``python -m benchmarks [name ...]`` (or ``make bench``).

Each ``benchmarks/bench_<name>.py`` exposes ``run(quick: bool) -> dict`` and
is run side by side with its baselines in one process; figures are written to
``benchmarks/results/<name>.json`` and summarised in ``docs/benchmarks.md``.
Benchmarks are never part of the test suite: on shared 2-core machines only
ratios measured in one run are meaningful.
"""
