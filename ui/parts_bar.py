"""Where one prompt's tokens went (docs/design.md §15) as a thin stacked bar, and the words for
a tooltip: cached (pool, disk), lent, cap, rounding, evicted, isolated, new. Plain data in: a
{part: tokens} dict as records and reports carry it."""

from __future__ import annotations

from html import escape

from PySide6.QtCore import QRectF, QSize
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from .colors import PART_COLORS, PART_WORDS

# The bar's segments, left to right (`disk` is drawn as its own share of `cached`).
SEGMENTS = ("disk", "cached", "lent", "cap", "rounding", "evicted", "isolated", "new")


def segments(parts: dict | None) -> list[tuple[str, int]]:
    """(part, tokens) left to right, zero parts left out; `cached` less its `disk` share."""
    if not parts:
        return []
    sizes = dict(parts)
    sizes["cached"] = max(0, int(sizes.get("cached", 0)) - int(sizes.get("disk", 0)))
    return [(name, int(sizes.get(name, 0))) for name in SEGMENTS if int(sizes.get(name, 0)) > 0]


def parts_html(parts: dict | None, diverged_at: int | None = None, words: str = "") -> str:
    """The parts as rows of a tooltip, with where the prompt departed from an earlier one."""
    if not parts:
        return ""
    total = sum(n for _, n in segments(parts))
    rows = "".join(
        f"<tr><td><span style='color:{PART_COLORS[name]}'>■</span> {escape(PART_WORDS[name])}</td>"
        f"<td align='right'>&nbsp;{n:,}</td><td align='right'>&nbsp;{100 * n / total:.0f}%</td></tr>"
        for name, n in segments(parts)) if total else ""
    where = ""
    if diverged_at is not None:
        where = f"<div>departs from an earlier prompt at token {diverged_at:,}"
        where += f": <i>{escape(words)}</i></div>" if words else "</div>"
    return f"<b>Where the {total:,} prompt tokens went</b><table cellspacing='0'>{rows}</table>{where}"


class PartsBar(QWidget):
    """A few pixels high, the card's width: each part's share of the prompt in its colour."""

    HEIGHT = 6

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setFixedHeight(self.HEIGHT)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self._segments: list[tuple[str, int]] = []
        self.hide()

    def set_parts(self, parts: dict | None, diverged_at: int | None = None, words: str = "") -> None:
        """Show a request's parts (None or empty: hide the bar)."""
        self._segments = segments(parts)
        self.setToolTip(parts_html(parts, diverged_at, words))
        self.setVisible(bool(self._segments))
        self.update()

    def shown(self) -> dict[str, int]:
        """The segments drawn now, {part: tokens}."""
        return dict(self._segments)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        return QSize(120, self.HEIGHT)

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt's name
        total = sum(n for _, n in self._segments)
        if not total:
            return
        p = QPainter(self)
        try:
            x, width = 0.0, float(self.width())
            for name, n in self._segments:
                w = width * n / total
                p.fillRect(QRectF(x, 0, w, self.height()), QColor(PART_COLORS[name]))
                x += w
        finally:
            p.end()
