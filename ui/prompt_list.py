"""The list of user prompts: add, edit, remove, duplicate, reorder, run one alone."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from .theme import card_button

UID_ROLE = Qt.ItemDataRole.UserRole


class PromptList(QWidget):
    """Prompts, each with a stable uid (its stream view keeps the uid across edits)."""

    run_requested = Signal(str)     # uid of a prompt to run alone
    changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self._next_uid = 1
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(4)

        head = QHBoxLayout()
        title = QLabel("USER PROMPTS")
        title.setObjectName("panelTitle")
        head.addWidget(title)
        head.addStretch(1)
        self.scenario_button = card_button("scenario", "Load a scenario")
        self.scenario_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        head.addWidget(self.scenario_button)
        self.run_button = card_button("run-one", "Run the selected prompt alone (Ctrl+R)", self._run_selected)
        self.duplicate_button = card_button("duplicate", "Duplicate the selected prompt",
                                            self.duplicate_selected)
        self.remove_button = card_button("remove", "Remove the selected prompt (Delete)",
                                         self.remove_selected)
        for b in (self.run_button, self.duplicate_button, self.remove_button):
            head.addWidget(b)
        lay.addLayout(head)

        self.list = QListWidget()
        self.list.setObjectName("promptList")
        self.list.setWordWrap(True)
        self.list.setAlternatingRowColors(False)
        self.list.setDragDropMode(QAbstractItemView.DragDropMode.InternalMove)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                  | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.list.itemChanged.connect(self._item_changed)
        self.list.model().rowsMoved.connect(self.changed)
        self.list.currentItemChanged.connect(self._update_buttons)
        self.list.itemActivated.connect(self._activated)
        lay.addWidget(self.list, 1)

        add_row = QHBoxLayout()
        self.entry = QLineEdit()
        self.entry.setPlaceholderText("Type a prompt and press Enter to add it")
        self.entry.returnPressed.connect(self._add_from_entry)
        add_row.addWidget(self.entry, 1)
        self.add_button = card_button("add", "Add the prompt", self._add_from_entry)
        add_row.addWidget(self.add_button)
        lay.addLayout(add_row)
        self._update_buttons()

    # queries ----------------------------------------------------------------
    def prompts(self) -> list[tuple[str, str]]:
        """(uid, text) of every prompt, in list order, blank ones skipped."""
        out = []
        for i in range(self.list.count()):
            item = self.list.item(i)
            text = item.text().strip()
            if text:
                out.append((item.data(UID_ROLE), text))
        return out

    def text_of(self, uid: str) -> str | None:
        item = self._item(uid)
        return item.text().strip() if item is not None else None

    def selected(self) -> tuple[str, str] | None:
        item = self.list.currentItem()
        if item is None or not item.text().strip():
            return None
        return item.data(UID_ROLE), item.text().strip()

    def count(self) -> int:
        return self.list.count()

    # edits ------------------------------------------------------------------
    def add_prompt(self, text: str, uid: str | None = None) -> str:
        """Append a prompt; return its uid."""
        if uid is None:
            uid = f"p{self._next_uid}"
        if uid[1:].isdigit():  # restored uids must not collide with new ones
            self._next_uid = max(self._next_uid, int(uid[1:]) + 1)
        item = QListWidgetItem(text.strip())
        item.setData(UID_ROLE, uid)
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
        item.setToolTip("Double-click to edit; drag to reorder")
        self.list.blockSignals(True)
        self.list.addItem(item)
        self.list.blockSignals(False)
        self.list.setCurrentItem(item)
        self.changed.emit()
        return uid

    def set_prompts(self, texts) -> list[str]:
        """Replace every prompt (a list of texts, or of (uid, text)); return the uids."""
        self.list.clear()
        uids = []
        for entry in texts:
            if isinstance(entry, (tuple, list)):
                uids.append(self.add_prompt(entry[1], uid=entry[0]))
            else:
                uids.append(self.add_prompt(entry))
        self.changed.emit()
        return uids

    def remove_selected(self) -> None:
        row = self.list.currentRow()
        if row >= 0:
            self.list.takeItem(row)
            self.changed.emit()
        self._update_buttons()

    def duplicate_selected(self) -> str | None:
        sel = self.selected()
        if sel is None:
            return None
        uid = self.add_prompt(sel[1])
        return uid

    def select(self, uid: str) -> None:
        item = self._item(uid)
        if item is not None:
            self.list.setCurrentItem(item)

    # internals ----------------------------------------------------------------
    def _item(self, uid: str) -> QListWidgetItem | None:
        for i in range(self.list.count()):
            if self.list.item(i).data(UID_ROLE) == uid:
                return self.list.item(i)
        return None

    def _add_from_entry(self) -> None:
        text = self.entry.text().strip()
        if text:
            self.add_prompt(text)
            self.entry.clear()

    def _run_selected(self) -> None:
        sel = self.selected()
        if sel is not None:
            self.run_requested.emit(sel[0])

    def _activated(self, item: QListWidgetItem) -> None:
        self.list.setCurrentItem(item)

    def _item_changed(self, item: QListWidgetItem) -> None:
        self.changed.emit()

    def _update_buttons(self, *_) -> None:
        has = self.list.currentItem() is not None
        for b in (self.run_button, self.duplicate_button, self.remove_button):
            b.setEnabled(has)

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.key() == Qt.Key.Key_Delete and self.list.hasFocus() and \
                self.list.state() != QAbstractItemView.State.EditingState:
            self.remove_selected()
            return
        super().keyPressEvent(event)
