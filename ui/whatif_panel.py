"""The What-if tab: pick a trace and the knobs, see hit ratio vs capacity per policy.

A plain widget: it shows what it is given (the trace's description, suggested knobs,
progress, result rows, errors) and asks for work through signals; the app's
controller parses the knobs, runs the replay off the UI thread and hands rows back.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from .flow_layout import FlowLayout
from .whatif import POLICY_COLORS, WhatIfChart
from .whatif_cluster import CLUSTER_COLUMNS, ClusterChart, ClusterControls, cluster_cells

COLUMNS = ("page size", "budget", "disk tier", "policy", "token hit ratio", "tokens saved", "hits", "evicted")


def _budget_text(budget: int | None) -> str:
    return "inf" if budget is None else str(budget)


class WhatIfPanel(QWidget):
    """Trace buttons, knob fields, a Run button, the curves and a table of configurations."""

    load_requested = Signal()           # "Load trace…": the controller opens a file dialog
    session_requested = Signal()        # "This session": replay what the app just ran
    run_requested = Signal(str, str, list, str)  # page sizes, budgets, policy names, disk tiers text
    cluster_requested = Signal(str, str, list)  # replicas text, budgets text, router names

    def __init__(self, parent: QWidget | None = None, policies=tuple(POLICY_COLORS)):
        super().__init__(parent)
        self.trace_label = QLabel("No trace loaded")
        self.trace_label.setWordWrap(True)
        self.load_button = QPushButton("Load trace…")
        self.session_button = QPushButton("This session")
        self.page_rows = QLineEdit()
        self.page_rows.setPlaceholderText("the trace's own, e.g. 16,32,64")
        self.budgets = QLineEdit("inf")
        self.budgets.setPlaceholderText("pages: inf, 30000, 10000, ...")
        self.disk_budgets = QLineEdit()
        self.disk_budgets.setPlaceholderText("none; e.g. 10000, 30000")
        self.disk_budgets.setToolTip("Pages of a disk tier under each capacity: evicted pages move there "
                                     "and hit again; one curve per tier, beside the one-tier curve")
        self.policies = {name: QCheckBox(name) for name in policies}
        self.run_button = QPushButton("Run")
        self.progress = QProgressBar()
        self.progress.setVisible(False)
        self.error = QLabel()
        self.error.setObjectName("whatifError")
        self.error.setWordWrap(True)
        self.error.setVisible(False)
        self.chart = WhatIfChart(self)
        self.cluster = ClusterControls(self)  # replicas behind routers (docs/design.md §13)
        self.cluster_chart = ClusterChart(self)
        self.cluster_chart.setVisible(False)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setMaximumHeight(180)

        top = QHBoxLayout()
        top.addWidget(self.trace_label, 1)
        top.addWidget(self.load_button)
        top.addWidget(self.session_button)
        form = QFormLayout()
        form.addRow("Page sizes (tokens)", self.page_rows)
        form.addRow("Capacities (pages)", self.budgets)
        form.addRow("Disk tiers (pages)", self.disk_budgets)
        checks = FlowLayout(spacing=8)  # the policies wrap in a narrow pane
        for box in self.policies.values():
            checks.addWidget(box)
        run_row = QHBoxLayout()
        run_row.addWidget(self.progress, 1)
        run_row.addStretch(1)
        run_row.addWidget(self.run_button)
        form.addRow("Eviction policies", checks)
        form.addRow("", run_row)
        form.addRow("Cluster", self.cluster)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addLayout(form)
        layout.addWidget(self.error)
        layout.addWidget(self.chart, 1)
        layout.addWidget(self.cluster_chart, 1)
        layout.addWidget(self.table)

        self.load_button.clicked.connect(self.load_requested)
        self.session_button.clicked.connect(self.session_requested)
        self.run_button.clicked.connect(self._run)
        self.cluster.run_requested.connect(self.cluster_requested)
        self.set_trace(None)

    # what the controller tells it ------------------------------------------------------
    def set_trace(self, description: str | None, page_size_applies: bool = True) -> None:
        """Show the loaded trace (None: nothing loaded, Run disabled); hash-id traces have
        one page size, their block."""
        self.trace_label.setText(description or "No trace loaded: load one, or take this session's")
        self._has_trace = description is not None
        self.run_button.setEnabled(self._has_trace)
        self.cluster.run_button.setEnabled(self._has_trace)
        self.page_rows.setEnabled(page_size_applies)

    def set_knobs(self, page_rows: list[int | None], budgets: list[int | None], policies: list[str]) -> None:
        self.page_rows.setText(",".join(str(p) for p in page_rows if p is not None))
        self.budgets.setText(", ".join(_budget_text(b) for b in budgets))
        for name, box in self.policies.items():
            box.setChecked(name in policies)

    def set_busy(self, busy: bool) -> None:
        self.run_button.setEnabled(not busy and self._has_trace)
        self.cluster.run_button.setEnabled(not busy and self._has_trace)
        self.load_button.setEnabled(not busy)
        self.session_button.setEnabled(not busy)
        self.progress.setVisible(busy)
        if busy:
            self.progress.setRange(0, 0)

    def set_progress(self, done: int, total: int) -> None:
        self.progress.setRange(0, total)
        self.progress.setValue(done)

    def show_error(self, message: str | None) -> None:
        self.error.setText(message or "")
        self.error.setVisible(bool(message))

    def set_rows(self, rows: list[dict]) -> None:
        """Draw the sweep's rows (as `prefixlab replay --json` writes them) and list them."""
        self.show_error(None)
        self.chart.set_rows(rows)
        self._show_table(COLUMNS, [(str(r["page_rows"]), _budget_text(r["budget"]),
                                    f"{r['disk_budget']:,}" if r.get("disk_budget") else "-", r["policy"],
                                    f"{r['token_hit_ratio']:.2%}", f"{r['tokens_saved']:,}",
                                    f"{r['hits']:,} / {r['requests']:,}", f"{r['evicted']:,}") for r in rows])
        self._show_chart(self.chart)

    def set_cluster_rows(self, rows: list[dict]) -> None:
        """Draw a cluster sweep's rows (as `prefixlab replay --replicas ... --json` writes them)."""
        self.show_error(None)
        self.cluster_chart.set_rows(rows)
        self._show_table(CLUSTER_COLUMNS, [cluster_cells(r) for r in rows])
        self._show_chart(self.cluster_chart)

    def _show_chart(self, chart: QWidget) -> None:
        self.chart.setVisible(chart is self.chart)
        self.cluster_chart.setVisible(chart is self.cluster_chart)

    def _show_table(self, columns, rows) -> None:
        self.table.setColumnCount(len(columns))
        self.table.setHorizontalHeaderLabels(columns)
        self.table.setRowCount(len(rows))
        for i, cells in enumerate(rows):
            for j, text in enumerate(cells):
                self.table.setItem(i, j, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()

    # what it asks for ------------------------------------------------------------------
    def _run(self) -> None:
        chosen = [name for name, box in self.policies.items() if box.isChecked()]
        self.run_requested.emit(self.page_rows.text(), self.budgets.text(), chosen, self.disk_budgets.text())
