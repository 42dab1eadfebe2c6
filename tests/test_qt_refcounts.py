"""The installed PySide6 must not drop references to None (6.12.0 does on Python 3.11 and aborts)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtGui import QImage, QPainter  # noqa: E402
from PySide6.QtWidgets import QWidget  # noqa: E402


def test_qt_calls_keep_none_and_true_alive(qapp):
    widget = QWidget()
    image = QImage(32, 32, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        before = sys.getrefcount(None), sys.getrefcount(True)
        for _ in range(200):
            painter.drawLine(0, 0, 8, 8)
            widget.setEnabled(True)
        after = sys.getrefcount(None), sys.getrefcount(True)
    finally:
        painter.end()
    # A leaking build loses 200+ references here; a sound one stays within noise.
    assert before[0] - after[0] < 50, "PySide6 drops references to None: see pyproject's pin"
    assert before[1] - after[1] < 50, "PySide6 drops references to True: see pyproject's pin"
