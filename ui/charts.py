"""Live charts of the scheduler's timeline: pool pages, cache, hits, prefill saved, TTFT (docs/design.md §6).

`append` only copies rows into growable NumPy columns and marks the panel dirty;
a QTimer pushes the columns to the curves at most REFRESH_HZ times a second and
stops itself when nothing changed, so a burst of tokens never redraws per token.
Painting is Python (pyqtgraph) on the UI thread, and it competes with the engine
worker for the GIL and the cores: the timer backs off so the charts take about a thirtieth
of the UI thread, and a panel its window hides (another tab) does not draw until shown.
"""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtWidgets import QApplication, QGridLayout, QLabel, QVBoxLayout, QWidget

from engine.estimates import ttft_without_cache
from engine.metrics import RequestRecord, TimelineRow

from .chart_data import PART_SERIES, SERIES, TIMELINE_SERIES, TITLES, TimelineBuffer
from .chart_plots import ChartSet
from .colors import Theme, theme_for
from .page_map import png_bytes
from .visibility import hidden_in_window

REFRESH_HZ = 5           # measured (bench "desktop app"): 15 Hz cost the worker ~1.9x its headless time
MAX_REFRESH_MS = 2000    # the slowest the charts back off to during a run (`settle` draws its end)
# interval >= FRAME_SHARE x what the last frame cost the UI thread (its refresh: setData and
# the ranges, then its paints), so the charts hold the GIL about 1/FRAME_SHARE of the time
# during a run. Measured in the 8-question scenario: a frame is 20-60 ms, so a frame every 1-2 s;
# on a 2-core Xeon the app took 1.07-1.08x its headless time at 30 against 1.10-1.12x at 20.
FRAME_SHARE = 30
STAGGER_MS = 30          # the charts of one refresh paint this far apart, not in one long stall


