"""The Requests tab: one row per finished request, in the words of docs/design.md §6."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from .format import secs

COLUMNS = ["Req", "Prompt", "Prompt tok", "Cached", "Prefilled", "Generated", "Queue", "TTFT", "tok/s",
           "Drafts acc.", "Finish", "Client"]


class RequestsTable(QTableWidget):
    """Finished requests, newest at the bottom."""

    def __init__(self, parent=None):
        super().__init__(0, len(COLUMNS), parent)
        self.setHorizontalHeaderLabels(COLUMNS)
        self.verticalHeader().hide()
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)

    def add_record(self, r) -> None:
        """Append a RequestRecord's row and scroll to it."""
        row = self.rowCount()
        self.insertRow(row)
        tps = f"{r.decode_tps:.1f}" if r.decode_tps else "—"
        drafts = f"{r.spec_acceptance * 100:.1f} %" if r.spec_acceptance is not None else "—"
        values = [r.id, r.preview, r.n_prompt, r.n_cached, r.n_prefilled, r.n_gen, secs(r.queue_wait_s),
                  secs(r.ttft_s), tps, drafts, r.finish_reason, r.client]
        for col, v in enumerate(values):
            item = QTableWidgetItem(str(v))
            if isinstance(v, (int, float)):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self.setItem(row, col, item)
        self.scrollToBottom()
