"""The disk tier under the page map: one cell per tier slot, the stored pages in their own colour
(docs/design.md §12), with a tooltip naming the page's chain, positions and text."""

from __future__ import annotations

import html

from PySide6.QtCore import QRect, QSize, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from engine.metrics import PAGE_FREE
from engine.snapshot import TierPageInfo

from .colors import SERIES_COLORS, state_color, theme_for

TIER_COLOR = SERIES_COLORS["disk_hits"]  # the charts' disk-tier hue: one colour for the tier
MAX_CELLS = 2048   # a big tier draws its first slots; the label counts them all
CELL, GAP, LABEL_W, TOP = 10, 2, 74, 2


class DiskTierStrip(QWidget):
    """The disk tier's slots as small cells; hidden while there is no tier."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.capacity = 0
        self.pages: dict[int, TierPageInfo] = {}   # by slot
        self.page_rows = 0
        self.hide()

    def set_tier(self, pages: list[TierPageInfo], capacity: int, page_rows: int) -> None:
        """Show the tier's pages (plain data from the snapshot) out of `capacity` slots."""
        self.capacity, self.page_rows = capacity, page_rows
        self.pages = {p.slot: p for p in pages}
        self.setVisible(capacity > 0)
        self.updateGeometry()
        self.update()

    def label(self) -> str:
        return f"disk tier\n{len(self.pages):,} / {self.capacity:,}"

    def _cols(self) -> int:
        return max(1, (self.width() - LABEL_W + GAP) // (CELL + GAP))

    def _rows(self) -> int:
        n = min(self.capacity, MAX_CELLS)
        return max(1, -(-n // self._cols()))

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        return QSize(400, max(30, self._rows() * (CELL + GAP) + 2 * TOP))

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        return QSize(LABEL_W + 4 * (CELL + GAP), min(self.sizeHint().height(), 120))

    def resizeEvent(self, e) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(e)
        self.setFixedHeight(min(self.sizeHint().height(), 120))

    def cell_rect(self, slot: int) -> QRect:
        row, col = divmod(slot, self._cols())
        return QRect(LABEL_W + col * (CELL + GAP), TOP + row * (CELL + GAP), CELL, CELL)

    def slot_at(self, x: int, y: int) -> int | None:
        if x < LABEL_W:
            return None
        col, row = (x - LABEL_W) // (CELL + GAP), (y - TOP) // (CELL + GAP)
        slot = row * self._cols() + col
        return slot if 0 <= col < self._cols() and 0 <= slot < min(self.capacity, MAX_CELLS) else None

    def paintEvent(self, e) -> None:  # noqa: N802 - Qt's name
        t = theme_for(self)
        p = QPainter(self)
        p.fillRect(self.rect(), QColor(t.background))
        p.setPen(QColor(t.muted))
        p.drawText(QRect(2, 0, LABEL_W - 6, self.height()), Qt.AlignmentFlag.AlignLeft
                   | Qt.AlignmentFlag.AlignVCenter, self.label())
        free, used = state_color(PAGE_FREE, t), QColor(TIER_COLOR)
        p.setPen(Qt.PenStyle.NoPen)
        for slot in range(min(self.capacity, MAX_CELLS)):
            rect = self.cell_rect(slot)
            if rect.top() > self.height():
                break
            p.setBrush(used if slot in self.pages else free)
            p.drawRoundedRect(rect, 2, 2)
        p.end()

    def tooltip_text(self, slot: int) -> str:
        info = self.pages.get(slot)
        if info is None:
            return f"disk tier slot {slot}: empty"
        end = info.first_position + self.page_rows - 1
        return (f"<b>disk tier</b> slot {slot} · chain {info.chain_id} · positions "
                f"{info.first_position}–{end}<br><i>{html.escape(info.text)}</i><br>"
                f"loaded back into the pool on a hit, not recomputed")

    def mouseMoveEvent(self, e) -> None:  # noqa: N802 - Qt's name
        pos = e.position().toPoint()
        slot = self.slot_at(pos.x(), pos.y())
        if slot is None:
            QToolTip.hideText()
        else:
            QToolTip.showText(e.globalPosition().toPoint(), self.tooltip_text(slot), self)
        super().mouseMoveEvent(e)
