"""The cached chains as a sortable table; selecting one tells the page map which pages to outline."""

from __future__ import annotations

import html
import time

from PySide6.QtCore import (
    QAbstractTableModel,
    QItemSelectionModel,
    QModelIndex,
    QSortFilterProxyModel,
    Qt,
    Signal,
)
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableView, QWidget

from engine.prefix_records import ChainRecord

COLUMNS = ("id", "tokens", "pages live", "hits", "preview", "age", "idle", "pin")
COL_ID, COL_TOKENS, COL_PAGES, COL_HITS, COL_PREVIEW, COL_AGE, COL_IDLE, COL_PIN = range(len(COLUMNS))
HEADER_TIPS = (
    "chain id (one chain: the pages one insert added)",
    "tokens in the pages this chain added",
    "pages of this chain still in the cache",
    "attaches whose deepest matched page is in this chain",
    "the request that made the chain",
    "time since the chain was made",
    "time since its last hit (or since it was made)",
    "pinned: its pages are never evicted (they count against the cache budget); click to toggle",
)
SORT_ROLE = Qt.ItemDataRole.UserRole
CHAIN_ID_ROLE = Qt.ItemDataRole.UserRole + 1


def humanize_seconds(seconds: float) -> str:
    """3 s, 2 min 5 s, 1 h 3 min, 2 d 4 h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


class ChainsModel(QAbstractTableModel):
    """Rows of ChainRecord; updated in place by id so views keep their selection."""

    pin_toggled = Signal(int, bool)  # chain id, pinned: a click on the pin column's box

    def __init__(self, parent=None):
        super().__init__(parent)
        self._chains: list[ChainRecord] = []
        self._row_of: dict[int, int] = {}
        self.now = time.time()

    def rowCount(self, parent=None) -> int:  # noqa: N802 - Qt's name
        return 0 if parent is not None and parent.isValid() else len(self._chains)

    def columnCount(self, parent=None) -> int:  # noqa: N802
        return 0 if parent is not None and parent.isValid() else len(COLUMNS)

    def chain_at(self, row: int) -> ChainRecord:
        return self._chains[row]

    def row_of(self, chain_id: int) -> int | None:
        return self._row_of.get(chain_id)

    def chain_ids(self) -> list[int]:
        return [c.id for c in self._chains]

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):  # noqa: N802
        if orientation != Qt.Orientation.Horizontal:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        if role == Qt.ItemDataRole.ToolTipRole:
            return HEADER_TIPS[section]
        return None

    def _age(self, c: ChainRecord) -> float:
        return max(0.0, self.now - c.created_at)

    def _idle(self, c: ChainRecord) -> float:
        return max(0.0, self.now - (c.last_hit_at if c.last_hit_at is not None else c.created_at))

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        c = self._chains[index.row()]
        col = index.column()
        if col == COL_PIN and role in (Qt.ItemDataRole.CheckStateRole, SORT_ROLE,
                                       Qt.ItemDataRole.DisplayRole):
            if role == Qt.ItemDataRole.CheckStateRole:
                return Qt.CheckState.Checked if c.pinned else Qt.CheckState.Unchecked
            return int(c.pinned) if role == SORT_ROLE else ""
        if role == Qt.ItemDataRole.DisplayRole:
            if col == COL_ID:
                return f"#{c.id}"
            if col == COL_PREVIEW:
                return " ".join(c.preview.split())  # one line: newlines and runs of spaces collapse
            if col == COL_AGE:
                return humanize_seconds(self._age(c))
            if col == COL_IDLE:
                return humanize_seconds(self._idle(c))
            return f"{self._number(c, col):,}"
        if role == SORT_ROLE:
            if col == COL_PREVIEW:
                return c.preview.casefold()
            if col == COL_AGE:
                return self._age(c)
            if col == COL_IDLE:
                return self._idle(c)
            return self._number(c, col)
        if role == CHAIN_ID_ROLE:
            return c.id
        if role == Qt.ItemDataRole.TextAlignmentRole:
            if col == COL_PREVIEW:
                return int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role == Qt.ItemDataRole.ToolTipRole and col == COL_PREVIEW:
            return f"<pre style='white-space:pre-wrap'>{html.escape(c.preview)}</pre>"
        return None

    def flags(self, index):
        base = super().flags(index)
        return base | Qt.ItemFlag.ItemIsUserCheckable if index.column() == COL_PIN else base

    def setData(self, index, value, role=Qt.ItemDataRole.EditRole) -> bool:  # noqa: N802 - Qt's name
        """A click on a pin box asks for the toggle; the engine's next snapshot shows the result."""
        if role != Qt.ItemDataRole.CheckStateRole or index.column() != COL_PIN or not index.isValid():
            return False
        c = self._chains[index.row()]
        c.pinned = Qt.CheckState(value) == Qt.CheckState.Checked
        self.dataChanged.emit(index, index)
        self.pin_toggled.emit(c.id, c.pinned)
        return True

    @staticmethod
    def _number(c: ChainRecord, col: int) -> int:
        return {COL_ID: c.id, COL_TOKENS: c.n_tokens, COL_PAGES: c.pages_live, COL_HITS: c.hits}[col]

    def set_chains(self, chains: list[ChainRecord], now: float | None = None) -> None:
        """Replace the rows, matching them by chain id: removals, in-place changes, then appends."""
        self.now = time.time() if now is None else now
        new = {c.id: c for c in chains}
        gone = [i for i, c in enumerate(self._chains) if c.id not in new]
        for row in reversed(gone):  # contiguous runs would be fewer signals; chains are few
            self.beginRemoveRows(QModelIndex(), row, row)
            del self._chains[row]
            self.endRemoveRows()
        for i, c in enumerate(self._chains):
            self._chains[i] = new[c.id]
        if self._chains:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self._chains) - 1, len(COLUMNS) - 1))
        have = {c.id for c in self._chains}
        added = [c for c in chains if c.id not in have]
        if added:
            first = len(self._chains)
            self.beginInsertRows(QModelIndex(), first, first + len(added) - 1)
            self._chains.extend(added)
            self.endInsertRows()
        self._row_of = {c.id: i for i, c in enumerate(self._chains)}


