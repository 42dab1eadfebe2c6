"""Live charts of the scheduler's timeline: pool pages, cache, hits, prefill saved, TTFT (DESIGN §5).

`append` only copies rows into growable NumPy columns and marks the panel dirty;
a QTimer pushes the columns to the curves at most REFRESH_HZ times a second and
stops itself when nothing changed, so a burst of tokens never redraws per token.
When painting gets slow (a long session on a busy machine) the timer backs off so
the charts take at most about a third of the UI thread.
"""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QRectF, Qt, QTimer
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QApplication, QGridLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine.metrics import RequestRecord, TimelineRow

from .colors import Theme, series_color, theme_for, with_alpha
from .page_map import png_bytes

pg.setConfigOptions(antialias=True)

REFRESH_HZ = 15
MAX_REFRESH_MS = 1000    # the slowest the charts back off to
PAINT_SHARE = 3          # interval >= PAINT_SHARE x the time the last frame took to paint
# Raw timeline columns kept per row; hit_rate is derived from two of them.
COLUMNS = ("step", "wall_s", "capacity", "pages_private", "pages_shared", "pages_cached", "pages_free",
           "chains", "cached_pages", "queries", "hits", "hit_pages", "prefill_computed", "prefill_saved",
           "decode_tokens")
TIMELINE_SERIES = ("pages_private", "pages_shared", "pages_cached", "pages_free", "chains",
                   "cached_pages", "hits", "hit_rate", "prefill_computed", "prefill_saved")
REQUEST_SERIES = ("ttft_hit", "ttft_miss")
SERIES = TIMELINE_SERIES + REQUEST_SERIES
CHARTS = ("pool", "cache", "hits", "prefill", "ttft")
# A row holds from its step's end until the next row: draw steps, not slopes between rows.
STEP = "right"
STACK = ("pages_private", "pages_shared", "pages_cached", "pages_free")  # bottom to top
LABELS = {
    "pages_private": "private to streams", "pages_shared": "shared", "pages_cached": "cache only",
    "pages_free": "free", "chains": "cached chains", "cached_pages": "cached pages",
    "hits": "hits (cumulative)", "hit_rate": "hit rate (%)", "prefill_computed": "computed",
    "prefill_saved": "saved by the cache", "ttft_hit": "cache hit", "ttft_miss": "miss",
}
TITLES = {"pool": "KV pool pages", "cache": "Prefix cache", "hits": "Cache hits",
          "prefill": "Prefill tokens (cumulative)", "ttft": "Time to first token per request"}


class TimelineBuffer:
    """Timeline columns in growable NumPy arrays (amortised O(1) append, views on read)."""

    def __init__(self, capacity: int = 256):
        self.n = 0
        self._cols = {name: np.zeros(capacity, dtype=np.float64) for name in COLUMNS}

    def clear(self) -> None:
        self.n = 0

    def extend(self, rows: list[TimelineRow]) -> None:
        k = len(rows)
        if not k:
            return
        need = self.n + k
        cap = len(self._cols["step"])
        if need > cap:
            new_cap = max(need, 2 * cap)
            for name, col in self._cols.items():
                grown = np.zeros(new_cap, dtype=np.float64)
                grown[:self.n] = col[:self.n]
                self._cols[name] = grown
        for name, col in self._cols.items():
            col[self.n:need] = [getattr(r, name) for r in rows]
        self.n = need

    def column(self, name: str) -> np.ndarray:
        """A read-only view of one column (or the derived hit_rate)."""
        if name == "hit_rate":
            saved, computed = self.column("prefill_saved"), self.column("prefill_computed")
            total = saved + computed
            out = np.zeros(self.n, dtype=np.float64)
            np.divide(saved, total, out=out, where=total > 0)
            return out
        view = self._cols[name][:self.n]
        view.flags.writeable = False
        return view


# A transparent pen, not None: a PlotDataItem without a pen hides its curve and path.
_CLEAR = pg.mkPen((0, 0, 0, 0))


