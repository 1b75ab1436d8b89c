"""Inline SVG plots of the viewer (pure: strings in, strings out; no script, no external file).

Three kinds, where a person would rather look than read: stacked bars
(tokens per turn), a histogram (staleness of tokens or groups, in versions),
a timeline (the gate's weight-update cycles: sealed, drained, reopened), and
a sparkline (release events over the last minutes). Every shape carries a
``<title>`` so hovering shows its figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from .views import CycleRow

#: Colours: prompt tokens, generated tokens, a cycle's drain, the rest of a seal, install marks.
PROMPT = "#b8c4d6"
GENERATED = "#3b7dd8"
DRAIN = "#e8a33d"
SEALED = "#d9534f"
INSTALL = "#2e8b57"


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (
        f'<svg class="plot" role="img" aria-label="{escape(label)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">{"".join(body)}</svg>'
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return (f'<rect{c} x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{max(h, 0):.1f}" fill="{fill}">'
            f"<title>{escape(title)}</title></rect>")


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 10) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="#444">{escape(s)}</text>'


def stacked_bars(
    bars: Sequence[tuple[str, int, int]], *, label: str, names: tuple[str, str] = ("prompt", "generated"),
    width: int = 720, height: int = 160,
) -> str:
    """Bars of two stacked parts each: ``(name, lower part, upper part)`` (e.g. prompt and generated tokens)."""
    if not bars:
        return ""
    top = max(1, max(a + b for _, a, b in bars))
    left, bottom, plot_h = 40, 18, height - 30
    step = min(48.0, (width - left - 4) / len(bars))
    w = max(1.0, step * 0.8)
    body = [_text(left - 4, 12, str(top), "end"), _text(left - 4, height - bottom, "0", "end")]
    for i, (name, a, b) in enumerate(bars):
        x = left + i * step
        ha, hb = plot_h * a / top, plot_h * b / top
        base = height - bottom
        body.append(_rect(x, base - ha, w, ha, PROMPT, f"{name}: {a} {names[0]}", "bar-a"))
        body.append(_rect(x, base - ha - hb, w, hb, GENERATED, f"{name}: {b} {names[1]}", "bar-b"))
    if len(bars) <= 40:
        for i, (name, _, _) in enumerate(bars):
            body.append(_text(left + i * step + w / 2, height - 4, name, "middle", 9))
    body.append(_legend(width, [(PROMPT, names[0]), (GENERATED, names[1])]))
    return _svg(width, height, body, label)


def _legend(width: int, items: Sequence[tuple[str, str]]) -> str:
    out, x = [], width - 8 - 90 * len(items)
    for colour, name in items:
        out.append(f'<rect x="{x}" y="2" width="10" height="10" fill="{colour}"/>')
        out.append(_text(x + 14, 11, name))
        x += 90
    return "".join(out)


def histogram(counts: Sequence[int], *, label: str, names: Sequence[str], width: int = 360, height: int = 130) -> str:
    """One bar per bucket, named by ``names`` (same length as ``counts``)."""
    if not counts or not any(counts):
        return ""
    top = max(counts)
    left, bottom, plot_h = 36, 18, height - 30
    step = min(40.0, (width - left - 4) / len(counts))
    body = [_text(left - 4, 12, str(top), "end"), _text(left - 4, height - bottom, "0", "end")]
    for i, (n, name) in enumerate(zip(counts, names, strict=True)):
        h = plot_h * n / top
        x = left + i * step
        body.append(_rect(x, height - bottom - h, step * 0.85, h, GENERATED, f"{name}: {n}", "bin"))
        body.append(_text(x + step * 0.42, height - 4, name, "middle", 9))
    return _svg(width, height, body, label)


def timeline(cycles: Sequence[CycleRow], now_ms: int, *, width: int = 720, height: int = 70) -> str:
    """The gate's cycles on a time axis: each seal a bar (its drain part first), installs as marks."""
    spans = [c for c in cycles if c.sealed_ms is not None]
    if not spans:
        return ""
    start = min(c.sealed_ms for c in spans if c.sealed_ms is not None)
    end = max(now_ms, *(c.reopened_ms or now_ms for c in spans))
    span = max(1, end - start)
    left, right = 8, width - 8

    def x(ms: int) -> float:
        return left + (right - left) * (ms - start) / span

    body = [f'<line x1="{left}" y1="40" x2="{right}" y2="40" stroke="#999"/>']
    for c in spans:
        assert c.sealed_ms is not None
        s, e = c.sealed_ms, c.reopened_ms or now_ms
        d = c.drained_ms if c.drained_ms is not None else e
        what = f"v{c.version_from} -> v{c.version_to}: drain {c.drain_ms} ms, sealed {c.sealed_for_ms or 'still'} ms"
        body.append(_rect(x(s), 28, x(min(d, e)) - x(s), 24, DRAIN, "drain: " + what, "drain"))
        body.append(_rect(x(min(d, e)), 28, x(e) - x(min(d, e)), 24, SEALED, "sealed: " + what, "sealed"))
        if c.installed_ms is not None:
            body.append(f'<line x1="{x(c.installed_ms):.1f}" y1="22" x2="{x(c.installed_ms):.1f}" y2="58" '
                        f'stroke="{INSTALL}" stroke-width="2"><title>install v{c.version_to}</title></line>')
    body.append(_text(left, 14, f"{(end - start) / 1000:.1f} s shown"))
    body.append(_legend(width, [(DRAIN, "draining"), (SEALED, "sealed"), (INSTALL, "install")]))
    return _svg(width, height, body, "gate timeline")


def sparkline(buckets: Sequence[int], bucket_s: int, *, width: int = 300, height: int = 40) -> str:
    """Counts per bucket as a line, oldest left (release events over time)."""
    if not buckets:
        return ""
    top = max(1, max(buckets))
    step = width / max(1, len(buckets) - 1)
    pts = " ".join(f"{i * step:.1f},{height - 2 - (height - 6) * n / top:.1f}" for i, n in enumerate(buckets))
    body = [f'<polyline points="{pts}" fill="none" stroke="{GENERATED}" stroke-width="1.5"/>']
    for i, n in enumerate(buckets):
        ago = (len(buckets) - 1 - i) * bucket_s
        body.append(f'<circle cx="{i * step:.1f}" cy="{height - 2 - (height - 6) * n / top:.1f}" r="2" '
                    f'fill="{GENERATED}"><title>{n} events, {ago}-{ago + bucket_s} s ago</title></circle>')
    return _svg(width, height, body, "release events")


def staleness_colour(staleness: int) -> str:
    """Background of a token ``staleness`` versions behind the gate: green (current) to red (8 or more)."""
    s = min(max(staleness, 0), 8)
    return f"hsl({120 - 15 * s}, 65%, {86 - s}%)"


__all__ = ["histogram", "sparkline", "stacked_bars", "staleness_colour", "timeline"]
