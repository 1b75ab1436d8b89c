"""The public API is precisely typed on both stores: mypy --strict over tests/typing_api.py.

``await astore.lookup(...)`` must be a ``PrefixMatch`` (not ``Any``),
``store.gate`` a ``Gate`` / ``AsyncGate``, and wrong calls must stay
errors. No server is needed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_async_and_sync_results_are_precisely_typed() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
            "--no-error-summary", str(ROOT / "tests" / "typing_api.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.splitlines()
    errors = [x for x in lines if ": error:" in x]
    assert proc.returncode == 0 and not errors, proc.stdout + proc.stderr
    revealed = [x.split('Revealed type is "', 1)[1].rstrip('"') for x in lines if "Revealed type" in x]
    assert revealed == [
        "tracestore.traces.types.PrefixMatch",
        "tracestore.gate.types.GateStatus",
        "tracestore.gate.AsyncGate",
        "tracestore.replay.AsyncReplay",
        "tracestore.router.AsyncRouter",
        "tuple[tracestore.traces.types.PrefixMatch, tracestore.gate.types.GateStatus]",
        "tracestore.traces.types.PrefixMatch",
        "tracestore.gate.types.GateStatus",
        "tuple[tracestore.traces.types.PrefixMatch, int]",
    ], proc.stdout
