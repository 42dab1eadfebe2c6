"""The Advisor tab: what hosted APIs' prompt caches make of a trace or of the proxy's live traffic.

A plain widget: it shows the rows, the divergence groups and the what-if it is given and
asks for work through signals; the app's controller runs the advisor and the proxy.
"""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

HIGHLIGHT = "#ffd54f"
HINT_HEAD = "what would make it cache"


def _table(head: list[str]) -> QTableWidget:
    t = QTableWidget(0, len(head))
    t.setHorizontalHeaderLabels(head)
    t.verticalHeader().setVisible(False)
    return t


def _fill(table: QTableWidget, head: list[str], rows: list[list[str]]) -> None:
    table.setColumnCount(len(head))
    table.setHorizontalHeaderLabels(head)
    table.setRowCount(len(rows))
    right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
    for i, row in enumerate(rows):
        for j, text in enumerate(row):
            item = QTableWidgetItem(text)
            if j:  # names left, numbers right
                item.setTextAlignment(right)
            table.setItem(i, j, item)
    table.resizeColumnsToContents()


class AdvisorPanel(QWidget):
    """Trace and proxy controls, totals per provider, divergence groups, the what-if."""

    load_requested = Signal()                 # "Load trace…"
    example_requested = Signal()              # "Try the example": the shipped trace
    proxy_requested = Signal(bool, str, int)  # on/off, upstream URL, port

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.trace_label = QLabel()
        self.trace_label.setWordWrap(True)
        self.load_button = QPushButton("Load trace…")
        self.example_button = QPushButton("Try the example")
        self.example_button.setObjectName("primary")
        self.example_button.setToolTip("Advise on the shipped example: 20 chat requests whose system prompt "
                                       "starts with the time of day")
        self.upstream = QLineEdit()
        self.upstream.setPlaceholderText("upstream, e.g. https://api.openai.com/v1")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setValue(8001)
        self.proxy_button = QPushButton("Start proxy")
        self.proxy_button.setCheckable(True)
        self.proxy_label = QLabel()
        self.proxy_label.setWordWrap(True)
        self.error = QLabel()
        self.error.setObjectName("advisorError")
        self.error.setWordWrap(True)
        self.error.setVisible(False)
        self.totals = _table([])
        self.totals.setWordWrap(True)
        self.groups = QTextBrowser()
        self.groups.setOpenExternalLinks(False)
        self.whatif_label = QLabel()
        self.whatif_label.setWordWrap(True)
        self.whatif = _table([])

        top = QHBoxLayout()
        top.addWidget(self.trace_label, 1)
        top.addWidget(self.example_button)
        top.addWidget(self.load_button)
        proxy = QHBoxLayout()
        proxy.addWidget(QLabel("Proxy"))
        proxy.addWidget(self.upstream, 1)
        proxy.addWidget(QLabel("port"))
        proxy.addWidget(self.port)
        proxy.addWidget(self.proxy_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addLayout(proxy)
        layout.addWidget(self.proxy_label)
        layout.addWidget(self.error)
        layout.addWidget(QLabel("Per provider (each rule set's as-of date and source: hover the name)"))
        layout.addWidget(self.totals, 3)
        layout.addWidget(QLabel("Where prompts diverge"))
        layout.addWidget(self.groups, 2)
        layout.addWidget(self.whatif_label)
        layout.addWidget(self.whatif, 3)

        self.load_button.clicked.connect(self.load_requested)
        self.example_button.clicked.connect(self.example_requested)
        self.proxy_button.toggled.connect(self._proxy_toggled)
        self.set_trace(None)
        self.set_proxy(None)

    # what the controller tells it ------------------------------------------------------
    def set_trace(self, description: str | None) -> None:
        self.trace_label.setText(description or "No traffic yet: try the example, load a chat log or a "
                                                "proxy recording, or start the proxy")

    def set_proxy(self, status: str | None) -> None:
        """The proxy's state in words (None: off); the button follows."""
        self.proxy_label.setText(status or "")
        self.proxy_label.setVisible(bool(status))
        self.proxy_button.blockSignals(True)
        self.proxy_button.setChecked(status is not None)
        self.proxy_button.setText("Stop proxy" if status is not None else "Start proxy")
        self.proxy_button.blockSignals(False)
        self.upstream.setEnabled(status is None)
        self.port.setEnabled(status is None)

    def set_busy(self, busy: bool) -> None:
        self.load_button.setEnabled(not busy)
        self.example_button.setEnabled(not busy)

    def show_error(self, message: str | None) -> None:
        self.error.setText(message or "")
        self.error.setVisible(bool(message))

    def set_totals(self, head: list[str], rows: list[list[str]], tips: list[str],
                   hints: list[str] = ()) -> None:
        """One row per rule set; `tips[i]` (as of, source, note) shows over row i's name, and
        `hints[i]` (what would make that provider cache) beside it, where a person reads first."""
        if hints:
            head = [head[0], HINT_HEAD, *head[1:]]
            rows = [[r[0], h, *r[1:]] for r, h in zip(rows, hints)]
        _fill(self.totals, head, rows)
        for i, tip in enumerate(tips):
            self.totals.item(i, 0).setToolTip(tip)
        for i, hint in enumerate(hints):
            self.totals.item(i, 1).setToolTip(hint)
            self.totals.item(i, 1).setTextAlignment(Qt.AlignmentFlag.AlignLeft
                                                    | Qt.AlignmentFlag.AlignVCenter)
        if hints:  # the sentence wraps in a column of its own; the figures follow, scrolled to
            self.totals.setColumnWidth(1, 380)
            self.totals.resizeRowsToContents()

    def hint(self, row: int) -> str:
        """The "what would make it cache" line of a provider's row ("" when none is shown)."""
        head = self.totals.horizontalHeaderItem(1)
        return self.totals.item(row, 1).text() if head is not None and head.text() == HINT_HEAD else ""

    def set_groups(self, groups: list[dict]) -> None:
        """Divergence groups: each a `summary`, and an example's `before` text and differing `text`."""
        if not groups:
            self.groups.setHtml("<p>No request departs from an earlier one: each extends or repeats "
                                "another.</p>")
            return
        parts = [f"<p><b>{escape(g['summary'])}</b><br><code>…{escape(g['before'])}"
                 f"<span style='background:{HIGHLIGHT};color:#000'>{escape(g['text'])}</span>…</code></p>"
                 for g in groups]
        self.groups.setHtml("".join(parts))

    def set_whatif(self, fix: str | None, head: list[str], rows: list[list[str]]) -> None:
        """The fix in words and, per rule set, before and after."""
        self.whatif_label.setText(f"What if you {fix}:" if fix else "What-if: no divergence to fix")
        _fill(self.whatif, head, rows if fix else [])

    # what it asks for ------------------------------------------------------------------
    def _proxy_toggled(self, on: bool) -> None:
        self.proxy_requested.emit(on, self.upstream.text().strip(), self.port.value())
