"""The watch view's live router: for a typed prompt, each engine's precise prefix-cache score and the pick."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from app.kv_wire import BlockStored, KVEventBatch  # noqa: E402
from app.serve.kv_events_publisher import KVEventPublisher  # noqa: E402
from app.watch.gui import WatchWindow  # noqa: E402
from app.watch.router_score import router_scores  # noqa: E402
from app.watch.state import EngineState  # noqa: E402
from tests.kv_events_helpers import Event, Page  # noqa: E402


def test_scores_are_the_leading_fraction_of_blocks_resident_by_content():
    a, b, c = EngineState(0, "a"), EngineState(1, "b"), EngineState(2, "c")
    a.apply(0, KVEventBatch(0.0, [BlockStored([10, 11], None, [1, 2, 3, 4], 2)]))
    b.apply(0, KVEventBatch(0.0, [BlockStored([90, 91, 92], None, [1, 2, 3, 4, 5, 6], 2)]))  # other hash seed
    c.apply(0, KVEventBatch(0.0, [BlockStored([50, 51], None, [9, 9, 3, 4], 2)]))  # no first block
    got = router_scores([a, b, c], [1, 2, 3, 4, 5, 6, 7])
    assert [(e["matched_blocks"], e["prompt_blocks"]) for e in got["engines"]] == [(2, 3), (3, 3), (0, 3)]
    assert [round(e["score"], 3) for e in got["engines"]] == [0.667, 1.0, 0.0]
    assert got["pick"] == 1
    assert router_scores([a, b, c], [7, 7, 7, 7])["pick"] == 0  # nobody has it: the first engine


def test_watch_window_routes_a_typed_prompt(qtbot, gui_settings):
    pubs = [KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") for _ in range(2)]
    window = WatchWindow(tokenize=lambda text: [1, 2, 3, 4, 9, 9] if text == "hello there" else [])
    qtbot.addWidget(window)
    try:
        assert window.start_watching([p.endpoint for p in pubs], [p.replay_endpoint for p in pubs], "")
        for i, p in enumerate(pubs):
            assert p.wait_for_subscriber(10)
            p(Event("stored", (Page(1, None, (1, 2)), Page(2, 1, (3, 4)), Page(10 + i, 2, (5 + i, 6)))))
        qtbot.waitUntil(lambda: len(window.view.panes) == 2 and all(
            "live 3 blocks" in pane.counters.text() for pane in window.view.panes), timeout=10_000)
        window.view.prompt.setText("1, 2, 3, 4, 6, 6, 8")
        window.view.prompt.returnPressed.emit()
        qtbot.waitUntil(lambda: "picks engine 1" in window.view.router.text(), timeout=10_000)
        text = window.view.router.text()
        assert "engine 0: 67% (2/3 blocks)" in text and "engine 1: 100% (3/3 blocks)" in text
        window.route_prompt("hello there")  # text: tokenized off the UI thread
        qtbot.waitUntil(lambda: "prompt of 6 tokens" in window.view.router.text(), timeout=10_000)
        assert "picks engine 0" in window.view.router.text()
    finally:
        window.close()
        for p in pubs:
            p.close()
