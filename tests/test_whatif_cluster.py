"""The What-if tab's cluster sweep on real widgets: replicas x routers off the UI thread, charts and table."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from app.desktop.whatif_controller import WhatIfController
from app.replay.cluster import ServiceModel
from app.replay.synth import synthesize
from app.replay.trace import open_trace
from app.replay.whatif_cluster import ClusterKnobs, cluster_knobs_from_text, run_cluster
from ui.whatif_cluster import cluster_lines
from ui.whatif_panel import WhatIfPanel

SERVICE = ServiceModel(prefill_rate=20_000.0, decode_rate=40.0, slots=4)


@pytest.fixture
def loaded(qtbot, tmp_path):
    path = str(tmp_path / "synth.jsonl")
    synthesize(300, path, seed=2)
    panel = WhatIfPanel()
    qtbot.addWidget(panel)
    controller = WhatIfController(panel, lambda: path, None, workers=1, service=SERVICE)
    controller.load_trace()
    qtbot.waitUntil(lambda: panel.cluster.run_button.isEnabled(), timeout=20_000)
    yield panel, controller, path
    controller.close()


def test_cluster_run_draws_one_line_per_router(qtbot, loaded):
    panel, _, path = loaded
    panel.cluster.replicas.setText("1,2,4")
    panel.cluster.budgets.setText("100")
    panel.cluster.routers["random"].setChecked(False)
    qtbot.mouseClick(panel.cluster.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 15, timeout=60_000)
    expected = run_cluster(open_trace(path), ClusterKnobs([1, 2, 4], [100],
                           ["round-robin", "prefix-hash", "least-loaded", "cache-aware", "kv-cost"]),
                           SERVICE, workers=1)
    def key(rows):
        return [(r["replicas"], r["router"], r["token_hit_ratio"], r["ttft_p99_s"]) for r in rows]
    assert key(panel.cluster_chart.rows) == key(expected)
    assert panel.cluster_chart.isVisibleTo(panel) and not panel.chart.isVisibleTo(panel)
    lines = cluster_lines(panel.cluster_chart.rows)
    assert sorted(k[0] for k in lines) == sorted(panel.cluster.routers.keys() - {"random"})
    assert all(ns == [1, 2, 4] for ns, _, _ in lines.values())
    assert len(panel.cluster_chart.hit.getPlotItem().listDataItems()) == 5
    assert panel.table.horizontalHeaderItem(0).text() == "replicas"
    assert panel.table.item(0, 3).text() == f"{expected[0]['token_hit_ratio']:.2%}"


def test_bad_cluster_knobs_show_errors(loaded):
    panel, controller, _ = loaded
    controller.run_cluster("0,2", "100", ["round-robin"])
    assert "at least 1 replica" in panel.error.text()
    controller.run_cluster("2", "100", [])
    assert "pick at least one router" in panel.error.text()
    with pytest.raises(ValueError, match="unknown router 'fastest'"):
        cluster_knobs_from_text("2", "100", ["fastest"])
