"""Cache-friendliness of served traffic: one row per HTTP client, and where its prompts miss."""

from __future__ import annotations

from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem, QWidget

COLUMNS = ("client", "requests", "hit rate", "prefill saved", "misses differ at")
HEADER_TIPS = (
    "where the requests came from: remote address, the model and user fields",
    "requests answered",
    "prompt tokens attached from the cache / prompt tokens (saved / (saved + computed))",
    "prompt tokens the cache spared the model",
    "the most common first differences from the nearest cached prompt: token position, the "
    "shared text before it, then this prompt's token vs the cached one",
)


def describe_miss(miss: dict) -> str:
    """`@21 x3: …30T22:4 [2 | 1]`: position, count, the shared text, this token vs the cached one."""
    context = miss["context"][-24:].replace("\n", "⏎")
    return (f"@{miss['position']} x{miss['count']}: …{context} "
            f"[{miss['prompt_token']!s} | {miss['cached_token']!s}]")


class ServedView(QTableWidget):
    """Takes `GET /v1/prefixlab/friendliness`'s dict (plain data) and shows it."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(0, len(COLUMNS), parent)
        self.setHorizontalHeaderLabels(COLUMNS)
        for i, tip in enumerate(HEADER_TIPS):
            self.horizontalHeaderItem(i).setToolTip(tip)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.verticalHeader().setVisible(False)
        header = self.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)

    def set_report(self, report: dict) -> None:
        """One row per client, most requests first."""
        clients = report.get("clients", [])
        self.setRowCount(len(clients))
        for row, c in enumerate(clients):
            misses = c.get("miss_positions") or []
            cells = (c["client"], str(c["requests"]), f"{c['hit_rate']:.0%}", str(c["prefill_tokens_saved"]),
                     "; ".join(describe_miss(m) for m in misses[:3]) or
                     (f"{c['cold_misses']} cold" if c.get("cold_misses") else "none"))
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if col == len(cells) - 1 and misses:
                    item.setToolTip("\n".join(describe_miss(m) for m in misses))
                self.setItem(row, col, item)
