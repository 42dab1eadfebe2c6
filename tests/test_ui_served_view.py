"""The served-traffic table shows each client's hit rate and where its prompts differ."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from ui.served_view import ServedView  # noqa: E402

REPORT = {"clients": [
    {"client": "http 127.0.0.1 model=gpt-4o user=bob", "requests": 5, "hits": 4, "prompt_tokens": 800,
     "prefill_tokens_saved": 512, "prefill_tokens_computed": 288, "hit_rate": 0.64, "cold_misses": 1,
     "miss_positions": [{"position": 21, "context": "11-30T22:4", "prompt_token": "2", "cached_token": "1",
                         "count": 3}]},
    {"client": "http 10.0.0.2 model=x user=-", "requests": 1, "hits": 0, "prompt_tokens": 40,
     "prefill_tokens_saved": 0, "prefill_tokens_computed": 40, "hit_rate": 0.0, "cold_misses": 1,
     "miss_positions": []},
]}


def test_one_row_per_client_with_its_most_common_miss(qtbot):
    view = ServedView()
    qtbot.addWidget(view)
    view.set_report(REPORT)
    assert view.rowCount() == 2
    row = [view.item(0, c).text() for c in range(view.columnCount())]
    assert row[:4] == ["http 127.0.0.1 model=gpt-4o user=bob", "5", "64%", "512"]
    assert row[4] == "@21 x3: …11-30T22:4 [2 | 1]"
    assert view.item(1, 4).text() == "1 cold"
    view.set_report({"clients": []})
    assert view.rowCount() == 0
