"""Where the prompt tokens went, in the window's widgets: a card's thin bar and its tooltip, the
Requests table's columns and "diverged at" in words, and the chart that stacks the session's
totals by part (docs/design.md §15). Plain records in, no model."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from engine.metrics import RequestRecord  # noqa: E402
from engine.token_parts import TokenParts  # noqa: E402
from ui.charts import ChartsPanel  # noqa: E402
from ui.parts_bar import PartsBar, segments  # noqa: E402
from ui.requests_table import COLUMNS, RequestsTable  # noqa: E402


def record(rid: int, **parts) -> RequestRecord:
    p = TokenParts(**parts)
    r = RequestRecord(rid, f"prompt {rid}", None, "", p.total, n_cached=p.cached, ttft_s=0.1)
    r.parts, r.diverged_at, r.diverged_words = p, p.cached + p.rounding, " the weekend"
    return r


def test_segments_split_disk_out_of_cached_and_drop_empty_parts():
    parts = {"cached": 64, "disk": 16, "lent": 0, "rounding": 5, "cap": 0, "evicted": 0, "isolated": 0,
             "new": 11}
    assert segments(parts) == [("disk", 16), ("cached", 48), ("rounding", 5), ("new", 11)]
    assert segments(None) == [] and segments({}) == []


def test_a_cards_bar_shows_the_parts_and_its_tooltip_says_where_it_departed(qtbot):
    bar = PartsBar()
    qtbot.addWidget(bar)
    r = record(2, cached=64, rounding=5, cap=0, new=11)
    bar.set_parts(r.parts.as_dict(), r.diverged_at, r.diverged_words)
    assert bar.shown() == {"cached": 64, "rounding": 5, "new": 11}
    tip = bar.toolTip()
    assert "Where the 80 prompt tokens went" in tip and "rounding" in tip and "the weekend" in tip
    assert "token 69" in tip
    bar.set_parts(None)
    assert not bar.isVisibleTo(bar.parentWidget() or bar) and bar.shown() == {}


def test_the_requests_table_has_every_part_and_where_it_diverged(qtbot):
    t = RequestsTable()
    qtbot.addWidget(t)
    t.add_record(record(1, new=80))
    t.add_record(record(2, cached=64, disk=16, rounding=5, new=11))
    cell = {name: t.item(1, COLUMNS.index(name)).text() for name in COLUMNS}
    assert (cell["Cached"], cell["Disk"], cell["Rounding"], cell["New"], cell["Evicted"]) == \
        ("64", "16", "5", "11", "0")
    assert cell["Diverged at"] == "69: ' the weekend'"
    assert t.item(0, COLUMNS.index("New")).text() == "80"
    assert "Where the 80 prompt tokens went" in t.item(1, COLUMNS.index("Cached")).toolTip()


def test_the_chart_stacks_the_sessions_totals_by_part(qtbot):
    panel = ChartsPanel()
    qtbot.addWidget(panel)
    records = [record(1, new=80), record(2, cached=64, disk=16, rounding=5, new=11),
               record(3, cached=48, cap=15, evicted=16, isolated=16)]
    panel.set_data([], records)
    totals = panel.part_totals()
    assert totals == {"disk": 16, "cached": 96, "lent": 0, "cap": 15, "rounding": 5, "evicted": 16,
                      "isolated": 16, "new": 91}
    assert sum(totals.values()) == sum(r.n_prompt for r in records)
    ids, cumulative = panel.series("part_new")
    assert list(ids) == [1, 2, 3] and list(cumulative) == [80, 91, 91]
