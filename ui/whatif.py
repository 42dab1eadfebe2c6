"""What-if charts of a trace replay: hit ratio vs cache capacity per policy, and over time;
the twin's predicted TTFT at the same capacities on the first plot's right axis.

Plain data in: rows as `prefixlab replay --json` writes them (page_rows, budget
(None: infinite), policy, token_hit_ratio, over_time). The infinite-capacity
row of each page size is the bound every curve is drawn against (a dashed line).
"""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QVBoxLayout, QWidget

from engine.eviction import DEFAULT_POLICY

from .colors import LIGHT, Theme, theme_for
from .whatif_ttft import TtftAxis

# Okabe-Ito hues, one per policy (colour-blind safe); other names cycle through the rest.
POLICY_COLORS = {"leaf-lru": "#1fa774", "lru": "#d55e00", "lfu": "#3d85c6", "fifo": "#cc5fa0"}
_SPARE = ("#e69f00", "#8e6bd8", "#56b4e9", "#999999")
BOUND_LABEL = "infinite capacity"


def policy_color(policy: str, index: int = 0) -> QColor:
    return QColor(POLICY_COLORS.get(policy, _SPARE[index % len(_SPARE)]))


Curve = tuple[list[float], list[float]]
# Two-tier curves (a disk tier under the pool) wear their policy's colour in these dashes.
DISK_STYLES = (Qt.PenStyle.DotLine, Qt.PenStyle.DashDotLine, Qt.PenStyle.DashDotDotLine)


def curves(rows: list[dict]) -> tuple[dict[tuple[int, str, int], Curve], dict[int, float]]:
    """(page_rows, policy, disk tier pages (0: none)) -> (budgets, hit ratios) over finite
    budgets, and page_rows -> the bound."""
    lines: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    bound: dict[int, float] = {}
    for r in rows:
        if r["budget"] is None:
            bound[r["page_rows"]] = max(bound.get(r["page_rows"], 0.0), r["token_hit_ratio"])
        else:
            key = (r["page_rows"], r["policy"], r.get("disk_budget") or 0)
            lines.setdefault(key, []).append((r["budget"], r["token_hit_ratio"]))
    out = {}
    for key, pts in lines.items():
        pts.sort()
        out[key] = ([p[0] for p in pts], [p[1] for p in pts])
    return out, bound


class PlotStack(QWidget):
    """Plots one above the other, each with its legend under its x axis, following the app's theme;
    a subclass draws them in `_draw`."""

    def __init__(self, specs, parent: QWidget | None = None):
        """`specs`: (title, x label, y label) per plot; they become `self.plots`."""
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.plots: list[pg.PlotWidget] = []
        for title, x, y in specs:
            pw = pg.PlotWidget(self)
            pw.setMenuEnabled(False)
            item = pw.getPlotItem()
            item.setTitle(title)
            item.setLabel("bottom", x)
            item.setLabel("left", y)
            item.getAxis("left").enableAutoSIPrefix(False)
            item.getAxis("bottom").enableAutoSIPrefix(False)
            item.showGrid(x=True, y=True, alpha=0.25)
            # Under the x axis, in the plot's own layout: the legend never covers a curve.
            item.legend = pg.LegendItem(frame=False, labelTextSize="8.5pt", horSpacing=12)
            item.layout.addItem(item.legend, 4, 1, alignment=Qt.AlignmentFlag.AlignHCenter)
            layout.addWidget(pw)
            self.plots.append(pw)
        self.rows: list[dict] = []
        self.theme = LIGHT

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        if event.type() == QEvent.Type.PaletteChange:  # the app's theme changed
            self.apply_theme(theme_for(self))
        super().changeEvent(event)

    def apply_theme(self, theme: Theme = LIGHT) -> None:
        self.theme = theme
        for pw in self.plots:
            pw.setBackground(theme.background)
            item = pw.getPlotItem()
            for name in ("left", "bottom"):
                axis = item.getAxis(name)
                axis.setPen(pg.mkPen(theme.grid))
                axis.setTextPen(pg.mkPen(theme.muted))
            item.titleLabel.setAttr("color", theme.foreground)
            item.legend.setLabelTextColor(theme.foreground)
        self._draw()

    def _clear(self) -> None:
        for pw in self.plots:
            pw.getPlotItem().clear()
            pw.getPlotItem().legend.clear()

    def _draw(self) -> None:
        raise NotImplementedError


