"""Settings validation and persistence, themes, scenarios, the About box (no model needed)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app.scenario import bundled_scenarios  # noqa: E402
from app.settings import AppSettings, add_recent_model, qsettings, recent_models  # noqa: E402
from engine.metrics import RequestRecord  # noqa: E402
from tests.gui_helpers import gui_settings  # noqa: E402, F401 - a fixture
from ui.about import AboutDialog, versions  # noqa: E402
from ui.main_window import MainWindow  # noqa: E402
from ui.settings_dialog import SettingsDialog  # noqa: E402
from ui.theme import current_theme  # noqa: E402


@pytest.fixture
def bare_window(qtbot, gui_settings):  # noqa: F811 - the fixture imported above
    """A window that loads no model (its worker thread still runs)."""
    windows = []

    def make():
        w = MainWindow(autoload=False)
        windows.append(w)
        return w

    yield make
    for w in windows:
        w.close()
        assert not w.client.thread.isRunning()


@pytest.mark.parametrize("changes, words", [
    ({"page_rows": 0}, "Page rows"),
    ({"top_p": 0.0}, "Top-p"),
    ({"min_p": 1.0}, "Min-p"),
    ({"repeat_penalty": 0.0}, "Repetition penalty"),
    ({"temperature": -1.0}, "Temperature"),
    ({"pool_pages": 2, "max_new_tokens": 64}, "cannot hold even one request"),
    ({"pool_pages": 40, "cache_pages": 50}, "larger than the pool"),
    ({"namespace": "a\nb"}, "Namespace"),
])
def test_settings_validation_names_the_problem(changes, words):
    s = AppSettings.from_dict({**AppSettings().to_dict(), **changes})
    errors = s.errors()
    assert errors and any(words in e for e in errors), errors
    with pytest.raises(ValueError, match=words.split()[0]):
        s.validate()
    assert AppSettings().errors() == []


def test_settings_dialog_rejects_bad_values_with_a_message(qtbot, gui_settings):  # noqa: F811
    dlg = SettingsDialog(AppSettings())
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.top_p.setValue(0.0)
    dlg.pool_pages.setValue(2)
    dlg.accept()
    assert dlg.result() == 0 and dlg.isVisible()
    assert "Top-p" in dlg.error.text() and "cannot hold" in dlg.error.text()
    assert dlg.result_settings is None
    dlg.top_p.setValue(0.9)
    dlg.pool_pages.setValue(0)
    dlg.seed.setValue(7)
    flushed = []
    dlg.flush_requested.connect(lambda: flushed.append(1))
    dlg.flush_button.click()
    assert flushed == [1]
    dlg.accept()
    assert dlg.result_settings is not None and dlg.result_settings.seed == 7
    assert dlg.result_settings.sampling().seed == 7 and dlg.result_settings.top_p == 0.9


def test_settings_theme_geometry_and_transcripts_survive_a_restart(bare_window, qtbot, tmp_path):
    w1 = bare_window()
    custom = AppSettings(page_rows=8, pool_pages=200, cache_pages=100, max_streams=3, chunk_tokens=32,
                         cache_enabled=False, namespace="team-a", temperature=0.7, top_k=20, top_p=0.8,
                         min_p=0.1, repeat_penalty=1.2, seed=42, max_new_tokens=33)
    w1.apply_settings(custom)
    w1.set_theme("dark")
    assert current_theme() == "dark"
    w1.resize(760, 540)  # not the default 1400x900 (Qt may grow it to the minimum size)
    w1.show()
    w1.system_edit.setPlainText("A shared system prompt.")
    uid = w1.prompt_list.add_prompt("First question?")
    w1.prompt_list.add_prompt("Second question?")
    card = w1._card_for(uid, "First question?")
    card.start_conversation("c-test", "A shared system prompt.")
    card.begin_turn("First question?", "t-test")
    card.set_request(1, 20)
    card.append("An answer ")
    card.append("that was cut.")
    card.finish(RequestRecord(id=1, preview="First", conversation_id="c-test", namespace="", n_prompt=20,
                              n_cached=16, n_gen=5, ttft_s=0.2, finish_reason="cancelled",
                              text="An answer that was cut."))
    add_recent_model("/models/a.gguf", w1.store)
    w1.left_splitter.setSizes([120, 400])
    size, splits = (w1.width(), w1.height()), w1.left_splitter.sizes()
    w1.close()

    w2 = bare_window()
    assert w2.settings == custom
    assert AppSettings.load(qsettings()) == custom
    assert w2.theme_actions["dark"].isChecked() and current_theme() == "dark"
    # Restored, not the 1400x900 default (offscreen Qt clamps the width to its 800 px screen).
    avail = w2.screen().availableGeometry()
    assert w2.height() == size[1] and abs(w2.width() - min(size[0], avail.width())) <= 4
    got = w2.left_splitter.sizes()
    assert abs(got[0] / sum(got) - splits[0] / sum(splits)) < 0.03, (got, splits)
    assert w2.system_prompt() == "A shared system prompt."
    assert [t for _, t in w2.prompt_list.prompts()] == ["First question?", "Second question?"]
    restored = w2.streams.card(uid)
    assert restored is not None and restored.answer_text() == "An answer that was cut."
    assert "[stopped]" in restored.transcript_text() and restored.badge_cache.text() == "cached 16 of 20"
    assert recent_models(w2.store)[0] == "/models/a.gguf"
    # New prompts never reuse a restored uid.
    assert w2.prompt_list.add_prompt("Third?") not in {u for u, _ in w2.prompt_list.prompts()[:2]}
    w2.set_theme("light")


def test_scenarios_load_into_the_editors(bare_window):
    w = bare_window()
    scenarios = {s.name: s for s in bundled_scenarios()}
    store = next(s for s in scenarios.values() if "ardware" in s.name)
    w.load_scenario(store)
    assert w.system_prompt() == store.system.strip()
    assert [t for _, t in w.prompt_list.prompts()] == store.prompts
    assert w.settings.max_new_tokens == store.max_new_tokens
    conv = next((s for s in scenarios.values() if s.conversation), None)
    if conv is not None:
        w.load_scenario(conv)
        assert [t for _, t in w.prompt_list.prompts()] == conv.conversation[:1]
        assert list(w._scripts.values()) == [conv.conversation[1:]]
    # Without a model, Run all does nothing and says so.
    assert w.run_all() == 0 and not w.streams.cards


def test_about_lists_the_versions(qtbot, gui_settings):  # noqa: F811
    v = versions()
    for key in ("PrefixLab", "Python", "NumPy", "Qt", "PySide6", "pyqtgraph", "gguf", "tokenizers"):
        assert v[key] and v[key] != "not installed", key
    dlg = AboutDialog(None, "SmolLM2 · llama")
    qtbot.addWidget(dlg)
    assert "PySide6" in dlg.text()
