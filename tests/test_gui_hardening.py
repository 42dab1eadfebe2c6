"""Hardening of the real window on the bundled model: no crash, nothing lost.

Closing during a model load, exports to impossible paths, model switches and broken drops
while streams run, a scheduler step that raises, and two things seen on a real X display (the
panes moving mid-run, a black transcript scroll bar). Closing mid-generation is covered by
test_gui_app.py's stop/close test, which asserts the thread ended and no error was reported.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
from markupsafe import escape  # noqa: E402
from PySide6.QtCore import QPoint, QRect  # noqa: E402
from PySide6.QtWidgets import QApplication, QFileDialog  # noqa: E402

import engine  # noqa: E402
from tests.gui_helpers import (  # noqa: E402
    LOAD_TIMEOUT_MS,
    PROMPTS,
    RUN_TIMEOUT_MS,
    SYSTEM,
    Errors,
    close_boxes,
    drop_file,
    error_boxes,
    set_settings,
)
from tests.wait import wait_until  # noqa: E402

pytestmark = pytest.mark.model

CLOSE_LIMIT_S = 3.0
LONG_PROMPTS = ["List every tool you sell, one per line, each with a long description.",
                "Write a long story about a customer who buys paint."]


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefixlab-load")]


def join_loaders(timeout: float = 120.0) -> None:
    """Let an abandoned background load end, so it does not slow the next tests."""
    wait_until(lambda: not loader_threads(), timeout, "an abandoned model load to end", interval=0.1)


def start_prompts(d, prompts: list[str]) -> list:
    """Put the shared system prompt and `prompts` in the editors, run them all; return the cards."""
    w = d.window
    w.system_edit.setPlainText(SYSTEM)
    for text in prompts:
        w.prompt_list.add_prompt(text)
    assert d.run_all() == len(prompts)
    return [w.streams.card(uid) for uid, _ in w.prompt_list.prompts()]


def transcripts(cards) -> list[str]:
    return [c.transcript_text() for c in cards]


# 1. closing during a model load ------------------------------------------------------------------
def assert_closes_at_once(w, c, during: str) -> None:
    """Closing the window ends the driver's thread within CLOSE_LIMIT_S."""
    thread = c.driver.thread
    t0 = time.perf_counter()
    w.close()
    took = time.perf_counter() - t0
    assert not thread.isRunning()
    assert took < CLOSE_LIMIT_S, f"closing during {during} took {took:.1f} s"


def test_close_during_a_slow_load_ends_the_thread_at_once(qtbot, open_desktop, monkeypatch):
    started, release = threading.Event(), threading.Event()

    def slow_load(path=None, **kw):
        started.set()
        release.wait(20)  # a big GGUF: far longer than anyone waits for a window to close
        raise engine.ModelLoadError("the slow load ended")  # must reach no one

    monkeypatch.setattr(engine, "load_model", slow_load)
    safety = threading.Timer(15, release.set)  # never hang the suite, fixed or not
    safety.daemon = True
    safety.start()
    d = open_desktop(autoload=True)
    w, c = d.window, d.controller
    w.show()
    errors = Errors(c)
    qtbot.waitUntil(started.is_set, timeout=10_000)
    assert c.loading and w.model_bar.loading and not w.act_run_all.isEnabled()

    assert_closes_at_once(w, c, "a load")
    qtbot.wait(100)
    release.set()
    safety.cancel()
    join_loaders()
    qtbot.wait(100)  # the abandoned load's result reaches no one
    assert not errors and c.last_error is None and not error_boxes(w)
    assert c.model_info is None


