"""ChartsPanel on a real scheduler run: series equal the timeline, TTFT split, PNG export offscreen."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine.metrics import TimelineRow  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(engine_run):
    return engine_run


@pytest.fixture
def panel(qtbot):
    from ui.charts import ChartsPanel
    w = ChartsPanel()
    qtbot.addWidget(w)
    w.resize(1100, 760)
    return w


def column(rows, name):
    if name == "hit_rate":
        return np.array([r.hit_rate for r in rows])
    return np.array([getattr(r, name) for r in rows], dtype=np.float64)


def last_x(curve) -> float | None:
    x = curve.getOriginalDataset()[0]
    return None if x is None or not len(x) else float(x[-1])


def drawn(curve, xs) -> np.ndarray:
    """The value a step curve shows at each x (curves keep only the rows where a value changes)."""
    cx, cy = curve.getOriginalDataset()
    return cy[np.searchsorted(cx, xs, side="right") - 1]


TIMELINE_NAMES = ("pages_private", "pages_shared", "pages_cached", "pages_free", "chains", "cached_pages",
                  "hits", "hit_rate", "prefill_computed", "prefill_saved")


def test_run_exercises_the_cache(run):
    last = run.rows[-1]
    assert len(run.snapshots) == len(run.rows) >= 3
    assert last.hits >= 1 and last.prefill_saved > 0 and last.prefill_computed > 0
    assert any(r.n_cached > 0 for r in run.records) and any(r.n_cached == 0 for r in run.records)


def test_series_equal_timeline_after_append_and_timer(run, panel, qtbot):
    # Feed it the way the worker does: each snapshot carries the rows since the previous one.
    for snap in run.snapshots:
        panel.append(snap.timeline, snap.records)
    for name in TIMELINE_NAMES:
        x, y = panel.series(name)
        np.testing.assert_array_equal(x, column(run.rows, "wall_s"))
        np.testing.assert_allclose(y, column(run.rows, name), err_msg=name)
    # The timer pushes the buffers to the curves (stacked for the pool chart).
    curves = panel.curves
    xs = column(run.rows, "wall_s")
    qtbot.waitUntil(lambda: last_x(curves["hits"]) == xs[-1], timeout=2000)
    qtbot.waitUntil(lambda: not panel.refresh_pending, timeout=2000)
    for name in ("hits", "prefill_saved", "prefill_computed", "chains", "cached_pages"):
        np.testing.assert_allclose(drawn(curves[name], xs), column(run.rows, name), err_msg=name)
    np.testing.assert_allclose(drawn(curves["hit_rate"], xs), 100 * column(run.rows, "hit_rate"))
    level = np.zeros(len(xs))
    for name in ("pages_private", "pages_shared", "pages_cached", "pages_free"):  # stacked
        level += column(run.rows, name)
        np.testing.assert_allclose(drawn(curves[name], xs), level, err_msg=name)
    np.testing.assert_allclose(level, column(run.rows, "capacity"))  # the stack sums to the pool
    for name in TIMELINE_NAMES:  # and the series still equal the timeline after the refresh
        np.testing.assert_allclose(panel.series(name)[1], column(run.rows, name))


def test_timer_coalesces_appends_and_stops_when_idle(run, panel, qtbot):
    qtbot.waitUntil(lambda: not panel.refresh_pending, timeout=2000)
    start = panel.frames
    for row in run.rows:  # many appends in one event-loop turn: one refresh, not one per row
        panel.append([row], run.records)
    assert panel.frames == start and panel.refresh_pending
    qtbot.waitUntil(lambda: panel.frames == start + 1, timeout=2000)
    qtbot.waitUntil(lambda: not panel.refresh_pending, timeout=2000)
    assert panel.frames == start + 1


def test_ttft_split_matches_records(run, panel):
    panel.append(run.rows, run.records)
    hit_x, hit_y = panel.series("ttft_hit")
    miss_x, miss_y = panel.series("ttft_miss")
    done = [r for r in run.records if r.ttft_s is not None]
    hits = sorted((r for r in done if r.n_cached > 0), key=lambda r: r.id)
    misses = sorted((r for r in done if r.n_cached == 0), key=lambda r: r.id)
    assert hits and misses
    np.testing.assert_array_equal(hit_x, [r.id for r in hits])
    np.testing.assert_allclose(hit_y, [r.ttft_s for r in hits])
    np.testing.assert_array_equal(miss_x, [r.id for r in misses])
    np.testing.assert_allclose(miss_y, [r.ttft_s for r in misses])
    assert set(hit_x).isdisjoint(miss_x)


def test_records_replace_and_set_data_and_clear(run, panel):
    panel.append(run.rows[:2], run.records)
    panel.append(run.rows[2:], run.records[:1])  # records replace, rows accumulate
    assert len(panel.series("hits")[0]) == len(run.rows)
    assert len(panel.series("ttft_hit")[0]) + len(panel.series("ttft_miss")[0]) == 1
    panel.set_data(run.rows[:3], run.records)
    np.testing.assert_allclose(panel.series("prefill_saved")[1], column(run.rows[:3], "prefill_saved"))
    np.testing.assert_allclose(drawn(panel.curves["prefill_saved"], column(run.rows[:3], "wall_s")),
                               column(run.rows[:3], "prefill_saved"))  # set_data redraws at once
    panel.clear()
    for name in ("hits", "ttft_hit", "ttft_miss"):
        assert len(panel.series(name)[0]) == 0
    with pytest.raises(KeyError):
        panel.series("nope")


def test_buffer_grows_past_its_capacity(run, panel):
    rows = [TimelineRow(**{**r.__dict__, "step": i + 1, "wall_s": i * 0.01})
            for i, r in enumerate(run.rows * 200)]
    panel.append(rows, [])
    x, y = panel.series("pages_free")
    assert len(x) == len(rows) > 256
    np.testing.assert_allclose(y, column(rows, "pages_free"))
    panel.refresh()


def test_step_changes_keeps_the_picture():
    from ui.chart_data import step_changes
    x = np.arange(8.0)
    y = np.array([0, 0, 0, 2, 2, 3, 3, 3.0])
    cx, cy = step_changes(x, y)
    np.testing.assert_array_equal(cx, [0, 3, 5, 7])
    np.testing.assert_array_equal(cy[np.searchsorted(cx, x, side="right") - 1], y)


def test_render_images_offscreen(run, panel):
    panel.set_data(run.rows, run.records)
    images = panel.render_images(width=640, height=240)
    assert set(images) == set(panel.plot_widgets()) == {"pool", "cache", "hits", "prefill", "ttft", "parts"}
    from PySide6.QtGui import QImage
    for name, png in images.items():
        assert png.startswith(PNG), name
        img = QImage.fromData(png, "PNG")
        assert (img.width(), img.height()) == (640, 240)
    dark = panel.render_images(width=320, height=200, theme="dark")
    img = QImage.fromData(dark["pool"], "PNG")
    assert img.pixelColor(2, 2).lightness() < 100  # a dark background
    assert QImage.fromData(images["pool"], "PNG").pixelColor(2, 2).lightness() > 200


def test_themes_follow_the_palette(panel, qtbot):
    from PySide6.QtGui import QColor, QPalette
    pal = QPalette(panel.palette())
    pal.setColor(QPalette.ColorRole.Window, QColor("#1b1d22"))
    pal.setColor(QPalette.ColorRole.Base, QColor("#23262d"))
    pal.setColor(QPalette.ColorRole.WindowText, QColor("#e5e7eb"))
    panel.setPalette(pal)
    qtbot.waitUntil(lambda: panel.theme.dark, timeout=1000)
    bg = panel.plot_widgets()["pool"].backgroundBrush().color()
    assert bg.lightness() < 100


def test_the_shown_charts_end_at_the_sessions_last_figures(run, panel, qtbot):
    panel.set_data(run.rows, run.records)
    panel.show()
    qtbot.waitExposed(panel)
    panel.refresh()
    last = run.rows[-1]
    for name in ("hits", "prefill_saved", "prefill_computed"):  # each curve's last point: the last row
        x, y = panel.curves[name].getOriginalDataset()
        assert (x[-1], y[-1]) == (last.wall_s, getattr(last, name)), name
    assert panel.curves["hit_rate"].getOriginalDataset()[1][-1] == pytest.approx(100 * last.hit_rate)
    # and the hits chart shows that point once painted: its view reaches the last step and count
    view = panel.plot_widgets()["hits"].getPlotItem()

    def in_view() -> bool:
        (x0, x1), (y0, y1) = view.viewRange()
        return x0 <= last.wall_s <= x1 and y0 <= last.hits <= y1

    qtbot.waitUntil(in_view, timeout=3000)


def test_many_redraws_keep_the_interpreter_alive(run, panel, qtbot):
    """PySide6 6.12.0 drops references to None on every paint (3.11 aborts): the pin keeps it out."""
    import sys
    panel.show()
    qtbot.waitExposed(panel)
    before = sys.getrefcount(None)
    for i in range(60):
        panel.append([run.rows[i % len(run.rows)]], run.records)
        panel.refresh()
        panel.repaint()
    assert sys.getrefcount(None) >= before - 500


def test_a_panel_on_a_hidden_tab_draws_only_once_shown(run, qtbot):
    from PySide6.QtWidgets import QLabel, QTabWidget

    from ui.charts import ChartsPanel
    tabs = QTabWidget()
    qtbot.addWidget(tabs)
    panel = ChartsPanel()
    tabs.addTab(QLabel("another tab"), "Other")
    tabs.addTab(panel, "Charts")
    tabs.resize(900, 600)
    tabs.show()
    qtbot.waitExposed(tabs)
    qtbot.waitUntil(lambda: not panel.refresh_pending or panel.frames > 0, timeout=2000)
    start = panel.frames
    panel.append(run.rows, run.records)
    qtbot.wait(700)  # several refresh intervals: a user cannot see these charts, so none is drawn
    assert panel.frames == start and panel.refresh_pending
    tabs.setCurrentWidget(panel)
    qtbot.waitUntil(lambda: panel.frames == start + 1, timeout=2000)
    assert last_x(panel.curves["hits"]) == run.rows[-1].wall_s


def test_axes_repaint_from_a_cache_until_they_change(run, qtbot, monkeypatch):
    """Text is most of a chart's paint: a repaint that changes no range must not redraw the
    axes, and a range that grows must (the new tick labels reach the screen)."""
    import pyqtgraph as pg

    from ui.charts import ChartsPanel
    painted = []
    real = pg.AxisItem.paint
    # patched before any axis exists: Qt's virtual call then finds the patched method
    monkeypatch.setattr(pg.AxisItem, "paint", lambda self, *a: (painted.append(self), real(self, *a))[1])
    panel = ChartsPanel()
    qtbot.addWidget(panel)
    panel.resize(1100, 760)
    panel.show()
    qtbot.waitExposed(panel)
    pw = panel.plot_widgets()["pool"]

    def settle():  # pyqtgraph fits ranges lazily, at paint time: give it a few paints
        for _ in range(3):
            pw.viewport().repaint()
            qtbot.wait(10)

    panel.set_data(run.rows[:len(run.rows) // 2], run.records)
    settle()
    before = pw.grab().toImage()
    painted.clear()
    pw.viewport().repaint()  # nothing changed: the cached pixmaps are drawn
    assert painted == []
    panel.set_data(run.rows, run.records)  # the time axis grows
    settle()
    assert pw.getPlotItem().getAxis("bottom") in painted
    assert pw.grab().toImage() != before


def test_refresh_draws_every_chart_even_mid_way_through_a_staggered_one(run, panel, qtbot):
    """The timer's refresh paints one chart at a time (the others wait with updates off);
    refresh() must leave none of them waiting, so a grab right after shows every chart."""
    panel.show()
    qtbot.waitExposed(panel)
    panel.append(run.rows, run.records)
    panel._on_tick()  # the timer's staggered refresh: some charts wait their turn
    waiting = [name for name, pw in panel.plot_widgets().items() if not pw.updatesEnabled()]
    assert waiting
    panel.refresh()
    assert all(pw.updatesEnabled() for pw in panel.plot_widgets().values())
    img = panel.plot_widgets()[waiting[-1]].grab().toImage()
    assert img.pixelColor(img.width() // 2, 4).lightness() > 200  # the light background, not black


def test_each_hit_has_its_ttft_without_the_cache_beside_it(run, panel):
    # The estimate: the hit's TTFT plus its cached tokens at the session's measured prefill rate.
    rate = run.scheduler.prefill_rate()
    assert rate > 0
    panel.set_data(run.rows, run.records, rate)
    hits = sorted((r for r in run.records if r.n_cached > 0 and r.ttft_s is not None), key=lambda r: r.id)
    est_x, est_y = panel.series("ttft_no_cache")
    np.testing.assert_array_equal(est_x, [r.id for r in hits])
    np.testing.assert_allclose(est_y, [r.ttft_s + r.n_cached / rate for r in hits])
    assert np.all(est_y > [r.ttft_s for r in hits])  # never below the hit's own bar
    # Drawn beside the hit's own bar, and labelled as an estimate in the legend.
    from ui.charts import ChartsPanel  # noqa: F401 - the panel fixture made one
    bars = panel._charts.bars
    hit_x = bars["ttft_hit"].opts["x"]
    assert np.all(np.asarray(bars["ttft_no_cache"].opts["x"]) > np.asarray(hit_x))
    labels = [label.text for _, label in panel._charts.legends["ttft"].items]
    assert any("estimate" in t for t in labels)
    assert "without the cache" in panel.summary.text()
    # Without a measured rate there is nothing to estimate.
    panel.set_data(run.rows, run.records)
    assert len(panel.series("ttft_no_cache")[0]) == 0


@pytest.mark.parametrize("pool", ["thousands", "snug"])
def test_pool_chart_shows_the_pages_in_use_even_in_a_pool_of_thousands(run, panel, qtbot, pool):
    """The KV budget sizes the app's pool in thousands of pages: the chart zooms to the pages
    in use (their bands must not shrink to a line at the foot of the free band) and names the
    pool's size; a pool they fill a good part of is shown whole."""
    import dataclasses

    held = max(r.capacity - r.pages_free for r in run.rows)
    cap = 3428 if pool == "thousands" else held + held // 2
    rows = [dataclasses.replace(r, capacity=cap, pages_free=cap - (r.capacity - r.pages_free))
            for r in run.rows]
    panel.show()
    qtbot.waitExposed(panel)
    panel.set_data(rows, run.records)
    pw = panel.plot_widgets()["pool"]
    for _ in range(3):  # pyqtgraph fits ranges at paint time
        pw.viewport().repaint()
        qtbot.wait(10)
    high = pw.getPlotItem().vb.viewRange()[1][1]
    assert high >= held
    if pool == "snug":
        assert high >= cap
    else:
        assert high <= max(3 * held, 40) < cap / 10
    assert f"{cap:,}" in pw.getPlotItem().getAxis("left").labelText