class ChainsTable(QTableView):
    """Cached chains (id, tokens, pages live, hits, preview, age, idle); sortable, one row selectable."""

    chain_selected = Signal(object)  # chain id, or None when nothing is selected
    pin_toggled = Signal(int, bool)  # chain id, pinned

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.chains_model = ChainsModel(self)
        self.chains_model.pin_toggled.connect(self.pin_toggled)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.chains_model)
        self.proxy.setSortRole(SORT_ROLE)
        self.proxy.setDynamicSortFilter(True)
        self.setModel(self.proxy)
        self.setSortingEnabled(True)
        self.sortByColumn(COL_ID, Qt.SortOrder.AscendingOrder)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setAlternatingRowColors(True)
        self.setShowGrid(False)
        self.setWordWrap(False)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setMinimumSize(320, 110)
        vh = self.verticalHeader()
        vh.setVisible(False)
        vh.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        vh.setDefaultSectionSize(self.fontMetrics().height() + 8)
        hh = self.horizontalHeader()
        hh.setHighlightSections(False)
        hh.setStretchLastSection(False)
        for col in range(len(COLUMNS)):
            hh.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        hh.setSectionResizeMode(COL_PREVIEW, QHeaderView.ResizeMode.Stretch)
        self._last_emitted: object = None
        self._updating = False
        self.selectionModel().selectionChanged.connect(self._on_selection)

    # public -----------------------------------------------------------
    def set_chains(self, chains: list[ChainRecord], now: float | None = None) -> None:
        """Show these chains; the selection (by chain id), sort order and scroll position survive."""
        selected = self.selected_chain()
        scroll = self.verticalScrollBar().value()
        self._updating = True  # no chain_selected while rows move; one signal after, if it changed
        try:
            self.chains_model.set_chains(chains, now)
            if selected is None or self.chains_model.row_of(selected) is None:
                # Qt moves the selection to a neighbour when the selected row goes; that would
                # outline a chain nobody picked.
                self.selectionModel().clearSelection()
            elif self.selected_chain() != selected:
                self.select_chain(selected)  # a safety net: rows update in place, so this rarely runs
        finally:
            self._updating = False
        self.verticalScrollBar().setValue(scroll)
        self._emit_if_changed()

    def selected_chain(self) -> int | None:
        rows = self.selectionModel().selectedRows() if self.selectionModel() else []
        if not rows:
            return None
        return self.proxy.data(rows[0], CHAIN_ID_ROLE)

    def select_chain(self, chain_id: int | None) -> bool:
        """Select a chain's row (None clears); False when the chain is not in the table."""
        sm = self.selectionModel()
        if chain_id is None:
            sm.clearSelection()
            return True
        row = self.chains_model.row_of(chain_id)
        if row is None:
            return False
        index = self.proxy.mapFromSource(self.chains_model.index(row, 0))
        sm.select(index, QItemSelectionModel.SelectionFlag.ClearAndSelect
                  | QItemSelectionModel.SelectionFlag.Rows)
        sm.setCurrentIndex(index, QItemSelectionModel.SelectionFlag.NoUpdate)
        self.scrollTo(index)
        return True

    def visible_chain_order(self) -> list[int]:
        """Chain ids in the order the view shows them (after sorting)."""
        return [self.proxy.data(self.proxy.index(r, 0), CHAIN_ID_ROLE) for r in range(self.proxy.rowCount())]

    # internals --------------------------------------------------------
    def _on_selection(self, *_):
        self._emit_if_changed()

    def _emit_if_changed(self) -> None:
        if self._updating:
            return
        chain = self.selected_chain()
        if chain != self._last_emitted:
            self._last_emitted = chain
            self.chain_selected.emit(chain)


__all__ = ["ChainsTable", "ChainsModel", "humanize_seconds"]
