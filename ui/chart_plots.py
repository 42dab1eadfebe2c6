"""The charts' five pyqtgraph plots, their curves, legends and theme (one ChartSet per panel or export)."""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QGraphicsItem, QGraphicsTextItem, QSizePolicy, QWidget

from .chart_data import (
    BAR_SLOTS,
    CHARTS,
    LABELS,
    PART_SERIES,
    REQUEST_SERIES,
    STACK,
    STEP,
    TITLES,
    TimelineBuffer,
    step_changes,
)
from .colors import PART_COLORS, Theme, series_color, with_alpha

pg.setConfigOptions(antialias=True)
# A transparent pen, not None: a PlotDataItem without a pen hides its curve and path.
_CLEAR = pg.mkPen((0, 0, 0, 0))
# Text is most of a plot's paint: axes with their tick labels and grid, titles, legends.
_STATIC_ITEMS = (pg.AxisItem, pg.LabelItem, pg.LegendItem, pg.ItemSample, QGraphicsTextItem)


def cache_static_items(pw: pg.PlotWidget) -> None:
    """Keep the plot's text items as pixmaps, redrawn only when they change (a new range, a
    theme), not whenever a curve moves: the five charts' repaint measured 35 -> 5 ms."""
    for item in pw.scene().items():
        if isinstance(item, _STATIC_ITEMS):
            item.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)


def _mix(color: QColor, background: QColor, amount: float) -> QColor:
    """color over background at `amount` opacity, as an opaque colour."""
    return QColor(*(round(amount * a + (1 - amount) * b) for a, b in
                    ((color.red(), background.red()), (color.green(), background.green()),
                     (color.blue(), background.blue()))))


class _Swatch(pg.ItemSample):
    """Legend sample: a filled square for areas and bars, a thick line for curves."""

    def paint(self, p, *args):
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        item = self.item
        alpha = 255 if item.isVisible() else 60
        area = isinstance(item, pg.PlotDataItem) and item.opts.get("fillLevel") is not None
        if area or isinstance(item, pg.BarGraphItem):
            brush = pg.mkBrush(item.opts["fillBrush"] if area else item.opts["brush"])
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(with_alpha(brush.color(), alpha))
            p.drawRoundedRect(QRectF(3, 4, 14, 12), 3, 3)
            return
        pen = QPen(with_alpha(pg.mkPen(item.opts["pen"]).color(), alpha))
        pen.setWidthF(2.5)
        pen.setStyle(pg.mkPen(item.opts["pen"]).style())
        pen.setCapStyle(Qt.PenCapStyle.RoundCap)
        p.setPen(pen)
        p.drawLine(3, 10, 17, 10)


class _PlotWidget(pg.PlotWidget):
    """A PlotWidget that adds up how long it paints (the refresh timer backs off by it).

    One data refresh can cost more than one paint (the hit-rate axis' own view follows the
    plot's), so the timer needs the sum since its last look, not the last paint alone.
    """

    paint_s = 0.0         # the last paint
    painted_s = 0.0       # every paint since the charts panel last took the sum

    def paintEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        t0 = time.perf_counter()
        super().paintEvent(ev)
        self.paint_s = time.perf_counter() - t0
        self.painted_s += self.paint_s


class _ViewBox(pg.ViewBox):
    """A ViewBox whose auto-range reads the extent `ChartSet.refresh` computed from the columns it
    plotted, not pyqtgraph's walk over every item's data (~2 ms a plot per refresh, on the UI
    thread the engine worker shares the GIL with); pyqtgraph's own walk while time is zoomed."""

    extent: list | None = None  # [[x0, x1], [y0, y1]] of what sizes the view; None: pyqtgraph's

    def childrenBounds(self, frac=None, orthoRange=(None, None), items=None):  # noqa: N802
        if self.extent is None or items is not None or self.state["autoRange"][0] is False:
            return super().childrenBounds(frac=frac, orthoRange=orthoRange, items=items)
        return [list(self.extent[0]), list(self.extent[1])]


