"""Settings validation and persistence, themes, scenarios, the About box (no model needed)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import shutil  # noqa: E402

import pytest  # noqa: E402

from app import settings_table  # noqa: E402
from app.desktop.settings import AppSettings, add_recent_model, qsettings, recent_models  # noqa: E402
from app.scenario import bundled_scenarios  # noqa: E402
from app.system_info import about_versions  # noqa: E402
from engine.metrics import RequestRecord  # noqa: E402
from ui.about import AboutDialog  # noqa: E402
from ui.settings_dialog import SettingsDialog  # noqa: E402
from ui.theme import current_theme  # noqa: E402

OLD_SETTINGS = os.path.join(os.path.dirname(__file__), "data", "qsettings-0.1.ini")  # written by 0.1's window


@pytest.mark.parametrize("changes, words", [
    ({"page_rows": 0}, "Page rows"),
    ({"top_p": 0.0}, "Top-p"),
    ({"min_p": 1.0}, "Min-p"),
    ({"repeat_penalty": 0.0}, "Repetition penalty"),
    ({"temperature": -1.0}, "Temperature"),
    ({"pool_pages": 2, "max_new_tokens": 64}, "cannot hold even one request"),
    ({"pool_pages": 40, "cache_pages": 50}, "larger than the pool"),
    ({"namespace": "a\nb"}, "Namespace"),
    ({"spec_k": 0}, "Draft tokens (k)"),
    ({"spec_k": 17}, "Draft tokens (k)"),
])
def test_settings_validation_names_the_problem(changes, words):
    s = AppSettings.from_dict({**AppSettings().to_dict(), **changes})
    errors = s.errors()
    assert errors and any(words in e for e in errors), errors
    with pytest.raises(ValueError, match=words.split()[0]):
        s.validate()
    assert AppSettings().errors() == []


def test_settings_dialog_rejects_bad_values_with_a_message(open_desktop, qtbot):
    dlg = open_desktop().settings_dialog()
    dlg.show()
    dlg.top_p.setValue(0.0)
    dlg.pool_pages.setValue(2)
    dlg.accept()
    assert dlg.result() == 0 and dlg.isVisible()
    assert "Top-p" in dlg.error.text() and "cannot hold" in dlg.error.text()
    assert dlg.result_values is None
    dlg.top_p.setValue(0.9)
    dlg.pool_pages.setValue(0)
    dlg.seed.setValue(7)
    flushed = []
    dlg.flush_requested.connect(lambda: flushed.append(1))
    dlg.flush_button.click()
    assert flushed == [1]
    dlg.accept()
    chosen = AppSettings.from_dict(dlg.result_values)
    assert chosen.seed == 7 and chosen.sampling().seed == 7 and chosen.top_p == 0.9


def test_settings_dialog_speculative_decoding_round_trip(open_desktop, qtbot):
    dlg = open_desktop().settings_dialog()
    dlg.show()
    assert not dlg.spec_enabled.isChecked() and not dlg.spec_k.isEnabled()   # off by default: k greyed
    assert "n-grams of the prompt" in dlg.spec_enabled.toolTip()
    dlg.spec_enabled.setChecked(True)
    assert dlg.spec_k.isEnabled()
    dlg.spec_k.setValue(7)
    dlg.accept()
    chosen = AppSettings.from_dict(dlg.result_values)
    assert (chosen.spec_enabled, chosen.spec_k) == (True, 7)
    sched = chosen.scheduler_settings()
    assert (sched.spec_enabled, sched.spec_k) == (True, 7)
    # Reopened on those values: the box is ticked and k is editable; unticking greys k again.
    again = SettingsDialog(chosen.to_dict(), settings_table.rows(), lambda v: [])
    qtbot.addWidget(again)
    assert again.spec_enabled.isChecked() and again.spec_k.isEnabled() and again.spec_k.value() == 7
    again.spec_enabled.setChecked(False)
    assert not again.spec_k.isEnabled() and again.values()["spec_enabled"] is False
    assert again.spec_k.minimum() == 1 and again.spec_k.maximum() == 16


def test_settings_theme_geometry_and_transcripts_survive_a_restart(open_desktop, qtbot):
    d1 = open_desktop()
    w1, c1 = d1.window, d1.controller
    custom = AppSettings(page_rows=8, pool_pages=200, cache_pages=100, max_streams=3, chunk_tokens=32,
                         cache_enabled=False, namespace="team-a", temperature=0.7, top_k=20, top_p=0.8,
                         min_p=0.1, repeat_penalty=1.2, seed=42, max_new_tokens=33, spec_enabled=True,
                         spec_k=6)
    c1.apply_settings(custom)
    w1.set_theme("dark")
    assert current_theme() == "dark"
    w1.resize(760, 540)  # not the default 1400x900 (Qt may grow it to the minimum size)
    w1.show()
    w1.system_edit.setPlainText("A shared system prompt.")
    uid = w1.prompt_list.add_prompt("First question?")
    w1.prompt_list.add_prompt("Second question?")
    t = c1.transcript(uid, "First question?")  # a turn that was stopped, as the worker reports it
    t.start_conversation("c-test", "A shared system prompt.")
    t.begin_turn("First question?")
    t.add_piece("An answer ")
    t.add_piece("that was cut.")
    c1.flush_text()
    t.finish(RequestRecord(id=1, preview="First", conversation_id="c-test", namespace="", n_prompt=20,
                           n_cached=16, n_gen=5, ttft_s=0.2, finish_reason="cancelled",
                           text="An answer that was cut."))
    add_recent_model("/models/a.gguf", c1.store)
    w1.left_splitter.setSizes([120, 400])
    size, splits = (w1.width(), w1.height()), w1.left_splitter.sizes()
    w1.close()

    d2 = open_desktop()
    w2 = d2.window
    assert d2.controller.settings == custom
    assert AppSettings.load(qsettings()) == custom
    assert w2.theme_actions["dark"].isChecked() and current_theme() == "dark"
    # Restored, not the 1400x900 default (offscreen Qt clamps the width to its 800 px screen).
    avail = w2.screen().availableGeometry()
    assert w2.height() == size[1] and abs(w2.width() - min(size[0], avail.width())) <= 4
    got = w2.left_splitter.sizes()
    assert abs(got[0] / sum(got) - splits[0] / sum(splits)) < 0.03, (got, splits)
    assert w2.prompt_pane.system_prompt() == "A shared system prompt."
    assert [t for _, t in w2.prompt_list.prompts()] == ["First question?", "Second question?"]
    restored = w2.streams.card(uid)
    assert restored is not None and restored.answer_text() == "An answer that was cut."
    assert "[stopped]" in restored.transcript_text() and restored.badge_cache.text() == "cached 16/20"
    assert recent_models(d2.store)[0] == "/models/a.gguf"
    # New prompts never reuse a restored uid.
    assert w2.prompt_list.add_prompt("Third?") not in {u for u, _ in w2.prompt_list.prompts()[:2]}
    w2.set_theme("light")


def test_settings_and_transcripts_saved_by_version_0_1_load(open_desktop, gui_settings):
    # The settings file of 0.1's window (tests/data/qsettings-0.1.ini) where this version looks.
    target = qsettings().fileName()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy(OLD_SETTINGS, target)
    d = open_desktop()
    w, c = d.window, d.controller
    assert c.settings == AppSettings(page_rows=8, pool_pages=200, cache_pages=100, max_streams=3,
                                     chunk_tokens=32, cache_enabled=False, namespace="team-a",
                                     temperature=0.7, top_k=20, top_p=0.8, min_p=0.1, repeat_penalty=1.2,
                                     seed=42, max_new_tokens=33)
    # 0.1 had no speculative decoding: the file has no such keys and the defaults (off) apply.
    assert not c.settings.spec_enabled and c.settings.spec_k == 4
    assert not c.settings.scheduler_settings().spec_enabled
    assert current_theme() == "dark" and recent_models(d.store) == ["/models/a.gguf"]
    assert w.prompt_pane.system_prompt() == "A shared system prompt."
    assert w.prompt_list.prompts() == [("p1", "First question?"), ("p2", "Second question?")]
    assert c.book.scripts == {"p1": ["Later turn"]}
    card = w.streams.card("p1")
    assert [(t.user, t.answer, t.reason) for t in card.turns] == [
        ("First question?", "An answer.", "stop"), ("And a follow-up?", "Cut short", "cancelled")]
    assert card.badge_cache.text() == "cached 32/40" and card.transcript_text().endswith("[stopped]")
    # The restored conversation goes on where it was: its completed turn, then the new question.
    assert card.transcript.history_messages("More?") == [
        {"role": "system", "content": "A shared system prompt."},
        {"role": "user", "content": "First question?"}, {"role": "assistant", "content": "An answer."},
        {"role": "user", "content": "More?"}]
    w.set_theme("light")


def test_scenarios_load_into_the_editors(open_desktop):
    d = open_desktop()
    w, c = d.window, d.controller
    scenarios = {s.name: s for s in bundled_scenarios()}
    store = next(s for s in scenarios.values() if "ardware" in s.name)
    d.load_scenario(store)
    assert w.prompt_pane.system_prompt() == store.system.strip()
    assert [t for _, t in w.prompt_list.prompts()] == store.prompts
    assert c.settings.max_new_tokens == store.max_new_tokens
    conv = next((s for s in scenarios.values() if s.conversation), None)
    if conv is not None:
        d.load_scenario(conv)
        assert [t for _, t in w.prompt_list.prompts()] == conv.conversation[:1]
        assert list(c.book.scripts.values()) == [conv.conversation[1:]]
    # Without a model, Run all does nothing and says so.
    assert d.run_all() == 0 and not w.streams.cards
    assert "No model" in w.statusBar().currentMessage()


def test_about_lists_the_versions(qtbot, gui_settings):
    v = about_versions()
    for key in ("PrefixLab", "Python", "NumPy", "Qt", "PySide6", "pyqtgraph", "gguf", "tokenizers"):
        assert v[key] and v[key] != "not installed", key
    dlg = AboutDialog(None, v, "SmolLM2 · llama")
    qtbot.addWidget(dlg)
    assert "PySide6" in dlg.text()


def test_one_settings_table_feeds_the_dialog_the_cli_and_validation(qtbot):
    # each default, limit, label and tip is written once, in app/settings_table.py
    import argparse

    from app.common_args import add_sampling_args, add_scheduler_args
    from app.settings_table import SETTINGS, WINDOW_REPEAT_PENALTY
    from engine.sampler import SamplingParams
    from engine.stream import MAX_NEW_TOKENS

    assert sorted(AppSettings().to_dict()) == sorted(SETTINGS)
    assert AppSettings().to_dict() == {n: s.default for n, s in SETTINGS.items()}
    engine = SamplingParams()
    app = AppSettings()
    assert (app.temperature, app.top_k, app.top_p, app.min_p) == (engine.temperature, engine.top_k,
                                                                    engine.top_p, engine.min_p)
    assert app.max_new_tokens == MAX_NEW_TOKENS and app.repeat_penalty == WINDOW_REPEAT_PENALTY
    dlg = SettingsDialog(app.to_dict(), settings_table.rows(), lambda v: AppSettings.from_dict(v).errors())
    qtbot.addWidget(dlg)
    # the window's own repetition penalty is on screen, with why it differs from the engine's
    assert dlg.repeat_penalty.value() == pytest.approx(1.1)
    assert "llama.cpp" in dlg.repeat_penalty.toolTip() and "loop" in dlg.repeat_penalty.toolTip()
    for name, s in SETTINGS.items():
        w = getattr(dlg, name)
        assert w.toolTip() == s.tip
        if s.kind in ("int", "float"):
            assert (w.minimum(), w.maximum()) == (s.low, s.high), name
    dlg.spec_enabled.setChecked(True)
    dlg.spec_k.setValue(3)
    assert dlg.values()["spec_k"] == 3 and dlg.values()["spec_enabled"] is True
    # the CLI shows the same limits and its defaults are the engine's
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    add_scheduler_args(p)
    args = p.parse_args([])
    assert args.max_new == MAX_NEW_TOKENS and args.repeat_penalty == engine.repeat_penalty
    assert " ".join(p.format_help().split()).count("at least 1 and at most 65,536") == 2  # max-new, chunk
    # validation speaks the same limits
    errs = AppSettings(spec_k=SETTINGS["spec_k"].high + 1).errors()
    assert errs == ["Draft tokens (k) must be a whole number at least 1 and at most 16, got 17"]
