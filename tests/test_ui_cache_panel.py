"""CachePanel, PageMap, ChainsTable and ProbeView on real snapshots of a scheduler run."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import copy  # noqa: E402
import html  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import QEvent, QPoint, QPointF, Qt  # noqa: E402
from PySide6.QtGui import QHelpEvent, QMouseEvent, QWheelEvent  # noqa: E402
from PySide6.QtWidgets import QApplication, QToolTip, QWidget  # noqa: E402

from engine.api import prefix_probe  # noqa: E402
from engine.chat import chat_prompt, turn_messages  # noqa: E402
from engine.metrics import PAGE_CACHED, PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED  # noqa: E402
from engine.snapshot import PageInfo  # noqa: E402
from ui.cache_panel import CachePanel  # noqa: E402
from ui.chains_table import COL_HITS, ChainsTable, humanize_seconds  # noqa: E402
from ui.page_map import PageMap, fit_grid  # noqa: E402
from ui.probe_view import REASONS  # noqa: E402

NAMES = {PAGE_FREE: "free", PAGE_PRIVATE: "private", PAGE_SHARED: "shared", PAGE_CACHED: "cached"}


PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(engine_run):
    return engine_run


@pytest.fixture(scope="module")
def busy(run):
    """The snapshot with the most kinds of pages (private, shared and cached at once, if any)."""
    return max(run.snapshots, key=lambda s: (len(set(s.page_states.tolist())), len(s.pages)))


@pytest.fixture
def panel(qtbot):
    w = CachePanel()
    qtbot.addWidget(w)
    w.resize(760, 820)
    return w


def chain_pages(snap, chain_id):
    return sorted(p for p, info in snap.pages.items() if info.chain_id == chain_id)


def test_counts_match_bincount_and_pool(run, panel):
    for snap in run.snapshots:
        panel.update_snapshot(snap)
        counts = panel.page_map.counts_by_state()
        bins = np.bincount(snap.page_states, minlength=4)
        assert counts == {NAMES[s]: int(bins[s]) for s in NAMES}
        row = snap.timeline[-1]  # the scheduler's own count at the end of the same step
        assert counts == {"free": row.pages_free, "private": row.pages_private,
                          "shared": row.pages_shared, "cached": row.pages_cached}
        assert sum(counts.values()) == row.capacity == panel.page_map.page_count
    pool = run.scheduler.pool
    assert counts["free"] == pool.num_free_pages
    assert counts["private"] + counts["shared"] + counts["cached"] == pool.num_used_pages


def test_busy_snapshot_has_shared_pages(busy):
    states = set(busy.page_states.tolist())
    assert PAGE_SHARED in states and PAGE_PRIVATE in states


def test_tooltips_show_page_text_escaped(busy, qtbot):
    pm = PageMap()
    qtbot.addWidget(pm)
    pm.set_snapshot(busy)
    for page, info in busy.pages.items():
        tip = pm.tooltip_for(page)
        assert html.escape(info.text) in tip
        assert f"page {page}" in tip and str(info.refcount) in tip
        for owner in info.owners:
            assert f"#{owner}" in tip
        if info.chain_id is not None:
            assert f"#{info.chain_id}" in tip
        assert "<|im_start|>" not in tip  # special tokens are text, not markup
    # The real tooltip path: a help event over a cell shows that page's tooltip.
    pm.resize(500, 300)
    pm.show()
    qtbot.waitExposed(pm)
    page = next(iter(busy.pages))
    pos = pm.cell_rect(page).center()
    QApplication.sendEvent(pm, QHelpEvent(QEvent.Type.ToolTip, pos, pm.mapToGlobal(pos)))
    assert QToolTip.text() == pm.tooltip_for(page)
    free = int(np.flatnonzero(busy.page_states == PAGE_FREE)[0])
    assert "free" in pm.tooltip_for(free)
    evil = copy.deepcopy(busy)
    evil.pages[0] = PageInfo(0, 1, PAGE_PRIVATE, None, [7], 0, "<script>alert('x')</script> & <b>")
    pm.set_snapshot(evil)
    tip = pm.tooltip_for(0)
    assert "<script>" not in tip and "<b>" not in tip.split("</b>", 1)[1]
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &lt;b&gt;" in tip


def test_cell_geometry_round_trips(busy, qtbot):
    pm = PageMap()
    qtbot.addWidget(pm)
    pm.resize(500, 300)
    pm.set_snapshot(busy)
    for page in range(pm.page_count):
        r = pm.cell_rect(page)
        assert pm.page_at(r.center()) == page
        assert pm.rect().contains(r)
    assert pm.page_at(pm.rect().topLeft()) is None  # the legend strip


def test_selecting_a_chain_highlights_exactly_its_pages(busy, run, panel, qtbot):
    final = run.snapshots[-1]
    for snap in (busy, final):
        panel.update_snapshot(snap)
        assert snap.chains
        for chain in snap.chains:
            with qtbot.waitSignal(panel.chains_table.chain_selected) as sig:
                assert panel.chains_table.select_chain(chain.id)
            assert sig.args == [chain.id]
            assert panel.page_map.highlighted_pages() == chain_pages(snap, chain.id)
            assert len(panel.page_map.highlighted_pages()) == chain.pages_live
    with qtbot.waitSignal(panel.chains_table.chain_selected) as sig:
        panel.chains_table.select_chain(None)
    assert sig.args == [None] and panel.page_map.highlighted_pages() == []


def test_mouse_selection_and_page_click(run, panel, qtbot):
    snap = run.snapshots[-1]
    panel.show()
    qtbot.waitExposed(panel)
    panel.update_snapshot(snap)
    table = panel.chains_table
    row_rect = table.visualRect(table.model().index(1, 1))
    chain_id = table.visible_chain_order()[1]
    with qtbot.waitSignal(table.chain_selected) as sig:
        qtbot.mouseClick(table.viewport(), Qt.MouseButton.LeftButton, pos=row_rect.center())
    assert sig.args == [chain_id]
    assert panel.page_map.highlighted_pages() == chain_pages(snap, chain_id)
    # Clicking a cached page in the map selects its chain in the table.
    other = next(c.id for c in snap.chains if c.id != chain_id)
    page = chain_pages(snap, other)[0]
    qtbot.mouseClick(panel.page_map, Qt.MouseButton.LeftButton, pos=panel.page_map.cell_rect(page).center())
    assert table.selected_chain() == other
    assert panel.page_map.highlighted_chain() == other


def test_sort_by_hits_and_selection_survives_updates(run, qtbot):
    chains = [copy.copy(c) for c in run.snapshots[-1].chains]
    assert len(chains) >= 3
    table = ChainsTable()
    qtbot.addWidget(table)
    table.set_chains(chains)
    table.sortByColumn(COL_HITS, Qt.SortOrder.DescendingOrder)
    by_hits = [c.id for c in sorted(chains, key=lambda c: (-c.hits, c.id))]
    assert [table.chains_model.chain_at(table.proxy.mapToSource(table.proxy.index(r, 0)).row()).hits
            for r in range(len(chains))] == [c.hits for c in sorted(chains, key=lambda c: -c.hits)]
    assert set(table.visible_chain_order()) == set(by_hits)
    pick = min(chains, key=lambda c: c.hits).id  # the bottom row
    table.select_chain(pick)
    emitted = []
    table.chain_selected.connect(emitted.append)
    # Next snapshot: the picked chain gets many hits (moves to the top), another chain is evicted
    # and a new one appears.
    gone = next(c.id for c in chains if c.id != pick)
    updated = [copy.copy(c) for c in chains if c.id != gone]
    for c in updated:
        if c.id == pick:
            c.hits, c.last_hit_at = 99, time.time()
    new = copy.copy(chains[0])
    new.id, new.hits, new.preview = 1000, 5, "a <new> chain"
    table.set_chains(updated + [new])
    assert table.selected_chain() == pick
    assert table.visible_chain_order()[0] == pick  # still sorted by hits, descending
    hits = [table.chains_model.chain_at(table.proxy.mapToSource(table.proxy.index(r, 0)).row()).hits
            for r in range(table.proxy.rowCount())]
    assert hits == sorted(hits, reverse=True)
    assert gone not in table.visible_chain_order() and 1000 in table.visible_chain_order()
    assert emitted == []  # the selection never flickered through None
    assert table.horizontalHeader().sortIndicatorSection() == COL_HITS
    # The selected chain is evicted: the selection clears and says so.
    table.set_chains([c for c in updated if c.id != pick])
    assert table.selected_chain() is None and emitted == [None]


def test_chain_columns_are_humanised(run, qtbot):
    chain = copy.copy(run.snapshots[-1].chains[0])
    chain.created_at, chain.last_hit_at = 1000.0, 1000.0 + 3600 + 125
    table = ChainsTable()
    qtbot.addWidget(table)
    table.set_chains([chain], now=1000.0 + 2 * 3600 + 30)
    m = table.chains_model
    assert m.data(m.index(0, 5)) == "2 h 0 min"
    assert m.data(m.index(0, 6)) == "58 min 25 s"
    assert humanize_seconds(4) == "4 s" and humanize_seconds(120) == "2 min"


@pytest.mark.parametrize("reason", sorted(REASONS))
def test_probe_view_escapes_every_reason(reason, panel):
    info = {"matched_tokens": 32, "matched_pages": 2, "n_prompt": 52, "stop_reason": reason,
            "first_diff_index": 37, "chain_id": 2, "context_before": "<|im_start|>user\nA & B <i>",
            "prompt_token": "<script>", "cached_token": " </table>"}
    panel.show_probe(info)
    text = panel.probe_view.html()
    assert REASONS[reason][1] in text
    assert "<script>" not in text and "</table> " not in text and "<i>" not in text
    assert "&lt;script&gt;" in text and "&lt;|im_start|&gt;" in text and "A &amp; B &lt;i&gt;" in text
    plain = panel.probe_view.plain_text()
    assert "32 of 52 prompt tokens" in plain and "2 pages" in plain and "37" in plain
    assert "<script>" in plain  # the reader sees the token itself


def test_probe_view_without_a_difference(panel):
    panel.show_probe({"matched_tokens": 48, "matched_pages": 3, "n_prompt": 49, "stop_reason": "cap",
                      "first_diff_index": None, "chain_id": None, "context_before": "",
                      "prompt_token": None, "cached_token": None})
    plain = panel.probe_view.plain_text()
    assert "48 of 49" in plain and "No differing token" in plain and "at least one token" in plain


def test_probe_of_a_real_prompt(run, panel):
    sched = run.scheduler
    tok = sched.model.tokenizer
    prompt = chat_prompt(tok, turn_messages(run.system.replace("small", "big"), "Hi"))
    res = prefix_probe(sched.cache, prompt)
    assert res.stop_reason == "miss" and res.first_diff_index is not None
    i = res.first_diff_index
    page = sched.cache.pages[next(iter(sched.cache.roots[""]))]
    info = {"matched_tokens": res.matched_tokens, "matched_pages": res.matched_pages, "n_prompt": len(prompt),
            "stop_reason": res.stop_reason, "first_diff_index": i, "chain_id": res.nearest_chain_id,
            "context_before": tok.decode(prompt[max(0, i - 8):i]), "prompt_token": tok.decode([prompt[i]]),
            "cached_token": tok.decode([page.tokens[i]])}
    panel.update_snapshot(run.snapshots[-1])
    with_signal = []
    panel.probe_requested.connect(lambda: with_signal.append(True))
    panel.probe_button.click()
    assert with_signal == [True]
    panel.show_probe(info)
    plain = panel.probe_view.plain_text()
    assert "no cached page starts like this" in plain
    assert info["prompt_token"].replace(" ", "·") in plain and info["cached_token"].replace(" ", "·") in plain
    assert panel.chains_table.selected_chain() == res.nearest_chain_id


def test_render_image_offscreen(busy, panel):
    panel.update_snapshot(busy)
    png = panel.page_map.render_image(640, 260)
    assert png.startswith(PNG)
    from PySide6.QtGui import QImage
    img = QImage.fromData(png, "PNG")
    assert (img.width(), img.height()) == (640, 260)
    assert PageMap().render_image(200, 100).startswith(PNG)  # empty map too


def test_ten_thousand_pages_paint_fast(qtbot):
    rng = np.random.default_rng(0)
    states = rng.integers(0, 4, size=10_000).astype(np.int8)
    pm = PageMap()
    qtbot.addWidget(pm)
    pm.resize(900, 600)
    pm.set_pages(states, rng.integers(0, 3, size=10_000), {}, 16)
    t0 = time.perf_counter()
    pm.grab()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(5):
        pm.update()
        pm.repaint()
    again = (time.perf_counter() - t0) / 5
    assert first < 0.5 and again < 0.1, (first, again)
    assert pm.findChildren(QWidget) == []  # no widget per cell
    assert pm.counts_by_state() == {NAMES[s]: int(np.sum(states == s)) for s in NAMES}
    geo = fit_grid(10_000, 900 - 12, 600 - 12 - 24)
    assert geo.cols * geo.rows >= 10_000 and geo.rows * geo.pitch - geo.gap <= 600
    assert pm.render_image(1200, 800).startswith(PNG)


def test_the_shown_panel_paints_every_page_in_its_states_colour(busy, panel, qtbot):
    from ui.colors import state_color, theme_for
    panel.update_snapshot(busy)
    panel.show()
    qtbot.waitExposed(panel)
    pm = panel.page_map
    image = pm.grab().toImage()  # what the user sees, not the map's own records
    theme = theme_for(pm)
    seen = set()
    for page in range(pm.page_count):
        r = pm.cell_rect(page)
        state = int(busy.page_states[page])
        # a cell's corner: its centre may carry the page's reference count
        assert image.pixelColor(r.left() + 1, r.top() + 1) == state_color(state, theme), (page, state)
        seen.add(state)
    assert len(seen) >= 2


def test_a_panel_on_a_hidden_tab_updates_once_shown(run, busy, qtbot):
    """Snapshots arriving while another tab is shown wait; showing the tab draws the latest."""
    from PySide6.QtWidgets import QLabel, QTabWidget
    tabs = QTabWidget()
    qtbot.addWidget(tabs)
    panel = CachePanel()
    tabs.addTab(QLabel("charts"), "Charts")
    tabs.addTab(panel, "Cache")
    tabs.resize(900, 700)
    tabs.show()
    qtbot.waitExposed(tabs)
    panel.update_snapshot(run.snapshots[0])
    panel.update_snapshot(busy)
    assert panel.page_map.page_count == 0  # nothing drawn: the user cannot see this tab
    tabs.setCurrentWidget(panel)
    qtbot.waitUntil(lambda: panel.page_map.page_count == len(busy.page_states), timeout=2000)
    bins = np.bincount(busy.page_states, minlength=4)
    assert panel.page_map.counts_by_state() == {NAMES[s]: int(bins[s]) for s in NAMES}
    assert panel.chains_table.model().rowCount() == len(busy.chains)


def test_pin_box_asks_the_engine_to_pin_and_shows_pinned_chains(run, panel, qtbot):
    from ui.chains_table import COL_PIN
    snap = run.snapshots[-1]
    panel.update_snapshot(snap)
    table = panel.chains_table
    chain_id = table.visible_chain_order()[0]
    index = table.model().index(0, COL_PIN)
    assert table.model().data(index, Qt.ItemDataRole.CheckStateRole) == Qt.CheckState.Unchecked
    with qtbot.waitSignal(panel.pin_requested) as sig:
        table.model().setData(index, Qt.CheckState.Checked.value, Qt.ItemDataRole.CheckStateRole)
    assert sig.args == [chain_id, True]
    # the engine's next snapshot says the chain is pinned: the box shows it
    chains = [copy.copy(c) for c in snap.chains]
    for c in chains:
        c.pinned = c.id == chain_id
    table.set_chains(chains)
    row = table.visible_chain_order().index(chain_id)
    assert table.model().data(table.model().index(row, COL_PIN),
                              Qt.ItemDataRole.CheckStateRole) == Qt.CheckState.Checked


def test_summary_names_the_page_dtype_and_bytes(run, panel):
    snap = run.snapshots[-1]
    panel.update_snapshot(snap)
    text = panel.summary.text()
    assert snap.kv_dtype == "float32" and "float32" in text
    assert f"{snap.bytes_per_page / 1024:,.0f} KiB each" in text


def default_pool_pages() -> int:
    """The pool the app and serve start with: the default KV budget of this machine's RAM, in
    SmolLM2's 16-position float32 pages (~3,400 on 24 GB)."""
    from types import SimpleNamespace

    from app.serve.budget import DEFAULT_KV_BUDGET, budget_pages, parse_budget
    smollm2 = SimpleNamespace(config=SimpleNamespace(n_layers=30, n_kv_heads=3, head_dim=64))
    return budget_pages(parse_budget(DEFAULT_KV_BUDGET), smollm2, 16)