class WhatIfChart(PlotStack):
    """Two plots: hit ratio vs capacity (log pages) per policy (with the predicted TTFT on its right
    axis), and hit ratio over the trace."""

    def __init__(self, parent: QWidget | None = None):
        y = "token hit ratio (%)"
        super().__init__((("Token hit ratio vs cache capacity", "capacity (pages, log)", y),
                          ("Token hit ratio over the trace", "arrival (s)", y)), parent)
        self.capacity, self.over_time = self.plots
        self.capacity.getPlotItem().setLogMode(x=True, y=False)
        self.over_time_budget: int | None = None
        self.ttft = TtftAxis(self.capacity)
        self.ttft_rows: list[dict] = []
        self.apply_theme(theme_for(self))

    def set_rows(self, rows: list[dict], over_time_budget: int | None = None) -> None:
        """Draw these replay rows; the lower plot shows each policy at `over_time_budget`
        (default: the middle finite budget) against the infinite bound."""
        self.rows, self.ttft_rows = list(rows), []  # a prediction belongs to the sweep it followed
        finite = sorted({r["budget"] for r in self.rows if r["budget"] is not None})
        if over_time_budget is None and finite:
            over_time_budget = finite[(len(finite) - 1) // 2]
        self.over_time_budget = over_time_budget
        self._draw()

    def set_ttft_rows(self, rows: list[dict]) -> None:
        """The twin's rows (`app.replay.whatif_twin.run`) for the capacities these rows sweep."""
        self.ttft_rows = list(rows)
        self._draw()

    def _draw(self) -> None:
        self._clear()
        lines, bound = curves(self.rows)
        several_sizes = len({r["page_rows"] for r in self.rows}) > 1
        policies = sorted({pol for _, pol, _ in lines})
        disks = sorted({d for _, _, d in lines if d})
        xs = [b for bs, _ in lines.values() for b in bs]
        for (rows, policy, disk), (budgets, ratios) in sorted(lines.items(), key=_engine_last):
            name = f"{policy}, {rows}-token pages" if several_sizes else policy
            pen = pg.mkPen(policy_color(policy, policies.index(policy)), width=2.2)
            if disk:  # a disk tier under each capacity: the same colour, its own dashes
                name += f" + {disk:,} disk pages"
                pen.setStyle(DISK_STYLES[disks.index(disk) % len(DISK_STYLES)])
            self.capacity.plot(budgets, [100 * r for r in ratios], pen=pen, symbol="t" if disk else "o",
                               symbolSize=6, symbolBrush=pen.color(), symbolPen=None, name=name)
        lo, hi = (min(xs), max(xs)) if xs else (1, 10)
        for rows, value in sorted(bound.items()):
            name = f"{BOUND_LABEL}, {rows}-token pages" if several_sizes else BOUND_LABEL
            pen = pg.mkPen(self.theme.foreground, width=1.5, style=Qt.PenStyle.DashLine)
            self.capacity.plot([lo, hi], [100 * value, 100 * value], pen=pen, name=f"{name} ({value:.1%})")
        # Log axis: label the budgets themselves, not every power of ten's minor ticks.
        ticks = [(math.log10(b), f"{b:,}") for b in sorted(set(xs))]
        self.capacity.getPlotItem().getAxis("bottom").setTicks([ticks] if ticks else None)
        self.ttft.draw(self.ttft_rows, self.theme, lo, hi)
        self._draw_over_time()
        for pw in (self.capacity, self.over_time):
            legend = pw.getPlotItem().legend
            legend.setColumnCount(max(1, min(3, len(legend.items))))  # narrow enough for a side pane
            pw.getPlotItem().vb.setYRange(0, 100 * max(0.05, _top(self.rows)), padding=0.05)
            pw.getPlotItem().vb.enableAutoRange(x=True)

    def _draw_over_time(self) -> None:
        """Hit ratio per window: the infinite bound, and each policy at the chosen budget."""
        shown = {}
        for r in self.rows:
            if r["budget"] is None:
                shown.setdefault("bound", r)
            elif r["budget"] == self.over_time_budget and not r.get("disk_budget"):
                shown.setdefault(r["policy"], r)
        policies = sorted(k for k in shown if k != "bound")
        for key, r in sorted(shown.items(), key=lambda kv: (kv[0] == DEFAULT_POLICY, kv[0])):
            series = r.get("over_time") or []
            if not series:
                continue
            if key == "bound":
                pen = pg.mkPen(self.theme.foreground, width=1.5, style=Qt.PenStyle.DashLine)
                name = BOUND_LABEL
            else:
                pen = pg.mkPen(policy_color(key, policies.index(key)), width=2.0)
                name = f"{key} at {r['budget']:,} pages"
            self.over_time.plot([p["t"] for p in series], [100 * p["token_hit_ratio"] for p in series],
                                pen=pen, name=name)


def _engine_last(item) -> tuple:
    """Draw the engine's own policy last, on top of any curve it coincides with."""
    (rows, policy, disk), _ = item
    return rows, policy == DEFAULT_POLICY, policy, disk


def _top(rows: list[dict]) -> float:
    values = [r["token_hit_ratio"] for r in rows]
    values += [p["token_hit_ratio"] for r in rows for p in r.get("over_time") or []]
    return max(values, default=0.0)
