"""Line charts drawn as SVG on the server: no chart library, no script, no third-party code in the page.

One function: `line_chart(title, series)`. Each series becomes one <polyline>
whose `points` hold one x,y pair per data point. A job's curves come already
downsampled to at most MAX_POINTS (min and max per bucket, daemon/web/history.py);
anything longer is thinned evenly here. `data-reported` keeps the true count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

MAX_POINTS = 1000  # more than the 640-px-wide plot can show
W, H = 640, 200
PAD_L, PAD_R, PAD_T, PAD_B = 56, 12, 24, 28


@dataclass
class Line:
    name: str
    points: Sequence[tuple[float, float]]  # (x, y), x ascending
    css: str = "s0"  # the stroke colour class (see pages.CSS)
    reported: int | None = None  # how many points there were before the caller thinned them (default: len(points))


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi] (1, 2, 5 × a power of ten apart)."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, v = [], first
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def fmt(v: float) -> str:
    a = abs(v)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{v:.1e}"
    return f"{v:.4g}"


def thin(points: Sequence[Any], most: int = MAX_POINTS) -> list[Any]:
    """Every k-th item (and always the last) so that at most about `most` remain."""
    if len(points) <= most:
        return list(points)
    k = math.ceil(len(points) / most)
    out = list(points[::k])
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


def line_chart(title: str, lines: Sequence[Line], x_label: str = "step", unit: str = "", chart_id: str = "") -> str:
    lines = [ln for ln in lines]
    finite = [(x, y) for ln in lines for x, y in ln.points if math.isfinite(x) and math.isfinite(y)]
    head = (f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {W} {H}" role="img" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
            f'<text class="ct" x="{PAD_L}" y="15">{escape(title)}{" (" + escape(unit) + ")" if unit else ""}</text>')
    if not finite:
        return head + f'<text class="empty" x="{W // 2}" y="{H // 2}" text-anchor="middle">no data yet</text></svg>'
    xs, ys = [p[0] for p in finite], [p[1] for p in finite]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.05 or 0.5), y1 + (abs(y1) * 0.05 or 0.5)
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def sx(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return PAD_T + ph - (y - y0) / (y1 - y0) * ph

    parts = [head, f'<rect class="frame" x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}"/>']
    for t in nice_ticks(y0, y1):
        if y0 <= t <= y1:
            parts.append(f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                         f'<text class="tick" x="{PAD_L - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    for t in nice_ticks(x0, x1, 6):
        if x0 <= t <= x1:
            parts.append(f'<text class="tick" x="{sx(t):.1f}" y="{H - PAD_B + 14}" text-anchor="middle">{fmt(t)}</text>')
    parts.append(f'<text class="tick" x="{W - PAD_R}" y="{H - 2}" text-anchor="end">{escape(x_label)}</text>')
    for i, ln in enumerate(lines):
        pts = [(x, y) for x, y in ln.points if math.isfinite(x) and math.isfinite(y)]
        drawn = thin(pts)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in drawn)
        parts.append(f'<polyline class="line {escape(ln.css)}" data-series="{escape(ln.name)}" '
                     f'data-points="{len(drawn)}" data-reported="{ln.reported or len(pts)}" points="{coords}"/>')
        if len(lines) > 1:
            parts.append(f'<text class="legend {escape(ln.css)}" x="{W - PAD_R - 4}" y="{PAD_T + 14 + 14 * i}" '
                         f'text-anchor="end">{escape(ln.name)}</text>')
    parts.append("</svg>")
    return "".join(parts)