def test_close_during_a_cold_load_of_the_bundled_model(qtbot, open_desktop, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXLAB_CACHE_DIR", str(tmp_path / "cold-cache"))  # no weight image yet
    d = open_desktop(autoload=True)
    w, c = d.window, d.controller
    w.show()
    errors = Errors(c)
    qtbot.waitUntil(lambda: bool(loader_threads()), timeout=10_000)  # the load is under way
    assert c.loading and c.model_info is None
    assert_closes_at_once(w, c, "a cold load")
    join_loaders()
    qtbot.wait(100)
    assert not errors and c.last_error is None and not error_boxes(w)
    assert c.model_info is None  # closed before the load ended, and its model reached no one


# 3. exports to impossible places --------------------------------------------------------------------
def test_export_to_an_impossible_path_names_it_and_loses_nothing(window, qtbot, tmp_path, monkeypatch):
    d, w, c = window, window.window, window.controller
    set_settings(d, max_new_tokens=8)
    cards = start_prompts(d, PROMPTS[:2])
    qtbot.waitUntil(lambda: len(c.finished_records) == 2, timeout=RUN_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not c.running, timeout=10_000)
    before = transcripts(cards)
    answers = [c.answer_text() for c in cards]
    assert all(a.strip() for a in answers)

    chosen: list[str] = []
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        lambda *a, **k: (chosen[-1], "HTML report (*.html)"))
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    for bad in (str(blocker / "report.html"), "/proc/report.html"):
        chosen.append(bad)
        n = len(d.errors)
        w.act_export.trigger()  # File → Export report…
        qtbot.waitUntil(lambda n=n: len(d.errors) > n, timeout=60_000)
        message = d.errors[-1]
        assert bad in message, message
        boxes = error_boxes(w)
        assert boxes and any(bad in b.text() for b in boxes), [b.text() for b in boxes]
        assert not os.path.exists(bad)
        parent = os.path.dirname(bad)
        if os.path.isdir(parent):
            assert not [f for f in os.listdir(parent) if f.startswith(".report.html")]
        assert not c.last_report_paths
        assert transcripts(cards) == before and [c.answer_text() for c in cards] == answers
        close_boxes(w)
    assert blocker.read_text() == "not a folder"
    assert sorted(os.listdir(tmp_path)) == sorted(["file.txt", "qsettings"])

    # The app goes on: a run, then an export to a good path holds every answer.
    assert w.act_run_all.isEnabled()
    d.run_all()
    qtbot.waitUntil(lambda: len(c.finished_records) == 4, timeout=RUN_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not c.running, timeout=10_000)
    good = tmp_path / "out" / "report.html"
    good.parent.mkdir()
    chosen.append(str(good))
    n = len(d.errors)
    w.act_export.trigger()
    qtbot.waitUntil(lambda: bool(c.last_report_paths) or len(d.errors) > n, timeout=60_000)
    assert len(d.errors) == n, d.errors[-1]
    assert c.last_report_paths == [str(good)]
    html = good.read_text(encoding="utf-8")
    for card in cards:
        for turn in card.turns:
            assert turn.answer.strip() and str(escape(turn.answer)) in html
    assert os.listdir(good.parent) == ["report.html"]
    assert transcripts(cards)[0].startswith(before[0])


