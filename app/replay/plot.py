"""The replay's PNGs: the What-if widget's charts, drawn offscreen and exported with pyqtgraph."""

from __future__ import annotations

from ..report.files import ReportWriteError, write_bytes
from .trace import TraceError


def write_plot(path: str, rows: list[dict], width: int = 900, height: int = 640) -> str:
    """Draw hit ratio vs capacity per policy (and over time) for `rows` into a PNG at `path`."""
    from ui.whatif import WhatIfChart
    return _write(WhatIfChart, path, rows, width, height)


def write_cluster_plot(path: str, rows: list[dict], width: int = 900, height: int = 640) -> str:
    """Draw hit ratio and p99 TTFT vs replicas, one line per router, into a PNG at `path`."""
    from ui.whatif_cluster import ClusterChart
    return _write(ClusterChart, path, rows, width, height)


def _write(chart_cls, path: str, rows: list[dict], width: int, height: int) -> str:
    from PySide6.QtCore import QEvent, Qt
    from PySide6.QtWidgets import QApplication

    from ui.colors import theme_for
    from ui.page_map import png_bytes

    from ..report.render import ensure_qt_app
    ensure_qt_app()
    chart = chart_cls()
    try:
        chart.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
        chart.resize(width, height)
        chart.show()
        chart.apply_theme(theme_for("light"))
        chart.set_rows(rows)
        QApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)
        data = png_bytes(chart.grab())
    finally:
        chart.close()
        chart.deleteLater()
    try:
        return write_bytes(path, data)
    except ReportWriteError as e:
        raise TraceError(f"cannot write the plot {path}: {e.reason}") from None
