"""Plain-text formatting for the CLI and the demo: tables, durations, times, bytes (no dependency)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Align ``rows`` under ``headers`` in columns separated by two spaces."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def human_duration(ms: float) -> str:
    """``ms`` milliseconds as a short duration: ``850 ms``, ``4.2 s``, ``3 min``, ``2.5 h``, ``3 days``."""
    a = abs(ms)
    if a < 1000:
        return f"{a:.0f} ms"
    if a < 60_000:
        return f"{a / 1000:.1f} s"
    if a < 3_600_000:
        return f"{a / 60_000:.0f} min"
    if a < 86_400_000:
        return f"{a / 3_600_000:.1f} h"
    return f"{a / 86_400_000:.1f} days"


def human_time(ms: int | None, now_ms: int) -> str:
    """A server timestamp (ms) as local time with its age: ``2026-11-30 17:59:01 (4.2 s ago)``.

    ``now_ms`` is the server clock, so the age does not depend on this
    machine's clock. ``-`` for None.
    """
    if ms is None:
        return "-"
    import time

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))
    delta = now_ms - ms
    when = f"{human_duration(delta)} ago" if delta >= 0 else f"in {human_duration(delta)}"
    return f"{stamp} ({when})"


def human_bytes(n: int) -> str:
    """``n`` bytes as ``512 B``, ``12.3 KiB``, ``4.5 MiB``, ``1.2 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover
