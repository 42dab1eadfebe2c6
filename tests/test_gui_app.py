"""The real window on the bundled model: run all, cache hits, stop, close mid-run, broken drops."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QKeySequence  # noqa: E402
from PySide6.QtWidgets import QAbstractButton  # noqa: E402

from engine.metrics import PAGE_STATE_NAMES  # noqa: E402
from tests.gui_helpers import PROMPTS, RUN_TIMEOUT_MS, SYSTEM, drop_file, set_settings  # noqa: E402

pytestmark = pytest.mark.model


def type_prompts(qtbot, w, prompts) -> list[str]:
    qtbot.keyClicks(w.system_edit, SYSTEM)
    for text in prompts:
        qtbot.keyClicks(w.prompt_list.entry, text)
        qtbot.keyClick(w.prompt_list.entry, Qt.Key.Key_Return)
    assert [t for _, t in w.prompt_list.prompts()] == list(prompts)
    return [uid for uid, _ in w.prompt_list.prompts()]


def test_run_all_streams_answers_and_shares_the_system_prompt(window, qtbot, tmp_path):
    d, w, c = window, window.window, window.controller
    info = c.model_info
    assert info["arch"] == "llama" and info["quant"] == "Q4_1"
    assert info["n_params"] > 100_000_000 and info["context_length"] == 8192
    assert "llama" in w.model_bar.summary() and not w.model_bar.loading
    assert QKeySequence("Ctrl+Return") in w.act_run_all.shortcuts()
    assert w.act_stop_all.shortcut() == QKeySequence("Esc")
    assert w.act_open.shortcut() == QKeySequence("Ctrl+O")
    assert w.act_export.shortcut() == QKeySequence("Ctrl+E")
    assert w.model_bar.name.text() == "SmolLM2-135M-Instruct"  # the file's name, not a build string
    for label in ("Run all", "Stop all"):  # one button each, beside the prompts
        shown = [b for b in w.findChildren(QAbstractButton)
                 if b.isVisible() and b.text().replace("&", "").startswith(label)]
        assert len(shown) == 1, (label, [b.text() for b in shown])

    set_settings(d, max_new_tokens=8)
    uids = type_prompts(qtbot, d.window, PROMPTS)
    at_end = []  # the charts back off during a run; when it ends they show its last step at once
    c.run_done.connect(lambda: at_end.append(w.charts.curves["hits"].getOriginalDataset()[0][-1]))
    w.act_run_all.trigger()
    qtbot.waitUntil(lambda: len(c.finished_records) == 3, timeout=RUN_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not c.running and c.snapshot is not None, timeout=10_000)

    cards = [w.streams.card(uid) for uid in uids]
    for card in cards:
        assert card.answer_text().strip(), f"{card.uid} has no answer"
        assert card.turns[-1].reason in ("stop", "length")
        assert card.answer_text() in card.transcript_text()
    records = {r.id: r for r in c.finished_records}
    cached = [card.turns[-1].record["n_cached"] for card in cards]
    assert cached[1] > 0 and cached[2] > 0, cached
    for card, n in zip(cards, cached, strict=True):
        n_prompt = card.turns[-1].record["n_prompt"]
        assert card.badge_cache.text() == f"cached {n}/{n_prompt}"
        assert card.badge_ttft.text().startswith("TTFT ")
        assert card.badge_reason.text() == card.turns[-1].reason
    assert w.requests_table.rowCount() == 3

    # Where every prompt token went (docs/design.md §15): each card's bar shows its record's parts,
    # adding up to its prompt, and the parts chart's last point is the session's totals.
    totals: dict[str, int] = {}
    for card in cards:
        r = card.turns[-1].record
        parts = r["parts"]
        shown = card.parts_shown()
        assert sum(shown.values()) == r["n_prompt"] == sum(v for k, v in parts.items() if k != "disk")
        assert shown.get("cached", 0) + shown.get("disk", 0) + shown.get("lent", 0) == r["n_cached"]
        assert "Where the" in card.parts_bar.toolTip()
        for k, v in shown.items():
            totals[k] = totals.get(k, 0) + v
    w.charts.refresh()
    chart = {k: v for k, v in w.charts.part_totals().items() if v}
    assert chart == totals and sum(chart.values()) == sum(r.n_prompt for r in c.finished_records)

    # The charts hold exactly the scheduler's timeline; the page map counts match the pool.
    sched = c.driver.engine.scheduler
    qtbot.waitUntil(lambda: w.charts.row_count == len(sched.timeline.rows), timeout=10_000)
    rows = sched.timeline.rows
    for name in ("pages_free", "pages_cached", "prefill_saved", "hits", "chains"):
        x, y = w.charts.series(name)
        np.testing.assert_allclose(x, [r.wall_s for r in rows])
        np.testing.assert_allclose(y, [getattr(r, name) for r in rows])
    qtbot.waitUntil(lambda: bool(at_end), timeout=10_000)
    assert at_end[-1] == rows[-1].wall_s
    states = sched.page_states()
    expected = {PAGE_STATE_NAMES[s]: int(n) for s, n in enumerate(np.bincount(states, minlength=4))}
    w.tabs.setCurrentWidget(w.cache_panel)  # a hidden tab draws only once shown
    qtbot.waitUntil(lambda: w.cache_panel.page_map.counts_by_state() == expected, timeout=10_000)
    assert len(c.snapshot.page_states) == sched.pool.capacity

    # "Why it missed": the probe of a typed prompt matches the cached system prompt.
    w.prompt_list.select(uids[1])
    w.cache_panel.probe_button.click()
    qtbot.waitUntil(lambda: c.last_probe is not None, timeout=30_000)
    probe = c.last_probe
    for key in ("matched_tokens", "matched_pages", "n_prompt", "stop_reason", "first_diff_index",
                "chain_id", "context_before", "prompt_token", "cached_token"):
        assert key in probe
    assert probe["matched_tokens"] >= cached[1] > 0
    assert sum(v for k, v in probe["parts"].items() if k != "disk") == probe["n_prompt"]  # §15's parts
    assert probe["parts"]["cached"] == probe["matched_tokens"]
    assert "Where its tokens would go" in w.cache_panel.probe_view.plain_text()

    # A follow-up turn extends the conversation, so it hits the first turn's pages.
    first = cards[0].turns[-1].record
    qtbot.keyClicks(cards[0].followup, "Do you sell screws too?")
    qtbot.keyClick(cards[0].followup, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: len(c.finished_records) == 4, timeout=RUN_TIMEOUT_MS)
    follow = c.finished_records[-1]
    assert follow.conversation_id == records[first["id"]].conversation_id
    page_rows = c.settings.page_rows
    assert follow.n_cached >= (first["n_prompt"] // page_rows) * page_rows
    assert len(cards[0].turns) == 2 and cards[0].answer_text().strip()

    # The report is built on the engine thread and written in the UI thread.
    path = tmp_path / "session.json"
    c.export_report(str(path), w.prompt_pane.system_prompt())
    qtbot.waitUntil(lambda: bool(c.last_report_paths or c.last_error), timeout=60_000)
    assert c.last_error is None, c.last_error
    assert path.is_file() and path.stat().st_size > 0
    assert c.open_report(str(path))
    assert w.charts.row_count == len(c.opened_report.timeline) == len(sched.timeline.rows)

    # Flush cache gives back every cached page (no stream holds one now).
    c.flush_cache()
    w.tabs.setCurrentWidget(w.cache_panel)
    qtbot.waitUntil(lambda: w.cache_panel.page_map.counts_by_state()["cached"] == 0, timeout=30_000)
    assert c.driver.engine.scheduler is sched and not sched.cache.pages
    assert c.last_error is None


LONG_PROMPTS = ["List every tool you sell, one per line, each with a long description.",
                "Write a long story about a customer who buys paint.",
                "Describe, step by step and in detail, how to build a garden shed."]


def test_stop_one_stop_all_then_close_mid_generation(window, qtbot, tmp_path, monkeypatch):
    d, w, c = window, window.window, window.controller
    set_settings(d, max_new_tokens=400)
    uids = type_prompts(qtbot, d.window, LONG_PROMPTS)
    d.run_all()
    cards = [w.streams.card(uid) for uid in uids]
    qtbot.waitUntil(lambda: all(bool(c.answer_text()) for c in cards), timeout=RUN_TIMEOUT_MS)

    # Switching models while streams run asks first; "no" keeps everything running.
    asked = []
    monkeypatch.setattr(w, "confirm", lambda title, text: asked.append(text) or False)
    assert d.open_model_path(str(tmp_path / "other.gguf")) is False
    assert asked and all(c.running for c in cards)

    cards[0].stop_button.click()
    qtbot.waitUntil(lambda: cards[0].turns[-1].reason == "cancelled", timeout=60_000)
    assert cards[0].answer_text().strip() and "[stopped]" in cards[0].transcript_text()
    assert cards[0].badge_reason.text() == "cancelled"
    stopped = [r for r in c.finished_records if r.finish_reason == "cancelled"]
    assert len(stopped) == 1 and stopped[0].n_gen > 0 and stopped[0].text == cards[0].answer_text()

    kept = [c.answer_text() for c in cards[1:]]
    w.act_stop_all.trigger()  # Esc
    qtbot.waitUntil(lambda: not any(c.running for c in cards), timeout=60_000)
    for card, before in zip(cards[1:], kept, strict=True):
        assert card.turns[-1].reason == "cancelled"
        assert card.answer_text().startswith(before)

    # Run one prompt again (a new conversation); switching models now, with "yes", stops it
    # and, as the file is no model, keeps the old one.
    cards[2].run_button.click()
    qtbot.waitUntil(lambda: len(cards[2].turns) == 2 and bool(cards[2].answer_text()), timeout=RUN_TIMEOUT_MS)
    monkeypatch.setattr(w, "confirm", lambda title, text: True)
    before = dict(c.model_info)
    assert d.open_model_path(str(tmp_path / "other.gguf")) is True
    qtbot.waitUntil(lambda: c.last_error is not None and not w.model_bar.loading, timeout=60_000)
    assert cards[2].turns[-1].reason == "cancelled" and cards[2].answer_text()
    assert "other.gguf" in c.last_error and c.model_info == before
    c.last_error = None

    # Run another prompt again and close the window while it generates.
    cards[1].run_button.click()
    qtbot.waitUntil(lambda: cards[1].running and len(cards[1].turns) == 2 and bool(cards[1].answer_text()),
                    timeout=RUN_TIMEOUT_MS)
    thread = c.driver.thread
    w.close()
    assert not thread.isRunning()
    assert c.last_error is None
    assert cards[1].turns[0].answer.strip()  # the earlier run's text is still there


def test_broken_gguf_drop_shows_the_error_and_keeps_the_model(window, qtbot, tmp_path):
    d, w, c = window, window.window, window.controller
    before = dict(c.model_info)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    entered, dropped = drop_file(w, broken)
    assert entered and dropped
    qtbot.waitUntil(lambda: c.last_error is not None, timeout=60_000)
    assert "broken.gguf" in c.last_error
    assert c.model_info == before and w.model_bar.info == before
    # the title names the model alone: X11 and Windows append " — PrefixLab" (make_app's display name)
    assert w.windowTitle() == before["name"]
    assert not w.model_bar.loading and w.act_run_all.isEnabled()

    # Not a model: the drop is refused.
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert drop_file(w, other) == (False, False)

    # An exception on the engine thread becomes a `Failed` report and a dialog; the thread lives on.
    c.last_error = None
    c.driver.apply_settings(dataclasses.replace(c.settings, page_rows=0))  # the request raises
    qtbot.waitUntil(lambda: c.last_error is not None, timeout=30_000)
    assert "ValueError" in c.last_error and "Page rows" in c.last_error
    assert c.driver.thread.isRunning()
    # New pool settings make a new Scheduler (the engine is idle); the charts start over.
    old = c.driver.engine.scheduler
    set_settings(d, page_rows=8, pool_pages=300)
    qtbot.waitUntil(lambda: c.driver.engine.scheduler is not old, timeout=30_000)
    qtbot.waitUntil(lambda: c.snapshot is not None and len(c.snapshot.page_states) == 300, timeout=30_000)
    assert c.driver.engine.scheduler.pool.page_rows == 8 and w.charts.row_count == 0

    w.prompt_list.add_prompt("Do you sell drills?")
    assert d.probe_selected()
    qtbot.waitUntil(lambda: c.last_probe is not None, timeout=30_000)
    assert c.last_probe["matched_tokens"] == 0 and c.last_probe["stop_reason"] in ("miss", "end")
