"""The What-if tab end to end on real widgets: load a trace, run a sweep off the UI thread, see rows."""

from __future__ import annotations

import json
import os

import pytest
from PySide6.QtCore import Qt

from app.desktop.whatif_controller import WhatIfController
from app.replay import whatif
from app.replay.record import save_session_trace
from app.replay.trace import open_trace
from engine.loop import EngineLoop
from engine.scheduler import SchedulerSettings
from ui.whatif_panel import WhatIfPanel


def hash_trace(tmp_path) -> str:
    path = tmp_path / "t.jsonl"
    with open(path, "w") as fh:
        for i in range(24):
            k = (0, 1, 0, 2)[i % 4]
            fh.write(json.dumps({"timestamp": i * 100, "input_length": 4 * 512 + 7, "output_length": 3,
                                 "hash_ids": [0, 10 + k, 20 + k, 30 + k, 1000 + i]}) + "\n")
    return str(path)


@pytest.fixture
def tab(qtbot):
    panel = WhatIfPanel()
    qtbot.addWidget(panel)
    made = []

    def make(ask, session=None) -> WhatIfController:
        c = WhatIfController(panel, ask, session, workers=1)
        made.append(c)
        return c
    yield panel, make
    for c in made:
        c.close()


def test_load_plan_and_run(qtbot, tab, tmp_path):
    panel, make = tab
    path = hash_trace(tmp_path)
    make(lambda: path)
    assert not panel.session_button.isEnabled()  # no session source given
    qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=10_000)
    assert "24 requests" in panel.trace_label.text() and "512-token blocks" in panel.trace_label.text()
    assert panel.budgets.text().startswith("inf, ") and not panel.page_rows.isEnabled()

    panel.budgets.setText("inf, 4, 2")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 9, timeout=20_000)
    expected = whatif.run(open_trace(path), whatif.Knobs([None], [None, 4, 2], ["leaf-lru", "lru", "fifo"]),
                          workers=1)
    assert [r["token_hit_ratio"] for r in panel.chart.rows] == [r["token_hit_ratio"] for r in expected]
    assert panel.table.item(0, 4).text() == f"{expected[0]['token_hit_ratio']:.2%}"


def test_a_disk_tier_draws_two_tier_curves_beside_the_one_tier_curve(qtbot, tab, tmp_path):
    from app.replay.sweep import configurations, run_sweep
    panel, make = tab
    path = hash_trace(tmp_path)
    controller = make(lambda: path)
    controller.load_trace()
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=10_000)
    panel.budgets.setText("inf, 2")
    panel.disk_budgets.setText("4, 40")
    for name, box in panel.policies.items():
        box.setChecked(name == "leaf-lru")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 4, timeout=20_000)  # the bound, then 2 + 0/4/40
    rows = {(r["budget"], r["disk_budget"]): r["token_hit_ratio"] for r in panel.chart.rows}
    assert set(rows) == {(None, None), (2, None), (2, 4), (2, 40)}
    # the same code as `prefixlab replay --budget 2 --disk-budget 4,40`
    cli = run_sweep(open_trace(path), configurations([None], [2], ["leaf-lru"], [None, 4, 40]), workers=1)
    assert [rows[(2, r.disk_budget)] for r in cli] == [r.token_hit_ratio for r in cli]
    assert rows[(2, None)] < rows[(2, 40)] <= rows[(None, None)]  # a second tier buys hits
    names = [item.name() for item in panel.chart.capacity.getPlotItem().listDataItems()]
    assert {"leaf-lru", "leaf-lru + 4 disk pages", "leaf-lru + 40 disk pages"} <= set(names)
    assert [panel.table.item(i, 2).text() for i in range(4)] == ["-", "-", "4", "40"]
    controller.run("", "inf, 2", ["lru"], "4, inf")
    assert "disk tier" in panel.error.text() and "'inf'" in panel.error.text()


def test_bad_trace_and_bad_knobs_show_errors(qtbot, tab, tmp_path):
    panel, make = tab
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    controller = make(lambda: str(bad))
    controller.load_trace()
    qtbot.waitUntil(lambda: panel.error.isVisibleTo(panel), timeout=10_000)
    assert "line 2" in panel.error.text() and not panel.run_button.isEnabled()

    controller.load_trace(hash_trace(tmp_path))
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=10_000)
    controller.run("", "inf, lots", ["leaf-lru"])
    assert "'lots'" in panel.error.text()


