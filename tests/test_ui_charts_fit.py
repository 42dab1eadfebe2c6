"""The charts fit the window: every axis, tick label, axis title, legend and chart title lies inside
its plot widget at 1280x800, in both themes (a cut-off right axis was how this failed)."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QRectF  # noqa: E402
from PySide6.QtGui import QImage, QPainter  # noqa: E402


def _view_rect(pw, scene_rect) -> QRectF:
    return QRectF(pw.mapFromScene(scene_rect).boundingRect())


def outside(pw) -> list[str]:
    """What of one plot widget is drawn (partly) outside it: axes, tick labels, titles, legend."""
    view = QRectF(pw.viewport().rect())
    item = pw.getPlotItem()
    bad = []
    scratch = QImage(8, 8, QImage.Format.Format_ARGB32)
    for side in ("left", "bottom", "right"):
        axis = item.getAxis(side)
        if not axis.isVisible():
            continue
        if not view.contains(_view_rect(pw, axis.sceneBoundingRect())):
            bad.append(f"{side} axis")
        painter = QPainter(scratch)
        try:
            _, _, texts = axis.generateDrawSpecs(painter)  # where the axis draws each tick label
        finally:
            painter.end()
        for rect, _flags, text in texts:
            # The axis caches its drawing as a pixmap of its bounding rect: outside it is cut.
            if not axis.boundingRect().contains(rect) or \
                    not view.contains(_view_rect(pw, axis.mapRectToScene(rect))):
                bad.append(f"{side} tick {text!r}")
        if axis.label.isVisible() and not view.contains(_view_rect(pw, axis.label.sceneBoundingRect())):
            bad.append(f"{side} axis title")
    legend = item.layout.itemAt(4, 0) or item.layout.itemAt(4, 1)
    for what, it in (("legend", legend), ("title", item.titleLabel)):
        if it is not None and not view.contains(_view_rect(pw, it.sceneBoundingRect())):
            bad.append(what)
    return bad


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_every_axis_label_and_tick_fits_at_1280x800(theme, open_desktop, engine_run, qtbot):
    from engine.snapshot import SnapshotMaker

    d = open_desktop()
    w = d.window
    w.set_theme(theme)
    w.resize(1280, 800)
    w.show()
    qtbot.waitExposed(w)
    w.reset_layout()
    w.resize(1280, 800)
    snap = SnapshotMaker().take(engine_run.scheduler, since_row=0)
    w.show_stats(snap, list(snap.timeline), True)
    w.tabs.setCurrentWidget(w.charts)
    w.charts.refresh()
    qtbot.wait(200)  # the layout settles
    charts = w.charts.plot_widgets()
    assert w.width() <= 1280 and w.charts.width() > 0
    assert all(pw.isVisible() for pw in charts.values())
    assert {name: outside(pw) for name, pw in charts.items()} == {name: [] for name in charts}
    # The hit-rate axis (the one that was pushed out) is really shown.
    assert charts["hits"].getPlotItem().getAxis("right").isVisible()
