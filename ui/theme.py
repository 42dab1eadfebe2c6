"""Light and dark themes: the Fusion style, a palette, and a stylesheet from resources/styles."""

from __future__ import annotations

import os

from PySide6.QtCore import QSize
from PySide6.QtGui import QColor, QIcon, QPalette
from PySide6.QtWidgets import QApplication, QLabel, QStyleFactory, QToolButton, QVBoxLayout, QWidget

RESOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "resources")
STYLES_DIR = os.path.join(RESOURCES, "styles")
ICONS_DIR = os.path.join(RESOURCES, "icons")
THEMES = ("light", "dark")

# The few colours code needs (the rest lives in the .qss files).
COLORS = {
    "light": {"window": "#f4f5f7", "base": "#ffffff", "alt": "#f8fafc", "text": "#1f2937",
              "muted": "#6b7280", "border": "#d9dde3", "accent": "#2563eb", "button": "#ffffff",
              "user": "#1d4ed8", "stopped": "#b45309", "error": "#b91c1c", "highlight_text": "#ffffff"},
    "dark": {"window": "#1b1d22", "base": "#23262d", "alt": "#292c34", "text": "#e5e7eb",
             "muted": "#9ca3af", "border": "#3a3f4a", "accent": "#60a5fa", "button": "#2b2f37",
             "user": "#93c5fd", "stopped": "#fbbf24", "error": "#f87171", "highlight_text": "#0b1220"},
}

_current = "light"


def current_theme() -> str:
    return _current


def color(name: str) -> str:
    """A named colour of the current theme, e.g. color('muted')."""
    return COLORS[_current][name]


def icon(name: str) -> QIcon:
    """An icon from resources/icons (an empty icon if the file is missing)."""
    path = os.path.join(ICONS_DIR, f"{name}.svg")
    return QIcon(path) if os.path.isfile(path) else QIcon()


def card_button(name: str, tip: str, slot=None, size: int = 18) -> QToolButton:
    """A flat icon button styled as the cards' ("cardButton"), calling `slot` when clicked."""
    b = QToolButton()
    b.setObjectName("cardButton")
    b.setIcon(icon(name))
    b.setIconSize(QSize(size, size))
    b.setToolTip(tip)
    b.setAutoRaise(True)
    if slot is not None:
        b.clicked.connect(slot)
    return b


def titled_box(title: str, body: QWidget, margins: tuple[int, int, int, int] = (0, 0, 0, 0)) -> QWidget:
    """A panel: its title in the panels' caps style ("panelTitle") above `body`, which takes the rest."""
    box = QWidget()
    lay = QVBoxLayout(box)
    lay.setContentsMargins(*margins)
    lay.setSpacing(4)
    head = QLabel(title)
    head.setObjectName("panelTitle")
    lay.addWidget(head)
    lay.addWidget(body, 1)
    return box


def palette(theme: str) -> QPalette:
    c = COLORS[theme]
    p = QPalette()
    roles = {
        QPalette.ColorRole.Window: c["window"], QPalette.ColorRole.WindowText: c["text"],
        QPalette.ColorRole.Base: c["base"], QPalette.ColorRole.AlternateBase: c["alt"],
        QPalette.ColorRole.Text: c["text"], QPalette.ColorRole.Button: c["button"],
        QPalette.ColorRole.ButtonText: c["text"], QPalette.ColorRole.ToolTipBase: c["base"],
        QPalette.ColorRole.ToolTipText: c["text"], QPalette.ColorRole.Highlight: c["accent"],
        QPalette.ColorRole.HighlightedText: c["highlight_text"],
        QPalette.ColorRole.PlaceholderText: c["muted"], QPalette.ColorRole.Link: c["accent"],
        QPalette.ColorRole.BrightText: c["error"],
    }
    for role, value in roles.items():
        p.setColor(role, QColor(value))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(c["muted"]))
    return p


def stylesheet(theme: str) -> str:
    with open(os.path.join(STYLES_DIR, f"{theme}.qss"), encoding="utf-8") as fh:
        return fh.read()


def apply_theme(app: QApplication, theme: str) -> str:
    """Style the whole application; an unknown name falls back to light. Returns the name used."""
    global _current
    theme = theme if theme in THEMES else "light"
    _current = theme
    fusion = QStyleFactory.create("Fusion")
    if fusion is not None:
        app.setStyle(fusion)
    app.setPalette(palette(theme))
    app.setStyleSheet(stylesheet(theme))
    return theme


def repolish(widget: QWidget) -> None:
    """Re-apply the stylesheet after a dynamic property used by a selector changed."""
    widget.style().unpolish(widget)
    widget.style().polish(widget)