class ChartsPanel(QWidget):
    """The live charts: pool pages, cached chains and pages, hits, prefill tokens, TTFT."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._buf = TimelineBuffer()
        self._records: list[RequestRecord] = []
        self._prefill_tok_s = 0.0  # the session's measured prefill rate (TTFT-without-cache estimates)
        self._ttft = self._split_ttft([], 0.0)
        self._parts = self._stack_parts([])
        self._dirty = False
        self.frames = 0  # refreshes drawn (many appends in one event-loop turn make one)
        self._frame_s = 0.0  # the UI thread's time in refreshes since the timer last looked
        self._theme: Theme | None = None
        self._charts = ChartSet(self)
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
        grid.addWidget(w["ttft"], 2, 0)
        grid.addWidget(w["parts"], 2, 1)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.setSpacing(4)
        outer.addWidget(self.summary)
        outer.addLayout(grid, 1)
        self._timer = QTimer(self)
        self._timer.setInterval(1000 // REFRESH_HZ)
        self._timer.timeout.connect(self._on_tick)
        # One refresh repaints five plots; painted together they block the UI thread for
        # ~100 ms on a busy 2-core machine, so each waits its turn (updates off until then).
        self._unveil: list[pg.PlotWidget] = []
        self._unveil_timer = QTimer(self)
        self._unveil_timer.setInterval(STAGGER_MS)
        self._unveil_timer.timeout.connect(self._unveil_next)
        self._apply_theme()
        self.refresh()

    # public API -------------------------------------------------------
    def append(self, rows: list[TimelineRow], records: list[RequestRecord],
               prefill_tok_s: float = 0.0) -> None:
        """Add the timeline rows since the last call; `records` replace the records held;
        `prefill_tok_s`: the session's measured prefill rate (0: none yet, no estimates)."""
        if not rows and records == self._records and float(prefill_tok_s or 0.0) == self._prefill_tok_s:
            return  # a snapshot with nothing new for the charts (a flush, a pin) costs no frame
        self._buf.extend(rows)
        self._set_records(records, prefill_tok_s)
        self._mark_dirty()

    def settle(self) -> None:
        """A run ended: draw what came in now, not at the next backed-off tick (a panel its
        window hides draws when shown)."""
        if self._dirty and not hidden_in_window(self):
            self.refresh()

    def set_data(self, rows: list[TimelineRow], records: list[RequestRecord],
                 prefill_tok_s: float = 0.0) -> None:
        """Replace everything (a report loaded from disk) and redraw now."""
        self._buf.clear()
        self._buf.extend(rows)
        self._set_records(records, prefill_tok_s)
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
        if name in self._parts:  # cumulative tokens of that part alone, per request id
            ids, _top = self._parts[name]
            return ids.copy(), self._part_totals[name].copy()
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
        charts = ChartSet(None)
        try:
            for pw in charts.widgets.values():
                # Laid out for real but never on screen: the curves downsample to the
                # view's width only once the view has one (else 20k rows draw in seconds).
                pw.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
                pw.resize(int(width), int(height))
                pw.show()
            charts.apply_theme(theme_for(theme) if theme else self._current_theme())
            charts.refresh(self._buf, self._ttft, self._parts)
            # Only layout requests: posted queued signals must not run inside an export.
            QApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)
            out = {}
            for name, pw in charts.widgets.items():
                pw.getPlotItem().vb.autoRange(padding=0.04)
                charts.sync_rate()
                out[name] = png_bytes(pw.grab())
            return out
        finally:
            charts.close()

    def refresh(self) -> None:
        """Push the buffered data to every chart now (the timer does this on its own, a chart
        at a time): a grab right after shows all of them."""
        self._unveil_all()
        self._draw()

    def _draw(self) -> None:
        t0 = time.perf_counter()
        self._dirty = False
        self._charts.refresh(self._buf, self._ttft, self._parts)
        self.frames += 1
        self._update_summary()
        self._frame_s += time.perf_counter() - t0

    @property
    def row_count(self) -> int:
        return self._buf.n

    @property
    def curves(self) -> dict[str, pg.PlotDataItem]:
        """The drawn curve of each timeline series (the pool's areas stacked)."""
        return dict(self._charts.curves)

    @property
    def refresh_pending(self) -> bool:
        """Data not drawn yet, or the refresh timer still awake."""
        return self._dirty or self._timer.isActive()

    @property
    def theme(self) -> Theme:
        """The colours the charts are drawn in now."""
        return self._current_theme()

    # internals --------------------------------------------------------
    def _set_records(self, records: list[RequestRecord], prefill_tok_s: float = 0.0) -> None:
        self._records = list(records)
        self._prefill_tok_s = float(prefill_tok_s or 0.0)
        self._ttft = self._split_ttft(self._records, self._prefill_tok_s)
        self._parts = self._stack_parts(self._records)

    @staticmethod
    def _split_ttft(records: list[RequestRecord],
                    prefill_tok_s: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Request ids and TTFTs of hits, of misses, and each hit's estimate without the cache."""
        done = sorted((r for r in records if r.ttft_s is not None), key=lambda r: r.id)
        hits = [r for r in done if r.n_cached > 0]
        misses = [r for r in done if r.n_cached == 0]
        est = [(r.id, ttft_without_cache(r.ttft_s, r.n_cached, prefill_tok_s)) for r in hits]
        est = [(i, s) for i, s in est if s is not None]

        def cols(pairs):
            return (np.array([p[0] for p in pairs], dtype=np.float64),
                    np.array([p[1] for p in pairs], dtype=np.float64))
        return {"ttft_hit": cols([(r.id, r.ttft_s) for r in hits]), "ttft_no_cache": cols(est),
                "ttft_miss": cols([(r.id, r.ttft_s) for r in misses])}

    def _stack_parts(self, records: list[RequestRecord]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The session's prompt tokens by part, cumulative over the requests admitted so far (by
        id): each band's top for the stacked chart; each part's own running total is kept too."""
        done = sorted((r for r in records if r.parts is not None), key=lambda r: r.id)
        ids = np.array([r.id for r in done], dtype=np.float64)
        level = np.zeros(len(done))
        self._part_totals: dict[str, np.ndarray] = {}
        out = {}
        for name in PART_SERIES:
            part = name[len("part_"):]
            own = np.array([getattr(r.parts, part) - (r.parts.disk if part == "cached" else 0)
                            for r in done], dtype=np.float64)
            self._part_totals[name] = np.cumsum(own)
            level = level + self._part_totals[name]
            out[name] = (ids, level.copy())
        return out

    def part_totals(self) -> dict[str, int]:
        """The session's totals by part as the chart's last point ({part: tokens}; `cached`
        without its `disk` share, as the bands stack)."""
        return {name[len("part_"):]: int(v[-1]) if len(v) else 0 for name, v in self._part_totals.items()}

    def _mark_dirty(self) -> None:
        self._dirty = True
        if not self._timer.isActive():
            self._timer.start()

    def _on_tick(self) -> None:
        if self._dirty and hidden_in_window(self):
            self._timer.stop()  # showEvent draws what came in meanwhile
        elif self._dirty:
            cost, self._frame_s = self._frame_s, 0.0
            for pw in self._charts.widgets.values():  # the paints the last refresh caused
                cost, pw.painted_s = cost + pw.painted_s, 0.0
            self._timer.setInterval(int(min(MAX_REFRESH_MS, max(1000 // REFRESH_HZ,
                                                                FRAME_SHARE * 1000 * cost))))
            self._staggered_refresh()
        else:
            self._timer.stop()  # idle: no wake-ups until the next append

    def _staggered_refresh(self) -> None:
        self._unveil_all()
        self._unveil = list(self._charts.widgets.values())[1:]  # the first paints at once
        for pw in self._unveil:
            pw.setUpdatesEnabled(False)
        self._unveil_timer.start()
        self._draw()

    def _unveil_next(self) -> None:
        if self._unveil:
            self._unveil.pop(0).setUpdatesEnabled(True)
        if not self._unveil:
            self._unveil_timer.stop()

    def _unveil_all(self) -> None:
        while self._unveil:
            self._unveil.pop(0).setUpdatesEnabled(True)
        self._unveil_timer.stop()

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
        parts = [("hit rate", f"{rate:.0f}%"), ("tokens saved", f"{saved:,}"), *self._ttft_saved(),
                 ("computed", f"{computed:,}"), ("hits", f"{hits} / {queries} queries"),
                 ("cached pages", f"{int(col('cached_pages')[-1])}"),
                 ("steps", f"{int(col('step')[-1]):,}")]
        self.summary.setText("&nbsp;&nbsp;·&nbsp;&nbsp;".join(
            f"<span style='color:{t.muted}'>{k}</span> <b>{v}</b>" for k, v in parts))

    def _ttft_saved(self) -> list[tuple[str, str]]:
        """The hits' TTFT against their estimates without the cache, when there are any."""
        est_ids, est = self._ttft["ttft_no_cache"]
        if not len(est):
            return []
        hit_ids, hit = self._ttft["ttft_hit"]
        mine = np.isin(hit_ids, est_ids)
        return [("hits' TTFT", f"{hit[mine].mean():.2f} s vs ≈ {est.mean():.2f} s without the cache")]

    def _current_theme(self) -> Theme:
        if self._theme is None:
            self._theme = theme_for(self)
        return self._theme

    def _apply_theme(self) -> None:
        self._theme = theme_for(self)
        self._charts.apply_theme(self._theme)
        self._update_summary()

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().showEvent(event)
        if self._dirty and not self._timer.isActive():
            self._timer.start()

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._apply_theme()
        super().changeEvent(event)


__all__ = ["ChartsPanel", "SERIES", "TimelineBuffer"]
