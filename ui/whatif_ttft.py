"""The twin's predicted TTFT on the hit-ratio plot's own capacities: a second y axis (seconds,
on the right) over the same log capacity axis, so each capacity's hit ratio and its predicted
latency sit one above the other without a plot of their own (the tab must fit 1280x800).

Plain data in: rows as `app.replay.whatif_twin.run` returns them (page_rows, budget (None:
infinite), ttft_s with p50 and p90 in seconds). p50 is a solid line, p90 a dashed one in the
same colour; the infinite-capacity run a dotted flat line, as the hit ratio's bound is dashed.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt

from .colors import Theme

# Purple: no policy wears it (ui/whatif.py's POLICY_COLORS), so a latency line is never read as one.
TTFT_COLOR = "#8e6bd8"
PERCENTILE_STYLES = (("p50", Qt.PenStyle.SolidLine), ("p90", Qt.PenStyle.DashLine))
AXIS_LABEL = "predicted TTFT (s)"


def ttft_curves(rows: list[dict]) -> dict[tuple[int, str], tuple[list[int], list[float]]]:
    """(page_rows, percentile) -> (finite budgets, predicted TTFT seconds), budgets ascending."""
    out: dict[tuple[int, str], tuple[list[int], list[float]]] = {}
    for r in sorted((r for r in rows if r["budget"] is not None), key=lambda r: r["budget"]):
        for pct, _ in PERCENTILE_STYLES:
            xs, ys = out.setdefault((r["page_rows"], pct), ([], []))
            xs.append(r["budget"])
            ys.append(r["ttft_s"][pct])
    return out


class TtftAxis:
    """A right axis and its own view box on a capacity plot (log x), x linked to the plot's."""

    def __init__(self, pw: pg.PlotWidget):
        self.item = item = pw.getPlotItem()
        self.vb = pg.ViewBox()
        item.scene().addItem(self.vb)
        item.showAxis("right")
        self.axis = item.getAxis("right")
        self.axis.linkToView(self.vb)
        self.axis.setLabel(AXIS_LABEL)
        self.axis.enableAutoSIPrefix(False)
        self.vb.setXLink(item.vb)
        item.vb.sigResized.connect(self._follow)
        self.curves: list[pg.PlotDataItem] = []
        item.hideAxis("right")

    def _follow(self) -> None:
        self.vb.setGeometry(self.item.vb.sceneBoundingRect())
        self.vb.linkedViewChanged(self.item.vb, self.vb.XAxis)

    def draw(self, rows: list[dict], theme: Theme, lo: float, hi: float) -> None:
        """Draw these twin rows (none: no axis); `lo`..`hi`: the capacities the flat lines span.
        Each curve goes into the plot's legend under its name."""
        for c in self.curves:
            self.vb.removeItem(c)
        self.curves = []
        if not rows:
            self.item.hideAxis("right")
            return
        self.item.showAxis("right")
        self.axis.setPen(pg.mkPen(theme.grid))
        self.axis.setTextPen(pg.mkPen(TTFT_COLOR))
        several_sizes = len({r["page_rows"] for r in rows}) > 1
        styles = dict(PERCENTILE_STYLES)
        for (page_rows, pct), (budgets, seconds) in sorted(ttft_curves(rows).items()):
            name = f"TTFT {pct}, {page_rows}-token pages" if several_sizes else f"TTFT {pct}"
            self._add(budgets, seconds, pg.mkPen(TTFT_COLOR, width=2.2, style=styles[pct]), name, symbol="s")
        for r in (r for r in rows if r["budget"] is None):
            value = r["ttft_s"]["p50"]
            where = "infinite capacity" + (f", {r['page_rows']}-token pages" if several_sizes else "")
            self._add([lo, hi], [value, value], pg.mkPen(TTFT_COLOR, width=1.5, style=Qt.PenStyle.DotLine),
                      f"TTFT p50, {where} ({value:.3g} s)")
        top = max(r["ttft_s"]["p90"] for r in rows)
        self.vb.setYRange(0, max(top, 1e-3), padding=0.05)
        self._follow()

    def _add(self, xs, ys, pen, name: str, symbol: str | None = None) -> None:
        curve = pg.PlotDataItem(xs, ys, pen=pen, symbol=symbol, symbolSize=6,
                                symbolBrush=pen.color() if symbol else None, symbolPen=None, name=name)
        curve.setLogMode(True, False)  # the plot's log capacity axis; this box is not the plot's own
        self.vb.addItem(curve)
        self.item.legend.addItem(curve, name)
        self.curves.append(curve)
