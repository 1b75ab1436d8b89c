"""Run the benchmarks: ``python -m benchmarks [--quick] [name ...]``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path

import orjson

import benchmarks


def main(argv: list[str] | None = None) -> int:
    names = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {names})")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--out", help="write the figures here (default: benchmarks/results[/quick])")
    args = ap.parse_args(argv)
    if args.out:
        benchmarks._OUT.append(Path(args.out).resolve())
    chosen = args.names or names
    unknown = set(chosen) - set(names)
    if unknown:
        ap.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {names}")
    results = benchmarks.results_dir(args.quick)
    for name in chosen:
        mod = importlib.import_module(f"benchmarks.bench_{name}")
        print(f"== benchmark {name}", flush=True)
        start = time.perf_counter()
        figures = mod.run(quick=args.quick)
        figures["_wall_s"] = round(time.perf_counter() - start, 2)
        out = results / f"{name}.json"
        out.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        print(f"   wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