def test_a_refresh_fits_the_ranges_from_its_own_columns_before_any_paint(run, panel, qtbot, monkeypatch):
    """The UI thread shares the GIL with the engine worker, so a frame must be cheap: a refresh
    fits each timeline chart's range from the columns it plotted, at once (fitted at paint time,
    the new range repaints every plot's axes a second time), without pyqtgraph's walk over each
    item's data, and to the same view that walk gives."""
    import pyqtgraph as pg

    panel.show()
    qtbot.waitExposed(panel)
    walked = []
    real = pg.PlotDataItem.dataBounds
    monkeypatch.setattr(pg.PlotDataItem, "dataBounds",
                        lambda self, *a, **k: (walked.append(self), real(self, *a, **k))[1])
    panel.set_data(run.rows, run.records)  # no paint in between
    end = run.rows[-1].wall_s
    views = {name: panel.plot_widgets()[name].getPlotItem().vb
             for name in ("pool", "cache", "hits", "prefill")}
    fitted = {name: vb.viewRange() for name, vb in views.items()}
    assert walked == []
    for name, vb in views.items():
        (x0, x1), (y0, y1) = fitted[name]
        assert x0 <= run.rows[0].wall_s and x1 >= end, name
        own = pg.ViewBox.childrenBounds(vb)  # pyqtgraph's walk over the same items
        span = np.array([x1 - x0, y1 - y0])
        np.testing.assert_allclose(vb.childrenBounds(), own, rtol=0, atol=0.03 * span.max(), err_msg=name)
        np.testing.assert_allclose(np.array(vb.childrenBounds())[:, 1], np.array(own)[:, 1],
                                   rtol=0.03, err_msg=name)


def test_snapshots_with_nothing_new_cost_no_frame_and_a_run_end_draws_at_once(run, panel, qtbot):
    """An idle snapshot (a flush, a pin) has no rows for the charts: no frame. During a run the
    charts back off (up to seconds between frames on a slow machine), so the run's end draws now."""
    panel.show()
    qtbot.waitExposed(panel)
    half = len(run.rows) // 2
    panel.set_data(run.rows[:half], run.records)
    start = panel.frames
    panel.append([], run.records)
    assert not panel.refresh_pending
    panel.append(run.rows[half:], run.records)
    assert panel.refresh_pending and panel.frames == start
    panel.settle()
    assert panel.frames == start + 1
    assert last_x(panel.curves["hits"]) == run.rows[-1].wall_s