def test_this_session(qtbot, tab, tiny_model, tmp_path):
    panel, make = tab
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4))
    sch = loop.scheduler
    for q in ("Do you sell hammers?", "Where are the nails?", "Do you cut keys?"):
        loop.submit_now(system="You are a terse hardware store assistant.", user=q, max_new_tokens=3)
    loop.run_until_done()
    controller = None

    def save(path: str) -> None:  # what the worker does in its own thread, then answers
        save_session_trace(path, sch, tiny_model.name)
        controller.on_session_trace(path, "")
    controller = make(lambda: "", save)
    qtbot.mouseClick(panel.session_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=10_000)
    assert "this session: 3 requests" in panel.trace_label.text() and panel.page_rows.isEnabled()
    ratio = sch.prefill_saved / sum(r.n_prompt for r in sch.records())
    assert f"hit ratio {ratio:.1%}" in panel.trace_label.text()


def test_the_apps_whatif_tab_replays_this_session(open_desktop, qtbot, tiny_gguf_path):
    """In the window: before any request the tab says why; after a run it plans and sweeps it."""
    from tests.gui_helpers import LOAD_TIMEOUT_MS, RUN_TIMEOUT_MS, set_settings
    d = open_desktop(autoload=True, model_path=tiny_gguf_path)
    w, c = d.window, d.controller
    w.show()
    qtbot.waitUntil(lambda: c.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    panel = w.whatif
    assert w.tabs.tabText(w.tabs.indexOf(panel)) == "What-if"
    # the loaded model's kept calibration, or the command that makes one
    from app.replay.whatif_twin import cost_text, kept_cost
    cost, where = kept_cost(c.model_info["path"])
    assert panel.cost_label.text() == (cost_text(cost, where) if cost else where)
    assert f"--model {c.model_info['path']}" in where or cost is not None
    qtbot.mouseClick(panel.session_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.error.isVisibleTo(panel), timeout=10_000)
    assert "no requests" in panel.error.text()

    # the new pool before the run: a pool change waits for an idle engine, and one that came
    # after the run would start a new session without its requests
    with qtbot.waitSignal(c.scheduler_reset, timeout=LOAD_TIMEOUT_MS):
        set_settings(d, page_rows=4, max_new_tokens=4)
    c.run_all("You are a terse hardware store assistant.",
              [("a", "Do you sell hammers?"), ("b", "Where are the nails?"), ("c", "Do you cut keys?")])
    qtbot.waitUntil(lambda: len(c.finished_records) == 3 and not c.running, timeout=RUN_TIMEOUT_MS)
    qtbot.mouseClick(panel.session_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "this session: 3 requests" in panel.trace_label.text(), timeout=10_000)
    panel.budgets.setText("inf, 8")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 6, timeout=60_000)
    inf = next(r for r in panel.chart.rows if r["budget"] is None and r["policy"] == "leaf-lru")
    assert inf["page_rows"] == 4 and inf["hits"] == 2  # the two later questions hit the system prompt


def twin_expected(path: str, cost, budget, slo):
    """What `prefixlab replay TRACE --twin --cost FILE` predicts for one capacity (512-token blocks)."""
    from app.replay.twin_replay import TwinConfig, predict
    settings = SchedulerSettings(page_rows=512, cache_pages=budget or 0)
    return predict(open_trace(path), TwinConfig(cost, settings, slo_ttft_s=slo))


