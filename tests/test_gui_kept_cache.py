"""The app's pool settings for issue 24 (KV dtype, disk tier) and "Keep the cache across restarts":
the desktop engine on the tiny GGUF, the Settings dialog offscreen."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtWidgets import QComboBox  # noqa: E402

from app import settings_table  # noqa: E402
from app.cache_persist import FILE_NAME  # noqa: E402
from app.desktop.cache_keeper import cache_dir  # noqa: E402
from app.desktop.desktop_engine import DesktopEngine  # noqa: E402
from app.desktop.settings import AppSettings  # noqa: E402
from tests.test_cache_persist import layout  # noqa: E402
from tests.test_desktop_engine import QUESTIONS, job, recorded, run  # noqa: E402
from ui.settings_dialog import SettingsDialog  # noqa: E402


def _engine(path: str, root: str, **settings) -> DesktopEngine:
    w = recorded()
    w.set_cache_root(root)
    w.apply_settings(AppSettings(page_rows=4, max_streams=2, chunk_tokens=32, **settings).to_dict())
    w.load_model(path)
    assert w.rec.model_loaded and not w.rec.failed, w.rec.failed
    return w


def test_kv_dtype_and_disk_tier_are_pool_settings_applied_by_a_new_scheduler(tiny_gguf_path, tmp_path):
    w = _engine(tiny_gguf_path, str(tmp_path))
    first = w.scheduler
    assert first.pool.kv_dtype == "float32" and first.cache.tier is None
    w.apply_settings(AppSettings(page_rows=4, max_streams=2, chunk_tokens=32, kv_dtype="float16",
                                 disk_tier_pages=8).to_dict())
    s = w.scheduler
    assert s is not first and not w.rec.failed, w.rec.failed
    assert s.pool.kv_dtype == "float16" and s.pool.bytes_per_page * 2 == first.pool.bytes_per_page
    assert s.cache.tier.capacity == 8
    assert w.rec.snapshots[-1].kv_dtype == "float16" and w.rec.snapshots[-1].disk_capacity == 8
    bad = AppSettings(kv_dtype="bfloat16").errors()
    assert bad == ["KV page dtype must be one of float32, float16, got 'bfloat16'"]


def test_the_dialog_offers_the_dtype_as_a_choice(qtbot):
    values = AppSettings(kv_dtype="float16", disk_tier_pages=5, keep_cache=True).to_dict()
    dlg = SettingsDialog(values, settings_table.rows(), lambda v: AppSettings.from_dict(v).errors())
    qtbot.addWidget(dlg)
    assert isinstance(dlg.kv_dtype, QComboBox) and dlg.kv_dtype.count() == 2
    got = dlg.values()
    assert (got["kv_dtype"], got["disk_tier_pages"], got["keep_cache"]) == ("float16", 5, True)
    dlg.kv_dtype.setCurrentIndex(dlg.kv_dtype.findData("float32"))
    assert dlg.values()["kv_dtype"] == "float32"
    assert dlg.disk_tier_pages.specialValueText() == "0 (off)"


def test_a_kept_cache_survives_a_restart_and_a_damaged_page_is_one_line(tiny_gguf_path, tmp_path):
    root = str(tmp_path / "kv-cache")
    w = _engine(tiny_gguf_path, root, keep_cache=True)
    w.submit(job("a", QUESTIONS[0]))
    run(w)
    cold = w.rec.request_finished[-1]
    assert cold.n_cached == 0
    pages = len(w.scheduler.cache.pages)
    w.save_cache()  # Run -> Save the cache now (the window's test below quits, which saves too)
    assert w.rec.notes[-1].endswith(f"saved {pages} page(s)"), w.rec.notes
    path = os.path.join(cache_dir(root, w.scheduler), FILE_NAME)
    assert os.path.exists(path)

    again = _engine(tiny_gguf_path, root, keep_cache=True)  # "after a restart"
    assert again.rec.notes and again.rec.notes[-1].endswith(f"loaded {pages} page(s)"), again.rec.notes
    again.submit(job("b", QUESTIONS[0]))
    run(again)
    hit = again.rec.request_finished[-1]
    assert hit.n_cached > 0 and hit.text == cold.text  # the first question after the restart hits

    data = bytearray(open(path, "rb").read())
    saved, _, start, page_bytes = layout(data)
    at = len(saved) // 2                               # a page in the middle of the question's chain
    data[start + at * page_bytes + 5] ^= 0xFF          # one flipped byte in its K/V
    depth = saved[at][4]                               # the pages above it, served
    open(path, "wb").write(bytes(data))
    # issue 45 changed this on purpose: the damaged page is skipped, not the whole file
    damaged = _engine(tiny_gguf_path, root, keep_cache=True)
    assert damaged.rec.notes == [f"Cache {path}: loaded {depth} page(s); 1 damaged page(s) (failing their "
                             "CRC-32) skipped with the pages after them: prompts that need them recompute"]
    assert not damaged.rec.failed and len(damaged.scheduler.cache.pages) == depth
    assert os.path.exists(path)  # kept: the next save rewrites it whole
    damaged.submit(job("c", QUESTIONS[0]))
    run(damaged)
    c = damaged.rec.request_finished[-1]
    assert c.n_cached == depth * 4 < hit.n_cached and c.text == cold.text

    off = _engine(tiny_gguf_path, root)  # not kept: nothing loaded, nothing said
    assert off.rec.notes == [] and not off.scheduler.cache.pages


def test_the_window_keeps_the_cache_across_a_restart(open_desktop, qtbot, tiny_gguf_path):
    """Settings keeps the cache; Run -> Save the cache now says so; quitting saves; the next
    start loads it before the first request and says so in the status bar."""
    from tests.gui_helpers import LOAD_TIMEOUT_MS, RUN_TIMEOUT_MS, set_settings
    system, question = "You are a terse hardware store assistant.", [("a", "Do you sell hammers?")]

    def start():
        d = open_desktop(autoload=True, model_path=tiny_gguf_path)
        d.window.show()
        qtbot.waitUntil(lambda: d.controller.model_info is not None, timeout=LOAD_TIMEOUT_MS)
        return d

    d = start()
    set_settings(d, page_rows=4, max_new_tokens=4, keep_cache=True)
    eng = d.controller.driver.engine
    qtbot.waitUntil(lambda: eng.scheduler.pool.page_rows == 4, timeout=10_000)  # the new pool
    d.controller.run_all(system, question)
    # the turn's closing tokens run a step after its finish and donate pages: wait for them too
    qtbot.waitUntil(lambda: len(d.controller.finished_records) == 1 and not d.controller.running
                    and not eng.busy, timeout=RUN_TIMEOUT_MS)
    assert d.controller.finished_records[0].n_cached == 0
    status = d.window.statusBar()
    d.window.act_save_cache.trigger()
    qtbot.waitUntil(lambda: "saved" in status.currentMessage(), timeout=10_000)
    first_save = len(eng.scheduler.cache.pages)
    assert status.currentMessage().endswith(f"saved {first_save} page(s)")
    d.controller.run_all(system, [("b", "Where are the nails?")])  # cached after the save above
    qtbot.waitUntil(lambda: len(d.controller.finished_records) == 2 and not d.controller.running,
                    timeout=RUN_TIMEOUT_MS)
    saved = len(eng.scheduler.cache.pages)
    d.window.close()  # the quit saves too

    again = start()
    assert again.controller.settings.keep_cache
    bar = again.window.statusBar()
    qtbot.waitUntil(lambda: "loaded" in bar.currentMessage(), timeout=10_000)
    loaded = int(bar.currentMessage().rsplit("loaded ", 1)[1].split()[0])
    assert loaded >= saved > first_save  # what the quit wrote, not only the first save
    again.controller.run_all(system, question)
    qtbot.waitUntil(lambda: len(again.controller.finished_records) == 1 and not again.controller.running,
                    timeout=RUN_TIMEOUT_MS)
    assert again.controller.finished_records[0].n_cached > 0


def test_a_new_pool_waits_for_a_job_typed_just_before_it(tiny_gguf_path, tmp_path):
    # The window queues the settings, then Run puts the job straight into the loop's inbox: the
    # engine sees the settings with the job not yet drained. It must run, not be refused.
    w = _engine(tiny_gguf_path, str(tmp_path))
    first = w.scheduler
    w.submit(job("a", QUESTIONS[0]))
    w.apply_settings(AppSettings(page_rows=4, max_streams=2, chunk_tokens=32, kv_dtype="float16").to_dict())
    assert w.scheduler is first
    run(w)
    assert not w.rec.request_refused and w.rec.request_finished[-1].finish_reason in ("stop", "length")
    assert w.scheduler is not first and w.scheduler.pool.kv_dtype == "float16"


def test_the_model_bar_names_the_pages_dtype_and_size(open_desktop, qtbot, tiny_gguf_path):
    """The model bar shows the KV pages' dtype and bytes per page, and follows a change to float16."""
    from tests.gui_helpers import LOAD_TIMEOUT_MS, set_settings
    d = open_desktop(autoload=True, model_path=tiny_gguf_path)
    d.window.show()
    qtbot.waitUntil(lambda: d.controller.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    chip, eng = d.window.model_bar.chips["kv"], d.controller.driver.engine

    def shows(dtype: str) -> bool:
        pool = eng.scheduler.pool
        kib = pool.bytes_per_page / 1024
        return pool.kv_dtype == dtype and chip.text() == f"KV {dtype} · {kib:,.0f} KiB/page"

    qtbot.waitUntil(lambda: shows("float32"), timeout=10_000)
    set_settings(d, kv_dtype="float16")
    qtbot.waitUntil(lambda: shows("float16"), timeout=10_000)
    assert chip.isVisible()
