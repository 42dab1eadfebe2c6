"""Helpers for the GUI tests: settings changes, drops, error boxes (the fixtures are in conftest.py)."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent  # noqa: E402
from PySide6.QtWidgets import QApplication, QMessageBox  # noqa: E402

from app.desktop.settings import AppSettings  # noqa: E402

SYSTEM = ("You are the assistant of Bolt & Board, a neighbourhood hardware store. We sell power drills, "
          "hand saws, screws, nails, paint and ladders. Answer in one short sentence.")
PROMPTS = ["Do you sell drills?", "Do you have green paint?", "Can I buy a ladder here?"]
LOAD_TIMEOUT_MS = 120_000
RUN_TIMEOUT_MS = 240_000


class Errors(list):
    """Every message a controller reports (its `error` signal)."""

    def __init__(self, controller):
        super().__init__()
        controller.error.connect(lambda title, message: self.append(message))


def error_boxes(window) -> list[QMessageBox]:
    return [b for b in window.findChildren(QMessageBox)
            if b.isVisible() and b.icon() == QMessageBox.Icon.Critical]


def close_boxes(window) -> None:
    for box in error_boxes(window):
        box.close()


def set_settings(desktop, **changes) -> AppSettings:
    """Apply settings changes the way the Settings dialog does."""
    c = desktop.controller
    s = AppSettings.from_dict({**c.settings.to_dict(), **changes})
    c.apply_settings(s)
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