class _IntAxis(pg.AxisItem):
    """An axis for request ids: integer ticks only."""

    def tickValues(self, minVal, maxVal, size):  # noqa: N802 - pyqtgraph's name
        levels = []
        for spacing, values in super().tickValues(minVal, maxVal, size):
            if spacing >= 1:
                levels.append((spacing, [v for v in values if float(v).is_integer()]))
        return levels or [(1.0, [float(v) for v in range(int(np.ceil(minVal)), int(maxVal) + 1)])]

    def tickStrings(self, values, scale, spacing):  # noqa: N802
        return [str(int(round(v))) for v in values]


def pool_ceiling(capacity: float, in_use: float) -> float:
    """The top of the pool chart: the whole pool while what is in use fills a good part of it,
    else twice the most pages ever in use (at least 32), so a big pool's few used pages show."""
    return capacity if in_use * 4 >= capacity else min(capacity, max(2 * in_use, 32.0))


# The series whose values size each timeline chart's view (every one of them is filled down to
# 0 or drawn over such a fill, so 0 is the bottom); the TTFT bars keep pyqtgraph's bounds.
EXTENT_SERIES = {"pool": ("pages_private", "pages_shared", "pages_cached", "pool_ceiling"),
                 "cache": ("chains", "cached_pages"), "hits": ("hits", "disk_hits"),
                 "prefill": ("prefill_computed", "prefill_saved")}