def test_predicted_ttft_curves_beside_the_hit_ratios(qtbot, tab, tmp_path):
    """With a given cost file the tab draws the twin's TTFT p50 and p90 at each capacity it sweeps:
    the points the twin predicts for the same configuration, and the goodput under the SLO."""
    from app.replay.stepcost import StepCost
    panel, make = tab
    path = hash_trace(tmp_path)
    cost = StepCost(c0=0.01, c_prefill=1e-4, c_decode=1e-3, machine="a test's")
    cost_file = str(tmp_path / "cost.json")
    cost.save(cost_file)
    controller = make(lambda: path)
    assert panel.cost_label.text().startswith("None: ") and "prefixlab calibrate" in panel.cost_label.text()
    assert not panel.calibrate_button.isEnabled()  # no model loaded to calibrate
    controller.load_cost(cost_file)
    assert cost_file in panel.cost_label.text() and "a test's" in panel.cost_label.text()
    controller.load_trace()
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=10_000)
    assert not panel.predict_button.isEnabled()  # no sweep to predict yet
    panel.budgets.setText("inf, 4, 2")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.predict_button.isEnabled(), timeout=30_000)
    assert panel.table.columnCount() == 8 and not panel.chart.ttft_rows  # the hit ratios alone, as before
    panel.slo_ttft.setText("soon")
    qtbot.mouseClick(panel.predict_button, Qt.MouseButton.LeftButton)
    assert "TTFT SLO" in panel.error.text() and "'soon'" in panel.error.text()
    panel.slo_ttft.setText("0.3")
    qtbot.mouseClick(panel.predict_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(panel.chart.ttft_rows) and panel.run_button.isEnabled(), timeout=30_000)
    assert not panel.error.isVisibleTo(panel)

    expected = {b: twin_expected(path, cost, b, 0.3) for b in (None, 4, 2)}
    drawn = {}
    for item in panel.chart.ttft.vb.addedItems:  # the capacity plot's right axis: seconds
        xs, ys = item.getOriginalDataset()
        drawn[item.name()] = (list(xs), list(ys))
    legend = [label.text for _, label in panel.chart.capacity.getPlotItem().legend.items]
    assert {"leaf-lru", "TTFT p50", "TTFT p90"} <= set(legend)
    assert panel.chart.capacity.getPlotItem().getAxis("right").labelText == "predicted TTFT (s)"
    assert drawn["TTFT p50"] == ([2, 4], [expected[2].ttft_s["p50"], expected[4].ttft_s["p50"]])
    assert drawn["TTFT p90"] == ([2, 4], [expected[2].ttft_s["p90"], expected[4].ttft_s["p90"]])
    bound = next(v for k, v in drawn.items() if k.startswith("TTFT p50, infinite capacity"))
    assert set(bound[1]) == {expected[None].ttft_s["p50"]}
    assert expected[2].ttft_s["p50"] > expected[None].ttft_s["p50"]  # a small cache misses, so waits longer

    # Beside the hit ratios in the table: the engine's policy's rows carry the prediction.
    head = [panel.table.horizontalHeaderItem(j).text() for j in range(panel.table.columnCount())]
    p50, goodput = head.index("TTFT p50 (s)"), head.index("goodput, TTFT <= 0.3 s (req/s)")
    for i in range(panel.table.rowCount()):
        budget, policy = panel.table.item(i, 1).text(), panel.table.item(i, 3).text()
        cell = panel.table.item(i, p50).text()
        if policy != "leaf-lru":
            assert cell == "-"
            continue
        res = expected[None if budget == "inf" else int(budget)]
        assert cell == f"{res.ttft_s['p50']:.3f}"
        assert panel.table.item(i, goodput).text() == f"{res.goodput_rps:.3f}" and res.good < res.requests


def test_the_kept_calibration_or_how_to_get_one(qtbot, tab, tmp_path, monkeypatch):
    from app.replay.calibrate import cost_path
    from app.replay.stepcost import StepCost
    monkeypatch.setenv("PREFIXLAB_CACHE_DIR", str(tmp_path / "cache"))
    panel, _ = tab
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    controller = WhatIfController(panel, lambda: "", None, workers=1, model_path=lambda: str(model))
    try:
        assert "None kept for m.gguf on this machine" in panel.cost_label.text()
        assert f"prefixlab calibrate --model {model}" in panel.cost_label.text()
        kept = cost_path(str(model))
        os.makedirs(os.path.dirname(kept))  # where `prefixlab calibrate` keeps it
        StepCost(c0=0.02, c_decode=1e-3, machine="this one").save(kept)
        controller.refresh_cost()
        assert panel.cost_label.text() == f"{kept} (measured on this one)"
        controller.load_cost(str(tmp_path / "missing.json"))
        assert "missing.json" in panel.error.text() and controller.cost is not None  # the kept one stays
    finally:
        controller.close()


