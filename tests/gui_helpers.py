"""Helpers for the GUI tests: an isolated QSettings location, settings, drops, waiting."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QMimeData, QPoint, QPointF, QSettings, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.settings import AppSettings  # noqa: E402

SYSTEM = ("You are the assistant of Bolt & Board, a neighbourhood hardware store. We sell power drills, "
          "hand saws, screws, nails, paint and ladders. Answer in one short sentence.")
PROMPTS = ["Do you sell drills?", "Do you have green paint?", "Can I buy a ladder here?"]
LOAD_TIMEOUT_MS = 120_000
RUN_TIMEOUT_MS = 240_000


@pytest.fixture
def gui_settings(tmp_path, qapp):
    """Every QSettings the app opens lives under tmp_path (never the user's real settings)."""
    from ui.theme import apply_theme

    folder = tmp_path / "qsettings"
    folder.mkdir()
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(folder))
    apply_theme(qapp, "light")
    yield folder
    apply_theme(qapp, "light")


def set_settings(window, **changes) -> AppSettings:
    """Apply settings changes the way the Settings dialog does."""
    s = AppSettings.from_dict({**window.settings.to_dict(), **changes})
    window.apply_settings(s)
    return s


def drop_file(widget, path: str) -> tuple[bool, bool]:
    """Drag a local file over `widget` and drop it; return (enter accepted, drop accepted)."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    with warnings.catch_warnings():  # Qt deprecates this constructor but offers no QPointF one here
        warnings.simplefilter("ignore", DeprecationWarning)
        enter = QDragEnterEvent(QPoint(20, 20), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                                Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, enter)
    drop = QDropEvent(QPointF(20, 20), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, drop)
    return enter.isAccepted(), drop.isAccepted()