def step_changes(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows where a step curve changes value, plus the last: the same picture, far fewer
    points (most counts stay flat for many steps)."""
    if len(y) < 3:
        return x, y
    keep = np.empty(len(y), dtype=bool)
    keep[0] = keep[-1] = True
    np.not_equal(y[1:-1], y[:-2], out=keep[1:-1])
    return x[keep], y[keep]


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
    """A PlotWidget that remembers how long its last paint took (the refresh timer backs off)."""

    paint_s = 0.0

    def paintEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        t0 = time.perf_counter()
        super().paintEvent(ev)
        self.paint_s = time.perf_counter() - t0


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


class _ChartSet:
    """The five plot widgets and their items; ChartsPanel owns one, exports make their own."""

    def __init__(self, parent: QWidget | None = None):
        self.widgets: dict[str, pg.PlotWidget] = {}
        self.curves: dict[str, pg.PlotDataItem] = {}   # timeline series -> its (top) curve
        self.bars: dict[str, pg.BarGraphItem] = {}
        self.areas: dict[str, pg.PlotDataItem] = {}    # fill-only twins of some curves
        self.legends: dict[str, pg.LegendItem] = {}
        for name in CHARTS:
            axis = {"bottom": _IntAxis("bottom")} if name == "ttft" else \
                {"left": _IntAxis("left")} if name in ("pool", "cache", "hits") else None  # counts
            pw = _PlotWidget(parent, axisItems=axis)
            pw.setMinimumSize(280, 170)
            pw.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
            pw.setMenuEnabled(False)
            item = pw.getPlotItem()
            item.setDownsampling(auto=True, mode="peak")
            item.setClipToView(True)
            item.layout.setContentsMargins(4, 2, 8, 2)
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

    # building ---------------------------------------------------------
    @staticmethod
    def _legend(item: pg.PlotItem) -> pg.LegendItem:
        # In the plot's own layout, under the x axis: it never covers data. Two columns fit a
        # chart a third of the window wide.
        legend = pg.LegendItem(colCount=2, frame=False, sampleType=_Swatch, labelTextSize="8.5pt",
                               horSpacing=4)
        legend.setSizePolicy(QSizePolicy.Policy.Maximum, QSizePolicy.Policy.Fixed)
        item.layout.addItem(legend, 4, 1, alignment=Qt.AlignmentFlag.AlignHCenter)
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

    def _area(self, chart: str, name: str, brush, z: float) -> pg.PlotDataItem:
        """A fill-only curve down to 0. Its own item, so the line's pen never strokes the
        fill's vertical ends; pyqtgraph downsamples it like any curve (FillBetweenItem
        rebuilds full-resolution polygons on every change: seconds for 20k rows)."""
        area = self._lean(pg.PlotDataItem(pen=_CLEAR, stepMode=STEP, fillLevel=0, fillBrush=brush))
        area.setZValue(z)
        self.widgets[chart].addItem(area)
        self.areas[name] = area
        return area

    def _build_pool(self) -> None:
        item = self.widgets["pool"].getPlotItem()
        # Stacked areas: each band is its cumulative level filled down to 0, opaque, the
        # higher levels behind the lower ones.
        for i, name in enumerate(STACK):
            area = self._area("pool", name, series_color(name), z=-10 - i)
            top = self._lean(pg.PlotDataItem(pen=pg.mkPen(series_color(name), width=1.2), stepMode=STEP))
            item.addItem(top)
            self.legends["pool"].addItem(area, LABELS[name])
            self.curves[name] = top
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
        self._sync_rate = sync
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
            bars = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.7,
                                   brush=series_color(name), pen=pg.mkPen(None))
            item.addItem(bars)
            self.legends["ttft"].addItem(bars, LABELS[name])
            self.bars[name] = bars
        item.setLabel("left", "TTFT (s)")
        item.setLabel("bottom", "request id")
        # Room for a dozen bars even with one request: a lone bar should not fill the plot.
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
                axis.setStyle(tickFont=tick_font, tickTextOffset=4)
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
    def refresh(self, buf: TimelineBuffer, ttft: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        x = buf.column("wall_s")
        level = np.zeros(buf.n)
        for name in STACK:
            level = level + buf.column(name)
            self._set_step(name, x, level)
        for name in ("chains", "cached_pages", "hits", "prefill_computed", "prefill_saved"):
            self._set_step(name, x, buf.column(name))
        self._set_step("hit_rate", x, 100.0 * buf.column("hit_rate"))
        for name, (ids, secs) in ttft.items():
            self.bars[name].setOpts(x=ids, height=secs)
        if buf.n:
            cap = float(buf.column("capacity").max())
            self.widgets["pool"].getPlotItem().vb.setLimits(yMin=0, yMax=cap * 1.05 + 1)
        self._sync_rate()

    def _set_step(self, name: str, x: np.ndarray, y: np.ndarray) -> None:
        xs, ys = step_changes(x, y)
        self.curves[name].setData(xs, ys)
        if name in self.areas:
            self.areas[name].setData(xs, ys)

    def close(self) -> None:
        for pw in self.widgets.values():
            pw.close()
            pw.deleteLater()


class ChartsPanel(QWidget):
    """The live charts: pool pages, cached chains and pages, hits, prefill tokens, TTFT."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._buf = TimelineBuffer()
        self._records: list[RequestRecord] = []
        self._ttft = self._split_ttft([])
        self._dirty = False
        self._theme: Theme | None = None
        self._charts = _ChartSet(self)
        self.summary = QLabel(self)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setObjectName("chartsSummary")
        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setSpacing(6)
        w = self._charts.widgets
        grid.addWidget(w["pool"], 0, 0)
        grid.addWidget(w["cache"], 0, 1)
        grid.addWidget(w["hits"], 1, 0)
        grid.addWidget(w["prefill"], 1, 1)
        grid.addWidget(w["ttft"], 2, 0, 1, 2)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.setSpacing(4)
        outer.addWidget(self.summary)
        outer.addLayout(grid, 1)
        self._timer = QTimer(self)
        self._timer.setInterval(1000 // REFRESH_HZ)
        self._timer.timeout.connect(self._on_tick)
        self._apply_theme()
        self.refresh()

    # public API -------------------------------------------------------
    def append(self, rows: list[TimelineRow], records: list[RequestRecord]) -> None:
        """Add the timeline rows since the last call; `records` replace the records held."""
        self._buf.extend(rows)
        self._set_records(records)
        self._mark_dirty()

    def set_data(self, rows: list[TimelineRow], records: list[RequestRecord]) -> None:
        """Replace everything (a report loaded from disk) and redraw now."""
        self._buf.clear()
        self._buf.extend(rows)
        self._set_records(records)
        self.refresh()

    def clear(self) -> None:
        """Forget every row and record."""
        self._buf.clear()
        self._set_records([])
        self.refresh()

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """x and y of a series, in the timeline's units (hit_rate as a fraction; TTFT x = request id)."""
        if name in self._ttft:
            ids, secs = self._ttft[name]
            return ids.copy(), secs.copy()
        if name not in TIMELINE_SERIES:
            raise KeyError(f"unknown series {name!r}; expected one of {', '.join(SERIES)}")
        return self._buf.column("wall_s").copy(), self._buf.column(name).copy()

    def plot_widgets(self) -> dict[str, pg.PlotWidget]:
        """The live plot widgets by chart: pool, cache, hits, prefill, ttft."""
        return dict(self._charts.widgets)

    chart_titles = TITLES

    def render_images(self, width: int = 900, height: int = 300,
                      theme: str | None = "light") -> dict[str, bytes]:
        """PNG bytes of every chart at width x height, drawn offscreen (theme None: the panel's own)."""
        self._flush()
        charts = _ChartSet(None)
        try:
            for pw in charts.widgets.values():
                # Laid out for real but never on screen: the curves downsample to the
                # view's width only once the view has one (else 20k rows draw in seconds).
                pw.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
                pw.resize(int(width), int(height))
                pw.show()
            charts.apply_theme(theme_for(theme) if theme else self._current_theme())
            charts.refresh(self._buf, self._ttft)
            # Only layout requests: posted queued signals must not run inside an export.
            QApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)
            out = {}
            for name, pw in charts.widgets.items():
                pw.getPlotItem().vb.autoRange(padding=0.04)
                charts._sync_rate()
                out[name] = png_bytes(pw.grab())
            return out
        finally:
            charts.close()

    def refresh(self) -> None:
        """Push the buffered data to the curves now (the timer does this on its own)."""
        self._dirty = False
        self._charts.refresh(self._buf, self._ttft)
        self._update_summary()

    @property
    def row_count(self) -> int:
        return self._buf.n

    # internals --------------------------------------------------------
    def _set_records(self, records: list[RequestRecord]) -> None:
        self._records = list(records)
        self._ttft = self._split_ttft(self._records)

    @staticmethod
    def _split_ttft(records: list[RequestRecord]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        done = sorted((r for r in records if r.ttft_s is not None), key=lambda r: r.id)
        out = {}
        for name, hit in (("ttft_hit", True), ("ttft_miss", False)):
            sel = [r for r in done if (r.n_cached > 0) == hit]
            out[name] = (np.array([r.id for r in sel], dtype=np.float64),
                         np.array([r.ttft_s for r in sel], dtype=np.float64))
        return out

    def _mark_dirty(self) -> None:
        self._dirty = True
        if not self._timer.isActive():
            self._timer.start()

    def _on_tick(self) -> None:
        if self._dirty:
            painted = sum(pw.paint_s for pw in self._charts.widgets.values())
            self._timer.setInterval(int(min(MAX_REFRESH_MS, max(1000 // REFRESH_HZ,
                                                                PAINT_SHARE * 1000 * painted))))
            self.refresh()
        else:
            self._timer.stop()  # idle: no wake-ups until the next append

    def _flush(self) -> None:
        if self._dirty:
            self.refresh()

    def _update_summary(self) -> None:
        t = self._current_theme()
        if not self._buf.n:
            self.summary.setText(f"<span style='color:{t.muted}'>No steps yet: run some prompts to "
                                 f"see the cache at work.</span>")
            return
        col = self._buf.column
        saved, computed = int(col("prefill_saved")[-1]), int(col("prefill_computed")[-1])
        hits, queries = int(col("hits")[-1]), int(col("queries")[-1])
        rate = col("hit_rate")[-1] * 100
        parts = [("hit rate", f"{rate:.0f}%"), ("tokens saved", f"{saved:,}"),
                 ("computed", f"{computed:,}"), ("hits", f"{hits} / {queries} queries"),
                 ("cached pages", f"{int(col('cached_pages')[-1])}"),
                 ("steps", f"{int(col('step')[-1]):,}")]
        self.summary.setText("&nbsp;&nbsp;·&nbsp;&nbsp;".join(
            f"<span style='color:{t.muted}'>{k}</span> <b>{v}</b>" for k, v in parts))

    def _current_theme(self) -> Theme:
        if self._theme is None:
            self._theme = theme_for(self)
        return self._theme

    def _apply_theme(self) -> None:
        self._theme = theme_for(self)
        self._charts.apply_theme(self._theme)
        self._update_summary()

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._apply_theme()
        super().changeEvent(event)


__all__ = ["ChartsPanel", "SERIES", "TimelineBuffer"]