# 4. a model switch while streams run ---------------------------------------------------------------
def test_model_switch_while_streams_run_asks_and_keeps_every_transcript(window, qtbot, tiny_gguf_path,
                                                                        monkeypatch):
    d, w, c = window, window.window, window.controller
    set_settings(d, max_new_tokens=300)
    cards = start_prompts(d, LONG_PROMPTS)
    qtbot.waitUntil(lambda: all(c.answer_text() for c in cards), timeout=RUN_TIMEOUT_MS)
    model = c.driver.engine.model
    info = dict(c.model_info)

    # "No": nothing changes, the streams go on.
    asked: list[str] = []
    monkeypatch.setattr(w, "confirm", lambda title, text: asked.append(text) or False)
    assert d.open_model_path(tiny_gguf_path) is False
    assert len(asked) == 1 and "2 stream(s)" in asked[0] and "tiny.gguf" in asked[0]
    assert not c.loading and not w.model_bar.loading and c.model_info == info
    lengths = [len(c.answer_text()) for c in cards]
    qtbot.waitUntil(lambda: all(len(c.answer_text()) > n for c, n in zip(cards, lengths, strict=True)),
                    timeout=60_000)
    assert all(c.running for c in cards) and c.driver.engine.model is model

    # "Yes": the streams end as cancelled with their text, then the new model loads.
    monkeypatch.setattr(w, "confirm", lambda title, text: asked.append(text) or True)
    c.flush_text()
    shown = transcripts(cards)
    assert d.open_model_path(tiny_gguf_path) is True
    qtbot.waitUntil(lambda: c.model_info is not None and c.model_info["name"] == "tiny-llama",
                    timeout=LOAD_TIMEOUT_MS)
    assert len(asked) == 2 and not d.errors
    for card, before in zip(cards, shown, strict=True):
        assert not card.running and card.turns[-1].reason == "cancelled"
        assert card.answer_text().strip()
        assert card.transcript_text().startswith(before)
        assert card.transcript_text().endswith("[stopped]")
    stopped = [r for r in c.finished_records if r.finish_reason == "cancelled"]
    assert len(stopped) == 2 and all(r.text for r in stopped)
    assert w.model_bar.info == c.model_info and not w.model_bar.loading
    assert w.act_run_all.isEnabled() and not w.act_stop_all.isEnabled()

    # The new model runs (its tokenizer is tiny: a short prompt).
    w.system_edit.setPlainText("")
    cards[0].run_button.click()
    qtbot.waitUntil(lambda: not cards[0].running, timeout=RUN_TIMEOUT_MS)
    assert cards[0].turns[-1].reason in ("stop", "length") and len(cards[0].turns) == 2
    assert cards[0].transcript_text().startswith(shown[0])
    assert not d.errors


# 5. a broken GGUF dropped while generating ----------------------------------------------------------
def test_broken_gguf_drop_while_generating_leaves_the_streams_alone(window, qtbot, tmp_path, tiny_gguf_path,
                                                                   monkeypatch):
    d, w, c = window, window.window, window.controller
    set_settings(d, max_new_tokens=48)
    model = c.driver.engine.model
    info = dict(c.model_info)
    asked: list[str] = []
    monkeypatch.setattr(w, "confirm", lambda title, text: asked.append(text) or False)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    cards = start_prompts(d, LONG_PROMPTS)
    qtbot.waitUntil(lambda: all(c.answer_text() for c in cards), timeout=RUN_TIMEOUT_MS)
    assert all(c.running for c in cards)

    # A file that is no model: its error shows; no question, the streams go on.
    assert drop_file(w, broken) == (True, True)
    qtbot.waitUntil(lambda: bool(d.errors), timeout=60_000)
    assert "broken.gguf" in d.errors[-1] and any("broken.gguf" in b.text() for b in error_boxes(w))
    assert not asked, "a file that is no model must not offer to stop the streams"
    assert not c.loading and not w.model_bar.loading and c.model_info == info
    assert all(c.running for c in cards)

    # A real model dropped while streams run asks first; "no" leaves them running.
    assert drop_file(w, tiny_gguf_path) == (True, True)
    qtbot.waitUntil(lambda: bool(asked), timeout=60_000)
    assert "tiny.gguf" in asked[0] and all(c.running for c in cards)

    qtbot.waitUntil(lambda: not c.running, timeout=RUN_TIMEOUT_MS)
    for card in cards:
        assert card.turns[-1].reason in ("stop", "length"), card.turns[-1].reason
        assert card.answer_text().strip() and "[stopped]" not in card.transcript_text()
    assert c.driver.engine.model is model and c.model_info == info
    assert len(d.errors) == 1 and len(asked) == 1


