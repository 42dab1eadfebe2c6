"""The desktop app starts with a KV memory budget that fits the machine, and shows it (issue 21):
the same default share of RAM as `prefixlab serve`, explicit pool pages in Settings win."""

from __future__ import annotations

import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from app.desktop.settings import AppSettings  # noqa: E402
from app.serve.budget import DEFAULT_KV_BUDGET  # noqa: E402
from engine.chat import CLOSING_SLACK  # noqa: E402
from tests.gui_helpers import set_settings  # noqa: E402
from ui.format import format_bytes  # noqa: E402


def _page_bytes(model, page_rows: int) -> int:
    """K and V of `page_rows` positions in every layer, float32 (written out here, not imported)."""
    c = model.config
    return 2 * c.n_layers * page_rows * c.n_kv_heads * c.head_dim * 4


def _default_pages(model, page_rows: int) -> int:
    """Pages of 10% of this machine's RAM (at least one full-context request's)."""
    assert DEFAULT_KV_BUDGET == "10%"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    one_request = -(-(model.config.context_length + CLOSING_SLACK) // page_rows) + 1
    return max(ram // 10 // _page_bytes(model, page_rows), one_request)


def test_app_settings_bound_the_pool_for_a_model_unless_set(tiny_model):
    rows = AppSettings().page_rows
    s = AppSettings().scheduler_settings(tiny_model)
    assert s.pool_pages == s.cache_pages == _default_pages(tiny_model, rows)
    assert AppSettings(pool_pages=77).scheduler_settings(tiny_model).pool_pages == 77
    own_cache = AppSettings(cache_pages=5).scheduler_settings(tiny_model)  # a cache budget within the pool
    assert (own_cache.pool_pages, own_cache.cache_pages) == (s.pool_pages, 5)
    f16 = AppSettings(kv_dtype="float16").scheduler_settings(tiny_model)
    assert f16.pool_pages in (2 * s.pool_pages, 2 * s.pool_pages + 1)  # half the bytes per page
    assert AppSettings().scheduler_settings().pool_pages is None  # no model: nothing to size


def test_the_window_starts_bounded_and_shows_the_budget(window, qtbot, real_model, tmp_path):
    d = window
    w, c = d.window, d.controller
    sched = c.driver.engine.scheduler
    rows = c.settings.page_rows
    pages = _default_pages(real_model, rows)
    assert c.settings.pool_pages == c.settings.cache_pages == 0  # nothing set by hand
    assert sched.settings.pool_pages == sched.settings.cache_pages == pages
    assert sched.pool.capacity == pages
    budget = pages * _page_bytes(real_model, rows)
    chip = w.model_bar.chips["budget"]
    w.resize(1600, 900)  # chips give way to the model's name in a narrow window; this one fits them
    qtbot.waitUntil(lambda: chip.isVisible(), timeout=10_000)
    assert chip.text() == f"KV ≤ {format_bytes(budget)}"
    line = f"KV budget {budget / 2**30:.2f} GiB (10% of RAM): {pages:,} pages"
    assert line in chip.toolTip() and line in w.pool_label.toolTip()

    # A setting that needs no new pool keeps this one (and its cache): the budget is the same.
    set_settings(d, max_streams=3)
    qtbot.waitUntil(lambda: c.driver.engine.scheduler.settings.max_streams == 3, timeout=10_000)
    assert c.driver.engine.scheduler is sched

    # The session report lists the budget beside the pool's pages.
    path = tmp_path / "session.json"
    c.export_report(str(path), "")
    qtbot.waitUntil(lambda: bool(c.last_report_paths or c.last_error), timeout=60_000)
    assert c.last_error is None, c.last_error
    settings = json.loads(path.read_text("utf-8"))["settings"]
    assert settings["kv_budget"] == line and settings["pool_pages"] == pages


def test_explicit_pool_pages_win_and_zero_goes_back_to_the_budget(window, qtbot, real_model):
    d = window
    w, c = d.window, d.controller
    engine, chip = c.driver.engine, w.model_bar.chips["budget"]
    pages = _default_pages(real_model, c.settings.page_rows)
    set_settings(d, pool_pages=600, cache_pages=200)
    qtbot.waitUntil(lambda: engine.scheduler.settings.pool_pages == 600, timeout=10_000)
    assert engine.scheduler.settings.cache_pages == 200 and engine.scheduler.pool.capacity == 600
    qtbot.waitUntil(lambda: "(Settings): 600 pages" in chip.toolTip(), timeout=10_000)
    assert chip.text() == f"KV ≤ {format_bytes(600 * _page_bytes(real_model, c.settings.page_rows))}"

    set_settings(d, pool_pages=0, cache_pages=0)
    qtbot.waitUntil(lambda: engine.scheduler.settings.pool_pages == pages, timeout=10_000)
    assert engine.scheduler.settings.cache_pages == pages
    qtbot.waitUntil(lambda: f"(10% of RAM): {pages:,} pages" in chip.toolTip(), timeout=10_000)

    # A cache budget alone stays within the budget's pool: a live change, the pool (and cache) kept.
    sched = engine.scheduler
    set_settings(d, cache_pages=100)
    qtbot.waitUntil(lambda: sched.cache.max_pages == 100, timeout=10_000)
    assert engine.scheduler is sched and sched.settings.pool_pages == pages
    qtbot.waitUntil(lambda: "the cache at most 100" in chip.toolTip(), timeout=10_000)