def test_stop_ends_the_prediction(qtbot, tab, tmp_path):
    """A long prediction shows progress and a Stop button; Stop ends it and says so."""
    from app.replay.stepcost import StepCost
    panel, make = tab
    path = tmp_path / "long.jsonl"
    with open(path, "w") as fh:
        for i in range(3000):
            fh.write(json.dumps({"timestamp": i * 10, "input_length": 2 * 512, "output_length": 40,
                                 "hash_ids": [i % 7, 100 + i]}) + "\n")
    controller = make(lambda: str(path))
    controller.load_cost(str(_cost_file(tmp_path, StepCost(c0=0.01, c_prefill=1e-5, c_decode=1e-4))))
    controller.load_trace()
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=20_000)
    for name, box in panel.policies.items():
        box.setChecked(name == "leaf-lru")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.predict_button.isEnabled(), timeout=60_000)
    assert not panel.stop_button.isVisibleTo(panel)  # a sweep has no Stop
    qtbot.mouseClick(panel.predict_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.stop_button.isVisibleTo(panel), timeout=60_000)
    qtbot.waitUntil(lambda: panel.progress.value() > 0, timeout=60_000)
    qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=30_000)
    assert "Stopped" in panel.error.text() and not panel.chart.ttft_rows
    assert not panel.stop_button.isVisibleTo(panel) and panel.table.rowCount() > 0  # the hit ratios stay


def _cost_file(tmp_path, cost) -> str:
    path = str(tmp_path / "cost.json")
    cost.save(path)
    return path


def test_calibrate_runs_prefixlab_calibrate_on_the_loaded_model(qtbot, tab, tiny_gguf_path, tmp_path,
                                                                 monkeypatch):
    """Calibrate runs `prefixlab calibrate --model` in a child process; the tiny test model's
    512-token context is too short for its workloads, so the tab says why and keeps no cost."""
    monkeypatch.setenv("PREFIXLAB_CACHE_DIR", str(tmp_path / "cache"))
    panel, _ = tab
    controller = WhatIfController(panel, lambda: "", None, workers=1, model_path=lambda: tiny_gguf_path)
    try:
        assert f"--model {tiny_gguf_path}" in panel.cost_label.text() and panel.calibrate_button.isEnabled()
        qtbot.mouseClick(panel.calibrate_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: panel.error.isVisibleTo(panel), timeout=120_000)
        assert "prefixlab calibrate failed" in panel.error.text() and "context is 512" in panel.error.text()
        assert panel.calibrate_button.isEnabled() and controller.cost is None
    finally:
        controller.close()


@pytest.mark.parametrize("size", [(1280, 800), (1600, 1000)])
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_tab_with_predicted_ttft_fits(qtbot, tmp_path, theme, size):
    """The step-cost row, Predict/Stop and the TTFT axis and columns leave nothing cut."""
    from PySide6.QtCore import QSettings

    from app.replay import whatif_twin
    from app.replay.stepcost import StepCost
    from tests.test_ui_panes_fit import cut_children
    from ui.main_window import MainWindow
    path = hash_trace(tmp_path)
    knobs = whatif.Knobs([None], [None, 4, 2, 1], ["leaf-lru", "lru", "fifo"])
    rows = whatif.run(open_trace(path), knobs, workers=1)
    ttft = whatif_twin.run(open_trace(path), whatif_twin.configurations(knobs, 512, True),
                           StepCost(c0=0.01, c_prefill=1e-4, c_decode=1e-3), 24, 0.3)
    w = MainWindow(QSettings(str(tmp_path / "w.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    w.set_theme(theme)
    w.show()
    qtbot.waitExposed(w)
    w.reset_layout()
    w.resize(*size)
    w.tabs.setCurrentWidget(w.whatif)
    panel = w.whatif
    panel.set_trace("t.jsonl: 24 requests")
    panel.set_cost(f"{tmp_path}/a-long-folder-name/cost.json (measured on AMD EPYC, 2 cores)", True, True)
    panel.set_rows(rows)
    panel.set_ttft_rows(ttft)
    panel.set_busy(True, stoppable=True)
    qtbot.wait(50)
    assert (w.width(), w.height()) == size
    assert panel.stop_button.isVisible() and not cut_children(panel), cut_children(panel)