class ChartSet:
    """The five plot widgets and their items; ChartsPanel owns one, exports make their own."""

    def __init__(self, parent: QWidget | None = None):
        self.widgets: dict[str, pg.PlotWidget] = {}
        self.curves: dict[str, pg.PlotDataItem] = {}   # timeline series -> its (top) curve
        self.bars: dict[str, pg.BarGraphItem] = {}
        self.areas: dict[str, pg.PlotDataItem] = {}    # fill-only twins of some curves
        self.legends: dict[str, pg.LegendItem] = {}
        for name in CHARTS:
            axis = {"bottom": _IntAxis("bottom")} if name in ("ttft", "parts") else \
                {"left": _IntAxis("left")} if name in ("pool", "cache", "hits") else None  # counts
            fitted = name in EXTENT_SERIES or name == "parts"  # ranges set from the data we plot
            pw = _PlotWidget(parent, axisItems=axis, viewBox=_ViewBox() if fitted else None)
            pw.setMinimumSize(280, 170)
            pw.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
            pw.setMenuEnabled(False)
            item = pw.getPlotItem()
            item.setDownsampling(auto=True, mode="peak")
            item.setClipToView(True)
            item.layout.setContentsMargins(6, 2, 8, 2)  # the rotated y title's text box starts 5 px left
            vb = item.getViewBox()
            vb.setMouseEnabled(x=True, y=False)  # zoom time only; the "A" button restores follow
            vb.setAutoVisible(y=True)             # y fits what is in view after a zoom
            vb.setLimits(yMin=0)
            self.widgets[name] = pw
            self.legends[name] = self._legend(item)
        self._build_pool()
        self._build_cache()
        self._build_hits()
        self._build_prefill()
        self._build_ttft()
        self._build_parts()
        for pw in self.widgets.values():
            cache_static_items(pw)

    # building ---------------------------------------------------------
    @staticmethod
    def _legend(item: pg.PlotItem) -> pg.LegendItem:
        # In the plot's own layout, under the x axis: it never covers data. Two columns fit a
        # chart a third of the window wide. It spans the axes' columns too: in the view's column
        # alone its width became the view's minimum, and a narrow chart pushed its right axis
        # out of the widget.
        legend = pg.LegendItem(colCount=2, frame=False, sampleType=_Swatch, labelTextSize="8.5pt",
                               horSpacing=4)
        legend.setSizePolicy(QSizePolicy.Policy.Maximum, QSizePolicy.Policy.Fixed)
        item.layout.addItem(legend, 4, 0, 1, 3, alignment=Qt.AlignmentFlag.AlignHCenter)
        return legend

    def _curve(self, chart: str, name: str, width: float = 2.0, style=Qt.PenStyle.SolidLine,
               fill: bool = False) -> pg.PlotDataItem:
        color = series_color(name)
        pen = pg.mkPen(color, width=width, style=style)
        curve = self._lean(pg.PlotDataItem(pen=pen, stepMode=STEP))
        self.widgets[chart].addItem(curve)
        if fill:
            self._area(chart, name, with_alpha(color, 40), z=-10)
        self.legends[chart].addItem(curve, LABELS[name])
        self.curves[name] = curve
        return curve

    @staticmethod
    def _lean(item: pg.PlotDataItem) -> pg.PlotDataItem:
        # pyqtgraph's default keeps ~5 samples per pixel; 'peak' of one per pixel keeps
        # every spike and draws 5x fewer vertices (antialiased paths dominate the cost).
        item.opts["autoDownsampleFactor"] = 1.0
        return item

    def _area(self, chart: str, name: str, brush, z: float, ignore_bounds: bool = False) -> pg.PlotDataItem:
        """A fill-only curve down to 0. Its own item, so the line's pen never strokes the
        fill's vertical ends; pyqtgraph downsamples it like any curve (FillBetweenItem
        rebuilds full-resolution polygons on every change: seconds for 20k rows)."""
        area = self._lean(pg.PlotDataItem(pen=_CLEAR, stepMode=STEP, fillLevel=0, fillBrush=brush))
        area.setZValue(z)
        self.widgets[chart].addItem(area, ignoreBounds=ignore_bounds)
        self.areas[name] = area
        return area

    def _build_pool(self) -> None:
        item = self.widgets["pool"].getPlotItem()
        # Stacked areas: each band is its cumulative level filled down to 0, opaque, the
        # higher levels behind the lower ones. The free band does not size the view: a pool
        # sized by the KV budget (thousands of pages) would flatten the pages in use into a
        # line at its foot; an invisible ceiling (pool_ceiling) sizes it instead.
        for i, name in enumerate(STACK):
            free = name == "pages_free"
            area = self._area("pool", name, series_color(name), z=-10 - i, ignore_bounds=free)
            top = self._lean(pg.PlotDataItem(pen=pg.mkPen(series_color(name), width=1.2), stepMode=STEP))
            item.addItem(top, ignoreBounds=free)
            self.legends["pool"].addItem(area, LABELS[name])
            self.curves[name] = top
        self.pool_ceiling = self._lean(pg.PlotDataItem(pen=_CLEAR))
        self._pool_label_cap = 0.0
        item.addItem(self.pool_ceiling)
        item.setLabel("left", "pages")
        item.setLabel("bottom", "wall time (s)")

    def _build_cache(self) -> None:
        self._curve("cache", "cached_pages", fill=True)
        self._curve("cache", "chains")
        item = self.widgets["cache"].getPlotItem()
        item.setLabel("left", "count")
        item.setLabel("bottom", "wall time (s)")

    def _build_hits(self) -> None:
        self._curve("hits", "hits", fill=True)
        self._curve("hits", "disk_hits", width=1.5, style=Qt.PenStyle.DotLine)  # hits by tier
        item = self.widgets["hits"].getPlotItem()
        # Hit rate on a second y axis: a ViewBox stacked on the plot's, sharing its x.
        rate_vb = pg.ViewBox(enableMenu=False)
        rate_vb.setMouseEnabled(x=False, y=False)
        item.showAxis("right")
        item.scene().addItem(rate_vb)
        item.getAxis("right").linkToView(rate_vb)
        rate_vb.setXLink(item)
        rate_vb.setYRange(0, 100, padding=0.02)
        rate_vb.enableAutoRange(axis=pg.ViewBox.YAxis, enable=False)
        rate = self._lean(pg.PlotDataItem(pen=pg.mkPen(series_color("hit_rate"), width=2.0,
                                                       style=Qt.PenStyle.DashLine), stepMode=STEP))
        # Its ViewBox is not the PlotItem's, so set what PlotItem.addItem would; no clipToView:
        # that clips to this ViewBox's range, stale until the plot is first laid out.
        rate.setDownsampling(auto=True, method="peak")
        rate_vb.addItem(rate)
        self.legends["hits"].addItem(rate, LABELS["hit_rate"])
        self.curves["hit_rate"] = rate
        self._rate_vb = rate_vb

        def sync():
            rate_vb.setGeometry(item.vb.sceneBoundingRect())
            rate_vb.linkedViewChanged(item.vb, rate_vb.XAxis)

        item.vb.sigResized.connect(sync)
        self.sync_rate = sync
        item.setLabel("left", "hits")
        item.setLabel("right", "hit rate (%)")
        item.setLabel("bottom", "wall time (s)")

    def _build_prefill(self) -> None:
        self._curve("prefill", "prefill_computed", fill=True)
        self._curve("prefill", "prefill_saved", fill=True)
        item = self.widgets["prefill"].getPlotItem()
        item.setLabel("left", "tokens")
        item.setLabel("bottom", "wall time (s)")

    def _build_ttft(self) -> None:
        item = self.widgets["ttft"].getPlotItem()
        for name in REQUEST_SERIES:
            color = series_color(name)
            estimate = name == "ttft_no_cache"
            bars = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=BAR_SLOTS[name][1],
                                   brush=with_alpha(color, 70) if estimate else color,
                                   pen=pg.mkPen(color, width=1.3, style=Qt.PenStyle.DashLine)
                                   if estimate else pg.mkPen(None))
            item.addItem(bars)
            self.legends["ttft"].addItem(bars, LABELS[name])
            self.bars[name] = bars
        item.setLabel("left", "TTFT (s)")
        item.setLabel("bottom", "request id")
        # Room for a dozen bars even with one request: a lone bar should not fill the plot.
        item.getViewBox().setLimits(xMin=0, minXRange=12)

    def _build_parts(self) -> None:
        item = self.widgets["parts"].getPlotItem()
        self.legends["parts"].setColumnCount(4)  # eight parts in two rows
        for i, name in enumerate(PART_SERIES):  # each band filled from 0: the top ones drawn behind
            color = QColor(PART_COLORS[name[len("part_"):]])
            band = self._lean(pg.PlotDataItem(pen=pg.mkPen(color, width=1), fillLevel=0, fillBrush=color,
                                              stepMode=STEP))
            band.setZValue(-i)
            item.addItem(band)
            self.legends["parts"].addItem(band, LABELS[name])
            self.curves[name] = band
        item.setLabel("left", "prompt tokens")
        item.setLabel("bottom", "request id")
        item.getViewBox().setLimits(xMin=0, minXRange=12)

    # theme ------------------------------------------------------------
    def apply_theme(self, theme: Theme) -> None:
        tick_font = QFont()
        tick_font.setPointSizeF(8.5)
        label_css = {"color": theme.muted, "font-size": "9pt"}
        for name, pw in self.widgets.items():
            pw.setBackground(theme.background)
            item = pw.getPlotItem()
            item.setTitle(f"<b>{TITLES[name]}</b>", color=theme.foreground, size="10pt")
            for side in ("left", "bottom", "right"):
                axis = item.getAxis(side)
                axis.setPen(pg.mkPen(theme.grid))
                axis.setTextPen(pg.mkPen(theme.muted))
                # Two tick levels, not three: the finest grid lines are barely visible and
                # were 2/3 of an axis' paint (2.5 -> 0.8 ms a redraw).
                axis.setStyle(tickFont=tick_font, tickTextOffset=4, maxTickLevel=1)
                axis.enableAutoSIPrefix(False)
                axis.setZValue(-1000)  # grid lines under the data, not across bars
                if axis.labelText:
                    axis.setLabel(axis.labelText, **label_css)
            item.showGrid(x=True, y=True, alpha=0.3 if theme.dark else 0.4)
            item.getAxis("right").setGrid(False)  # one grid: the left axis'
            legend = self.legends[name]
            legend.setLabelTextColor(theme.foreground)
            for _sample, label in legend.items:
                label.setText(label.text)  # LabelItem applies a new colour only on setText
        # Free pages are the only theme-dependent series colour.
        free = series_color("pages_free", theme)
        bg = QColor(theme.background)
        for name in STACK:  # opaque, toned towards the background: stacked bands must not blend
            amount = 1.0 if name == "pages_free" else 0.8
            self.areas[name].setFillBrush(_mix(series_color(name, theme), bg, amount))
        self.curves["pages_free"].setPen(pg.mkPen(free.darker(115) if not theme.dark else free.lighter(125),
                                                  width=1.2))
        for pw in self.widgets.values():
            pw.update()

    # data -------------------------------------------------------------
    def refresh(self, buf: TimelineBuffer, ttft: dict[str, tuple[np.ndarray, np.ndarray]],
                parts: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        x = buf.column("wall_s")
        level = np.zeros(buf.n)
        tops = {}  # the values that size each timeline chart (the free band does not)
        for name in STACK:
            level = level + buf.column(name)
            self._set_step(name, x, level)
            tops[name] = level
        for name in ("chains", "cached_pages", "hits", "disk_hits", "prefill_computed", "prefill_saved"):
            tops[name] = buf.column(name)
            self._set_step(name, x, tops[name])
        self._set_step("hit_rate", x, 100.0 * buf.column("hit_rate"))
        for name, (ids, secs) in ttft.items():
            offset, width = BAR_SLOTS[name]
            self.bars[name].setOpts(x=ids + offset, height=secs, width=width)
        top_band = None
        for name, (ids, tops_) in (parts or {}).items():  # stacked: each band's top, per request id
            self.curves[name].setData(ids, tops_)
            top_band = (ids, tops_)
        if top_band is not None:
            ids, tops_ = top_band
            self.widgets["parts"].getPlotItem().vb.extent = \
                [[float(ids[0]), float(ids[-1])], [0.0, float(tops_.max())]] if len(ids) else None
        if buf.n:
            cap = float(buf.column("capacity").max())
            item = self.widgets["pool"].getPlotItem()
            item.vb.setLimits(yMin=0, yMax=cap * 1.05 + 1)
            held = float((buf.column("capacity") - buf.column("pages_free")).max())  # pages ever not free
            ceiling = pool_ceiling(cap, held)
            self.pool_ceiling.setData([x[0], x[-1]], [ceiling] * 2)
            tops["pool_ceiling"] = np.array([ceiling])
            if cap != self._pool_label_cap:  # a new label relays out and repaints the axis
                self._pool_label_cap = cap
                item.setLabel("left", f"pages (pool {cap:,.0f})")
        self.sync_rate()
        for chart, names in EXTENT_SERIES.items():
            top = max((float(tops[n].max()) for n in names if n in tops and len(tops[n])), default=None)
            self.widgets[chart].getPlotItem().vb.extent = None if top is None else [[x[0], x[-1]], [0.0, top]]
        # New ranges now, not in the paint: else a paint draws the curves, then the axes the new
        # range moved cost a second paint of every plot.
        for pw in self.widgets.values():
            pw.getPlotItem().vb.prepareForPaint()

    def _set_step(self, name: str, x: np.ndarray, y: np.ndarray) -> None:
        xs, ys = step_changes(x, y)
        self.curves[name].setData(xs, ys)
        if name in self.areas:
            self.areas[name].setData(xs, ys)

    def close(self) -> None:
        for pw in self.widgets.values():
            pw.close()
            pw.deleteLater()
