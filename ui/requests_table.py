"""The Requests tab: one row per finished request, in the words of docs/design.md §6."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from .format import secs
from .parts_bar import parts_html

# Where the prompt tokens went (docs/design.md §15): the parts beside "Cached", then where the
# prompt departed from an earlier one, in its own words.
PART_COLUMNS = {"disk": "Disk", "lent": "Lent", "cap": "Cap", "rounding": "Rounding", "evicted": "Evicted",
                "isolated": "Isolated", "new": "New"}
COLUMNS = ["Req", "Prompt", "Prompt tok", "Cached", *PART_COLUMNS.values(), "Diverged at", "Prefilled",
           "Generated", "Queue", "TTFT", "tok/s", "Drafts acc.", "Finish", "Client"]


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
        parts = r.parts.as_dict() if r.parts is not None else {}
        where = "—" if r.diverged_at is None else f"{r.diverged_at}: {r.diverged_words!r}"
        values = [r.id, r.preview, r.n_prompt, r.n_cached, *(parts.get(k, 0) for k in PART_COLUMNS), where,
                  r.n_prefilled, r.n_gen, secs(r.queue_wait_s), secs(r.ttft_s), tps, drafts, r.finish_reason,
                  r.client]
        for col, v in enumerate(values):
            item = QTableWidgetItem(str(v))
            if isinstance(v, (int, float)):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self.setItem(row, col, item)
        tip = parts_html(parts, r.diverged_at, r.diverged_words)
        for col in range(COLUMNS.index("Cached"), COLUMNS.index("Diverged at") + 1):
            self.item(row, col).setToolTip(tip)
        self.scrollToBottom()
