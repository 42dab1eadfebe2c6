"""The stream cards in a grid whose column count follows the width."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QLabel, QScrollArea, QWidget

from .stream_view import CARD_MIN_WIDTH, StreamView


class StreamGrid(QScrollArea):
    """Stream cards in a grid whose column count follows the width."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("streamArea")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.container = QWidget()
        self.container.setObjectName("streamGrid")
        self.grid = QGridLayout(self.container)
        self.grid.setContentsMargins(4, 4, 4, 4)
        self.grid.setSpacing(10)
        self.grid.setAlignment(Qt.AlignmentFlag.AlignTop)
        # Short lines: the middle column of a 1280-pixel window is ~340 pixels wide.
        self.empty = QLabel("Type a system prompt and a few\nuser prompts on the left, then\n"
                            "press Run all (Ctrl+Enter).\n\nOr load a scenario:\nFile → Scenarios.")
        self.empty.setObjectName("emptyState")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.grid.addWidget(self.empty, 0, 0)
        self.setWidget(self.container)
        self.cards: dict[str, StreamView] = {}
        self._order: list[str] = []
        self._columns = 0

    def card(self, uid: str) -> StreamView | None:
        return self.cards.get(uid)

    def uids(self) -> list[str]:
        """The cards' uids in the order they are shown."""
        return list(self._order)

    def add(self, card: StreamView) -> StreamView:
        self.cards[card.uid] = card
        self._order.append(card.uid)
        self._relayout(force=True)
        return card

    def order(self, uids: list[str]) -> None:
        """Show cards of these uids first, in this order (the prompt list's order)."""
        rest = [u for u in self._order if u not in uids]
        new = [u for u in uids if u in self.cards] + rest
        if new != self._order:
            self._order = new
            self._relayout(force=True)

    def ensure_visible(self, uid: str) -> None:
        card = self.cards.get(uid)
        if card is not None:
            self.ensureWidgetVisible(card, 0, 0)

    def _column_count(self) -> int:
        width = self.viewport().width()
        return max(1, min(3, width // (CARD_MIN_WIDTH + 20)))

    def _relayout(self, force: bool = False) -> None:
        cols = self._column_count()
        if not force and cols == self._columns:
            return
        self._columns = cols
        self.empty.setVisible(not self.cards)
        for card in self.cards.values():
            self.grid.removeWidget(card)
        for c in range(3):
            self.grid.setColumnStretch(c, 1 if c < cols else 0)
        for i, uid in enumerate(self._order):
            self.grid.addWidget(self.cards[uid], i // cols, i % cols)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._relayout()
