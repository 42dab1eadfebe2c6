"""The What-if tab: its Qt-free data layer and its widget on real replay rows."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt

from app.replay import whatif
from app.replay.trace import open_trace
from ui.whatif_panel import WhatIfPanel


@pytest.fixture
def trace(tmp_path) -> str:
    """A hash-id trace (block 4): three hot prefixes of 3 blocks under one root, repeated."""
    path = tmp_path / "t.jsonl"
    with open(path, "w") as fh:
        for i in range(30):
            k = (0, 1, 0, 2)[i % 4]
            row = {"timestamp": i * 100, "input_length": 4 * 4 + 1, "output_length": 3,
                   "hash_ids": [0, 10 + k, 20 + k, 30 + k, 1000 + i]}
            fh.write(json.dumps(row) + "\n")
    return str(path)


def test_plan_suggests_capacities_below_the_working_set(trace):
    plan = whatif.plan(open_trace(trace, block_size=4))
    assert plan.requests == 30 and plan.page_rows == 4
    assert plan.cached_pages == 1 + 3 * 3  # the root and three chains of three blocks
    assert plan.knobs.budgets[0] is None and all(1 <= b < 10 for b in plan.knobs.budgets[1:])
    assert plan.knobs.policies == ["leaf-lru", "lru", "fifo"]
    # 27 of 30 requests hit their 4 blocks (the cap is (17 - 1) // 4 = 4), the first of chains
    # 2 and 3 hit the root only; 30 x 17 tokens in all.
    assert plan.bound == pytest.approx((27 * 16 + 2 * 4) / (30 * 17))


def test_knobs_from_text():
    k = whatif.knobs_from_text(" 16, 32", "inf, 3000 ,100", ["lru", "fifo"])
    assert (k.page_rows, k.budgets, k.policies) == ([16, 32], [None, 3000, 100], ["lru", "fifo"])
    assert whatif.knobs_from_text("", "inf", ["leaf-lru"]).page_rows == [None]
    with pytest.raises(ValueError, match="page sizes are integers"):
        whatif.knobs_from_text("16,x", "inf", ["lru"])
    with pytest.raises(ValueError, match="'inf'"):
        whatif.knobs_from_text("", "inf, -5", ["lru"])
    with pytest.raises(ValueError, match="policies must be some of"):
        whatif.knobs_from_text("", "inf", [])


def test_panel_asks_for_a_run_and_draws_the_rows(qtbot, trace):
    panel = WhatIfPanel()
    qtbot.addWidget(panel)
    assert not panel.run_button.isEnabled()  # nothing loaded yet
    plan = whatif.plan(open_trace(trace, block_size=4))
    panel.set_trace(f"{trace}: {plan.requests} requests", page_size_applies=False)
    panel.set_knobs(plan.knobs.page_rows, plan.knobs.budgets, plan.knobs.policies)
    assert panel.budgets.text().startswith("inf, ") and panel.policies["lru"].isChecked()
    assert not panel.policies["lfu"].isChecked() and not panel.page_rows.isEnabled()

    with qtbot.waitSignal(panel.run_requested) as sig:
        qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    knobs = whatif.knobs_from_text(*sig.args)
    rows = whatif.run(open_trace(trace, block_size=4), knobs, workers=1)
    panel.set_rows(rows)

    assert panel.table.rowCount() == len(rows) == len(plan.knobs.budgets) * 3
    assert panel.table.item(0, 1).text() == "inf"
    names = [item.name() for item in panel.chart.capacity.getPlotItem().listDataItems()]
    assert sorted(names[:3]) == ["fifo", "leaf-lru", "lru"] and names[3].startswith("infinite capacity")
    panel.show_error("bad budget")
    assert panel.error.isVisibleTo(panel) and panel.error.text() == "bad budget"


def test_this_sessions_trace(tiny_model, tmp_path):
    from engine.loop import EngineLoop
    from engine.scheduler import SchedulerSettings
    loop = EngineLoop(tiny_model, SchedulerSettings(page_rows=4))
    sch = loop.scheduler
    with pytest.raises(ValueError, match="no finished request yet"):
        whatif.session_trace(sch, str(tmp_path / "none.jsonl"))
    for q in ("Do you sell hammers?", "Where are the nails?"):
        loop.submit_now(system="You are a terse hardware store assistant.", user=q, max_new_tokens=3)
    loop.run_until_done()
    plan = whatif.plan(whatif.session_trace(sch, str(tmp_path / "s.jsonl")))
    assert plan.requests == 2 and plan.page_rows == 4
    assert plan.bound == pytest.approx(sch.prefill_saved / sum(r.n_prompt for r in sch.records()))
