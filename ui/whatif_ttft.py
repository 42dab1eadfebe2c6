"""The What-if tab's predicted TTFT vs cache capacity, beside the hit-ratio curves.

Plain data in: rows as `app.replay.whatif_twin.run` returns them (page_rows, budget (None:
infinite), ttft_s with p50 and p90 in seconds). p50 is a solid line, p90 a dashed one in the
same colour; the infinite-capacity run is a flat line of its own, as on the hit-ratio plot.
"""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QWidget

from .colors import theme_for
from .whatif import BOUND_LABEL, PlotStack, policy_color

PERCENTILE_STYLES = (("p50", Qt.PenStyle.SolidLine), ("p90", Qt.PenStyle.DashLine))


def ttft_curves(rows: list[dict]) -> dict[tuple[int, str], tuple[list[int], list[float]]]:
    """(page_rows, percentile) -> (finite budgets, predicted TTFT seconds), budgets ascending."""
    out: dict[tuple[int, str], tuple[list[int], list[float]]] = {}
    for r in sorted((r for r in rows if r["budget"] is not None), key=lambda r: r["budget"]):
        for pct, _ in PERCENTILE_STYLES:
            xs, ys = out.setdefault((r["page_rows"], pct), ([], []))
            xs.append(r["budget"])
            ys.append(r["ttft_s"][pct])
    return out


class TtftChart(PlotStack):
    """One plot: the twin's TTFT p50 and p90 (seconds) against the cache's capacity (log pages)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__((("Predicted TTFT vs cache capacity (the twin)", "capacity (pages, log)",
                           "TTFT (s)"),), parent)
        self.plot = self.plots[0]
        self.plot.getPlotItem().setLogMode(x=True, y=False)
        self.apply_theme(theme_for(self))

    def set_rows(self, rows: list[dict]) -> None:
        self.rows = list(rows)
        self._draw()

    def _draw(self) -> None:
        self._clear()
        several_sizes = len({r["page_rows"] for r in self.rows}) > 1
        sizes = sorted({r["page_rows"] for r in self.rows})
        styles = dict(PERCENTILE_STYLES)
        lines = ttft_curves(self.rows)
        for (rows, pct), (budgets, seconds) in sorted(lines.items()):
            color = policy_color(self.rows[0]["policy"], 0) if not several_sizes else \
                policy_color("", sizes.index(rows) + 1)
            pen = pg.mkPen(color, width=2.2, style=styles[pct])
            name = f"TTFT {pct}, {rows}-token pages" if several_sizes else f"TTFT {pct}"
            self.plot.plot(budgets, seconds, pen=pen, symbol="o", symbolSize=6, symbolBrush=color,
                           symbolPen=None, name=name)
        xs = [b for bs, _ in lines.values() for b in bs]
        lo, hi = (min(xs), max(xs)) if xs else (1, 10)
        for r in (r for r in self.rows if r["budget"] is None):
            value = r["ttft_s"]["p50"]
            label = f"{BOUND_LABEL}, {r['page_rows']}-token pages" if several_sizes else BOUND_LABEL
            pen = pg.mkPen(self.theme.foreground, width=1.5, style=Qt.PenStyle.DotLine)
            self.plot.plot([lo, hi], [value, value], pen=pen, name=f"TTFT p50, {label} ({value:.3g} s)")
        item = self.plot.getPlotItem()
        ticks = [(math.log10(b), f"{b:,}") for b in sorted(set(xs))]
        item.getAxis("bottom").setTicks([ticks] if ticks else None)
        item.legend.setColumnCount(max(1, min(3, len(item.legend.items))))
        top = max((r["ttft_s"]["p90"] for r in self.rows), default=0.0)
        item.vb.setYRange(0, max(top, 1e-3), padding=0.05)
        item.vb.enableAutoRange(x=True)
