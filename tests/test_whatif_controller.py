"""The What-if tab end to end on real widgets: load a trace, run a sweep off the UI thread, see rows."""

from __future__ import annotations

import json

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
    qtbot.mouseClick(panel.session_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.error.isVisibleTo(panel), timeout=10_000)
    assert "no requests" in panel.error.text()

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
