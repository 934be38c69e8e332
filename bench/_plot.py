"""Small PNG line charts for the benchmark reports, drawn with Pillow (no matplotlib on the project's machines).

One figure = side-by-side panels sharing the x categories (e.g. concurrency 1, 16, 64, 256); each panel draws named
series as lines with markers, a y axis from 0 (or log-scaled), a legend and a title.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["Panel", "save_figure"]

_COLORS: Final = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]
_W: Final = 560
_H: Final = 400
_LEFT: Final = 78
_RIGHT: Final = 20
_TOP: Final = 44
_BOTTOM: Final = 58


@dataclass(slots=True)
class Panel:
    """One chart: ``series`` maps a name to one value per x label (None = no point)."""

    title: str
    y_label: str
    x_label: str
    x: list[str]
    series: dict[str, list[float | None]] = field(default_factory=dict)
    log_y: bool = False
    #: Horizontal reference lines: label -> y value (e.g. a goal).
    marks: dict[str, float] = field(default_factory=dict)


def _nice_ticks(top: float) -> list[float]:
    if top <= 0 or not math.isfinite(top):
        return [0.0, 1.0]
    raw = top / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    count = math.ceil(top / step)
    return [i * step for i in range(count + 1)]


def _label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value / 1000:g}k"
    if abs(value) >= 1:
        return f"{value:g}"
    return f"{value:.3g}"


def _draw_panel(draw: ImageDraw.ImageDraw, panel: Panel, x0: int, font: ImageFont.FreeTypeFont) -> None:
    small = font.font_variant(size=12)
    plot_w = _W - _LEFT - _RIGHT
    plot_h = _H - _TOP - _BOTTOM
    left, top = x0 + _LEFT, _TOP
    values = [v for s in panel.series.values() for v in s if v is not None and math.isfinite(v)]
    values += list(panel.marks.values())
    if panel.log_y:
        positive = [v for v in values if v > 0] or [1.0]
        lo_exp = math.floor(math.log10(min(positive)))
        hi_exp = math.ceil(math.log10(max(positive)))
        hi_exp = max(hi_exp, lo_exp + 1)
        ticks = [10.0**e for e in range(lo_exp, hi_exp + 1)]

        def to_y(v: float) -> float:
            v = max(v, ticks[0])
            return top + plot_h * (1 - (math.log10(v) - lo_exp) / (hi_exp - lo_exp))
    else:
        ticks = _nice_ticks(max(values, default=1.0) * 1.05)
        span = ticks[-1] or 1.0

        def to_y(v: float) -> float:
            return top + plot_h * (1 - v / span)

    draw.text((x0 + _W // 2, 8), panel.title, fill="black", font=font, anchor="mt")
    for tick in ticks:
        y = to_y(tick)
        draw.line([(left, y), (left + plot_w, y)], fill="#e6e6e6")
        draw.text((left - 6, y), _label(tick), fill="black", font=small, anchor="rm")
    draw.rectangle([left, top, left + plot_w, top + plot_h], outline="black")
    n = len(panel.x)
    xs = [left + plot_w * (i + 0.5) / n for i in range(n)]
    for x, name in zip(xs, panel.x, strict=True):
        draw.line([(x, top + plot_h), (x, top + plot_h + 4)], fill="black")
        draw.text((x, top + plot_h + 8), name, fill="black", font=small, anchor="mt")
    draw.text((left + plot_w / 2, _H - 10), panel.x_label, fill="black", font=small, anchor="mb")
    draw.text((x0 + 6, top - 14), panel.y_label, fill="black", font=small, anchor="lm")
    for label, value in panel.marks.items():
        y = to_y(value)
        for start in range(int(left), int(left + plot_w), 10):
            draw.line([(start, y), (min(start + 5, left + plot_w), y)], fill="#555555")
        draw.text((left + plot_w - 4, y - 3), label, fill="#555555", font=small, anchor="rb")
    legend_y = top + 6
    for color, (name, series) in zip(_COLORS, panel.series.items(), strict=False):
        points = [(x, to_y(v)) for x, v in zip(xs, series, strict=True) if v is not None and math.isfinite(v)]
        if len(points) > 1:
            draw.line(points, fill=color, width=2)
        for x, y in points:
            draw.ellipse([x - 3.5, y - 3.5, x + 3.5, y + 3.5], fill=color)
        draw.line([(left + 10, legend_y), (left + 30, legend_y)], fill=color, width=3)
        draw.text((left + 36, legend_y), name, fill="black", font=small, anchor="lm")
        legend_y += 16


def save_figure(path: Path, panels: list[Panel]) -> None:
    """Draw ``panels`` side by side into one PNG at ``path``."""
    image = Image.new("RGB", (_W * len(panels), _H), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=15)
    if not isinstance(font, ImageFont.FreeTypeFont):  # Pillow without FreeType: the bitmap font has no sizes
        raise RuntimeError("Pillow was built without FreeType; cannot draw text")
    for i, panel in enumerate(panels):
        _draw_panel(draw, panel, i * _W, font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