def test_page_map_of_the_default_pool_draws_pages_in_use_at_a_readable_size(qtbot):
    """W8 under the default budget uses ~18 of ~3,400 pages: those are cells a person can point at,
    and the free rest is a line of text, not 3,400 dots."""
    n = max(default_pool_pages(), 3000)
    states = np.zeros(n, dtype=np.int8)
    states[:12], states[12:16], states[16:18] = PAGE_PRIVATE, PAGE_SHARED, PAGE_CACHED
    pm = PageMap()
    qtbot.addWidget(pm)
    pm.resize(640, 300)  # the Cache tab's map at 1280x800
    pm.set_pages(states, (states > 0).astype(np.int64))
    pm.show()
    qtbot.waitExposed(pm)
    for page in range(18):
        r = pm.cell_rect(page)
        assert r.width() >= 8 and r.height() >= 8 and pm.rect().contains(r), (page, r)
        assert pm.page_at(r.center()) == page
    pos = pm.cell_rect(13).center()  # hovering a shared page shows its tooltip
    QApplication.sendEvent(pm, QHelpEvent(QEvent.Type.ToolTip, pos, pm.mapToGlobal(pos)))
    assert QToolTip.text() == pm.tooltip_for(13) and "shared" in QToolTip.text()
    shown = pm.shown_pages()
    assert shown.start == 0 and 18 <= len(shown) < n
    assert f"{n - len(shown):,} free pages" in pm.summary() and f"of {n:,}" in pm.summary()
    assert pm.cell_rect(n - 1).isEmpty()  # not drawn: summed up instead
    # the wheel pans to the rest, a page in use far away is counted until it is drawn
    states[n - 1] = PAGE_PRIVATE
    pm.set_pages(states)
    assert "and 1 in use" in pm.summary()
    for _ in range(200):
        pm.wheelEvent(QWheelEvent(QPointF(10, 40), QPointF(pm.mapToGlobal(QPoint(10, 40))), QPoint(0, 0),
                                  QPoint(0, -120), Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                                  Qt.ScrollPhase.NoScrollPhase, False))
    assert n - 1 in pm.shown_pages() and pm.cell_rect(n - 1).width() >= 8
    pm.mouseDoubleClickEvent(QMouseEvent(QEvent.Type.MouseButtonDblClick, QPointF(10, 40),
                                         QPointF(pm.mapToGlobal(QPoint(10, 40))), Qt.MouseButton.LeftButton,
                                         Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier))
    assert pm.shown_pages().start == 0  # fit: back to the region in use


def test_small_pool_still_shows_every_page(qtbot):
    pm = PageMap()
    qtbot.addWidget(pm)
    pm.resize(640, 300)
    pm.set_pages(np.zeros(64, dtype=np.int8))  # the tour's pool
    assert pm.shown_pages() == range(64) and pm.summary() == ""
