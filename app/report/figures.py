"""The report's pictures: the GUI's own charts and page map, drawn offscreen as PNGs (Qt)."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass

from .model import Report, snapshot_from_report

CHART_WIDTH, CHART_HEIGHT = 900, 300
PAGE_MAP_WIDTH = 900
PAGE_MAP_MAX_HEIGHT = 520

_app = None  # the offscreen application this module made, kept alive


def ensure_qt_app():
    """The running Q(Gui)Application, or a new offscreen QApplication when there is none."""
    global _app
    from PySide6.QtGui import QGuiApplication
    from PySide6.QtWidgets import QApplication
    app = QGuiApplication.instance()
    if app is None:
        if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
            os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        app = _app = QApplication([])
    return app


@dataclass
class Figure:
    """A picture in the report: its key, caption and PNG bytes."""

    key: str
    caption: str
    png: bytes

    @property
    def b64(self) -> str:
        return base64.b64encode(self.png).decode("ascii")

    @property
    def size(self) -> tuple[int, int]:
        """Width and height from the PNG header."""
        return int.from_bytes(self.png[16:20], "big"), int.from_bytes(self.png[20:24], "big")


# Captions of ui.charts' charts, by the keys of ChartsPanel.render_images.
CHART_CAPTIONS = {
    "pool": "KV pool pages by state: private to streams, shared, held only by the cache, free",
    "cache": "Cached chains and cached pages",
    "hits": "Cache hits (cumulative) and hit rate = saved / (saved + computed)",
    "prefill": "Prefill tokens computed and saved by the cache (cumulative)",
    "ttft": "Time to first token per request: misses, cache hits, and beside each hit its estimated TTFT "
            "without the cache (its TTFT + its cached tokens at the measured prefill rate)",
}


def _caption(key: str) -> str:
    return key.replace("_", " ").strip().capitalize()


def chart_images(report: Report, width: int = CHART_WIDTH, height: int = CHART_HEIGHT) -> list[Figure]:
    """The GUI's charts of this session as PNGs, drawn offscreen by ui.charts.ChartsPanel."""
    ensure_qt_app()
    from ui.charts import ChartsPanel  # app wires ui: the report's charts are the GUI's own
    panel = ChartsPanel()
    try:
        panel.set_data(list(report.timeline), list(report.requests), report.totals.prefill_tok_s)
        images = panel.render_images(width=width, height=height, theme="light")
    finally:
        panel.deleteLater()
    return [Figure(k, CHART_CAPTIONS.get(k) or _caption(k), png) for k, png in images.items()]


def page_map_image(report: Report, width: int = PAGE_MAP_WIDTH) -> Figure | None:
    """The pool's pages at the end of the session, drawn by the GUI's ui.page_map.PageMap."""
    ensure_qt_app()
    from ui.page_map import LEGEND_H, MARGIN, PageMap, fit_grid
    pages = report.pages
    if not pages.states:
        return None
    # Tall enough for the largest cells that fit the width, without blank rows below.
    need = fit_grid(pages.capacity, width - 2 * MARGIN, 10**6).size.height() + LEGEND_H + 2 * MARGIN
    pm = PageMap()
    try:
        pm.update_snapshot(snapshot_from_report(report))
        png = pm.render_image(width, int(min(max(need, 80), PAGE_MAP_MAX_HEIGHT)), theme="light")
    finally:
        pm.deleteLater()
    return Figure("page_map", f"Page map at the end: {pages.capacity} pages of {pages.page_rows} positions",
                  png)
