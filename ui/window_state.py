"""The main window's geometry, dock state, splitters, current tab and theme, kept in QSettings.

The keys are those of every earlier version, so a saved layout survives an upgrade.
"""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings
from PySide6.QtWidgets import QApplication, QMainWindow, QSplitter, QTabWidget

from .theme import apply_theme, current_theme

DEFAULT_SIZE = (1400, 900)
THEME_KEY = "view/theme"


def default_size() -> tuple[int, int]:
    """DEFAULT_SIZE, shrunk to the primary screen's free area (a 1280x800 desktop shows all of it)."""
    app = QApplication.instance()
    screen = app.primaryScreen() if app is not None else None
    if screen is None or app.platformName() in ("offscreen", "minimal"):
        return DEFAULT_SIZE  # no real screen (its 800x600 stand-in would only squeeze the window)
    free = screen.availableGeometry()
    return min(DEFAULT_SIZE[0], free.width()), min(DEFAULT_SIZE[1], free.height())


def saved_theme(store: QSettings) -> str:
    """The remembered theme name (the current one when none is saved)."""
    return str(store.value(THEME_KEY, current_theme()))


def restore_window(store: QSettings, window: QMainWindow, splitters: dict[str, QSplitter],
                   tabs: QTabWidget) -> bool:
    """Apply the saved layout; True when a saved splitter layout was found."""
    theme = saved_theme(store)
    if theme != current_theme() and QApplication.instance() is not None:
        apply_theme(QApplication.instance(), theme)
    geometry = store.value("window/geometry")
    if isinstance(geometry, QByteArray) and not geometry.isEmpty():
        window.restoreGeometry(geometry)
    else:
        window.resize(*default_size())
    restored = False
    targets = {"window/state": window.restoreState,
               **{f"window/{name}": s.restoreState for name, s in splitters.items()}}
    for key, target in targets.items():
        value = store.value(key)
        if isinstance(value, QByteArray) and not value.isEmpty():
            target(value)
            restored = True
    tab = store.value("window/tab")
    if tab is not None:
        try:
            tabs.setCurrentIndex(int(tab))
        except (TypeError, ValueError):
            pass
    return restored


def save_window(store: QSettings, window: QMainWindow, splitters: dict[str, QSplitter],
                tabs: QTabWidget) -> None:
    """Remember the layout and the theme (synced by the caller)."""
    store.setValue("window/geometry", window.saveGeometry())
    store.setValue("window/state", window.saveState())
    for name, s in splitters.items():
        store.setValue(f"window/{name}", s.saveState())
    store.setValue("window/tab", tabs.currentIndex())
    store.setValue(THEME_KEY, current_theme())