# 6. a scheduler step that raises ------------------------------------------------------------------
def test_a_failing_step_shows_an_error_and_the_app_runs_again(window, qtbot):
    d, w, c = window, window.window, window.controller
    set_settings(d, max_new_tokens=30)
    sched = c.driver.engine.scheduler
    real_step = sched.step
    calls = {"n": 0}

    def step_once_broken():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    sched.step = step_once_broken  # set while the engine is idle
    cards = start_prompts(d, PROMPTS[:2])
    qtbot.waitUntil(lambda: bool(d.errors), timeout=RUN_TIMEOUT_MS)
    assert "injected step failure" in d.errors[-1]
    boxes = error_boxes(w)
    assert boxes and boxes[0].windowTitle() == "Engine error"
    qtbot.waitUntil(lambda: not c.running, timeout=60_000)
    assert all(c.turns[-1].reason == "cancelled" for c in cards)
    assert c.driver.thread.isRunning() and w.act_run_all.isEnabled()
    close_boxes(w)

    set_settings(d, max_new_tokens=8)
    n = len(c.finished_records)
    assert d.run_all() == 2
    qtbot.waitUntil(lambda: len(c.finished_records) == n + 2, timeout=RUN_TIMEOUT_MS)
    for card in cards:
        assert card.turns[-1].reason in ("stop", "length") and card.answer_text().strip()
        assert len(card.turns) == 2
    assert len(d.errors) == 1
    QApplication.processEvents()


# the layout holds still while a run goes on ---------------------------------------------------------
def test_the_panes_hold_still_while_the_charts_summary_grows(window, qtbot):
    d, w, c = window, window.window, window.controller
    right = w.splitter.widget(2)
    sizes, floor = w.splitter.sizes(), right.minimumSizeHint().width()
    set_settings(d, max_new_tokens=8)
    start_prompts(d, PROMPTS)
    qtbot.waitUntil(lambda: len(c.finished_records) == 3, timeout=RUN_TIMEOUT_MS)
    qtbot.waitUntil(lambda: "steps" in w.charts.summary.text(), timeout=10_000)
    QApplication.processEvents()
    assert right.minimumSizeHint().width() <= floor  # the summary's numbers do not widen the pane
    assert w.splitter.sizes() == sizes


# the transcript's scroll bar on a real display -------------------------------------------------------
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_a_long_transcript_scrolls_with_a_themed_scroll_bar(qtbot, gui_settings, qapp, theme):
    from app.desktop.transcript import Transcript
    from ui.stream_view import StreamView
    from ui.theme import apply_theme, color

    apply_theme(qapp, theme)
    transcript = Transcript("p1", "Do you have green paint?")
    card = StreamView(transcript)
    qtbot.addWidget(card)
    card.resize(420, 250)
    card.show()
    transcript.start_conversation("c1", SYSTEM)
    transcript.begin_turn("Do you have green paint?")
    card.show_turn_started()
    transcript.add_piece("We sell green paint in every shade, and brushes to go with it. " * 20)
    card.show_text(transcript.take_pending())
    card.rerender()  # what a theme change does
    bar = card.view.verticalScrollBar()
    qtbot.waitUntil(bar.isVisible, timeout=5_000)
    image = card.grab(QRect(bar.mapTo(card, QPoint(0, 0)), bar.size())).toImage()  # as drawn on the card
    lightness = [image.pixelColor(x, y).lightness() for x in range(image.width())
                 for y in range(image.height())]
    if theme == "light":
        # Qt draws an unstyled scroll bar under a transparent transcript with a black handle.
        assert min(lightness) > 120, f"a near-black scroll bar (lightness {min(lightness)})"
    assert bar.width() <= 12
    assert color("border") in card.view.styleSheet()


def test_a_hostile_chat_template_falls_back_with_a_visible_warning(window, qtbot, tmp_path):
    from tests.tiny_gguf import write_tiny_gguf
    d, w, c = window, window.window, window.controller
    assert w.model_bar.chips["template"].isHidden()  # the bundled model's own template works
    evil = write_tiny_gguf(tmp_path / "evil.gguf",
                           chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    assert d.open_model_path(evil) is True
    qtbot.waitUntil(lambda: c.model_info is not None and c.model_info["path"] == str(evil),
                    timeout=LOAD_TIMEOUT_MS)
    chip = w.model_bar.chips["template"]
    qtbot.waitUntil(chip.isVisible, timeout=5_000)  # the toolbar lays its widgets out on the next events
    assert "ChatML" in chip.toolTip()
    assert "Warning" in w.statusBar().currentMessage()
    assert c.last_error is None  # a warning, not an error: the model is usable
