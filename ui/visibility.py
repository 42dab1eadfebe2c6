"""When a panel's work would be wasted: its window is on screen but it is not."""

from __future__ import annotations

from PySide6.QtWidgets import QWidget


def hidden_in_window(w: QWidget) -> bool:
    """The window is on screen but `w` is not (another tab, or the window minimized): drawing
    it is wasted, so the panel keeps the data and draws it once shown."""
    win = w.window()
    return win is not w and win.isVisible() and (not w.isVisible() or win.isMinimized())
