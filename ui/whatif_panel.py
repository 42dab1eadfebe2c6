"""The What-if tab: pick a trace and the knobs, see hit ratio vs capacity per policy and,
beside it, the twin's predicted TTFT at the same capacities.

A plain widget: it shows what it is given (the trace's description, suggested knobs, the step
cost in use, progress, result rows, errors) and asks for work through signals; the app's
controller parses the knobs, runs the replay and the twin off the UI thread and hands rows back.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
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
TTFT_COLUMNS = ("TTFT p50 (s)", "TTFT p90 (s)", "goodput (req/s)")  # the last names its SLO when given


def _budget_text(budget: int | None) -> str:
    return "inf" if budget is None else str(budget)


class WhatIfPanel(QWidget):
    """Trace buttons, knob fields, a Run button, the curves and a table of configurations."""

    load_requested = Signal()           # "Load trace…": the controller opens a file dialog
    session_requested = Signal()        # "This session": replay what the app just ran
    run_requested = Signal(str, str, list, str)  # page sizes, budgets, policy names, disk tiers text
    cost_requested = Signal()           # "Load cost file…": the controller opens a file dialog
    calibrate_requested = Signal()      # "Calibrate": `prefixlab calibrate` for the loaded model
    predict_requested = Signal(str)     # "Predict TTFT" at the latest sweep's capacities: the TTFT SLO text
    stop_requested = Signal()           # "Stop": the twin's prediction stops between two requests
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
        self.cost_label = QLabel()
        self.cost_label.setWordWrap(True)
        # Selectable: the note's `prefixlab calibrate --model ...` is a command to copy.
        self.cost_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.cost_button = QPushButton("Load cost file…")
        self.cost_button.setToolTip("A step-cost JSON (`prefixlab calibrate` writes one; docs/twin.md)")
        self.calibrate_button = QPushButton("Calibrate")
        self.calibrate_button.setToolTip("Time real passes of the loaded model on this machine and keep the "
                                         "fit beside its weights (`prefixlab calibrate`, a few seconds)")
        self.slo_ttft = QLineEdit()
        self.slo_ttft.setPlaceholderText("none; e.g. 2.0")
        self.slo_ttft.setMaximumWidth(110)
        self.slo_ttft.setToolTip("Goodput: requests per second whose predicted TTFT is at most this")
        self.predict_button = QPushButton("Predict TTFT")
        self.predict_button.setToolTip("The twin at the latest sweep's capacities (slow on a long trace: "
                                       "it runs the engine's scheduler for every token; Stop ends it)")
        self.run_button = QPushButton("Run")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setVisible(False)
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

        self._lay_out()
        self._connect()
        self._busy = False
        self.set_trace(None)
        self.set_cost(None, False, False)

    def _lay_out(self) -> None:
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
        run_row.addWidget(QLabel("TTFT SLO (s)"))
        run_row.addWidget(self.slo_ttft)
        run_row.addWidget(self.predict_button)
        run_row.addWidget(self.stop_button)
        run_row.addWidget(self.run_button)
        cost_row = QHBoxLayout()
        cost_row.addWidget(self.cost_label, 1)
        cost_row.addWidget(self.calibrate_button)
        cost_row.addWidget(self.cost_button)
        form.addRow("Eviction policies", checks)
        form.addRow("Step cost", cost_row)
        form.addRow("", run_row)
        form.addRow("Cluster", self.cluster)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addLayout(form)
        layout.addWidget(self.error)
        layout.addWidget(self.chart, 1)
        layout.addWidget(self.cluster_chart, 1)
        layout.addWidget(self.table)

    def _connect(self) -> None:
        self.load_button.clicked.connect(self.load_requested)
        self.session_button.clicked.connect(self.session_requested)
        self.run_button.clicked.connect(self._run)
        self.cost_button.clicked.connect(self.cost_requested)
        self.calibrate_button.clicked.connect(self.calibrate_requested)
        self.stop_button.clicked.connect(self.stop_requested)
        self.predict_button.clicked.connect(lambda: self.predict_requested.emit(self.slo_ttft.text()))
        self.cluster.run_requested.connect(self.cluster_requested)

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

    def set_cost(self, text: str | None, known: bool, can_calibrate: bool) -> None:
        """Say which step cost the twin predicts with, or (`known` false) that there is none and how
        to get one (None: the general note); `can_calibrate`: a model is loaded to calibrate."""
        self.cost_label.setText(text or "None: run `prefixlab calibrate` for the loaded model, or load a "
                                        "cost file; the hit ratios run without one")
        self._has_cost, self._can_calibrate = known, can_calibrate
        self._enable_predict()

    def set_busy(self, busy: bool, stoppable: bool = False) -> None:
        """Busy: the knobs wait; `stoppable`: the work in progress can be stopped (the twin)."""
        self.stop_button.setVisible(busy and stoppable)
        self._busy = busy
        self.cost_button.setEnabled(not busy)
        self.calibrate_button.setEnabled(not busy and self._can_calibrate)
        self._enable_predict()
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
        self._enable_predict()
        self._show_sweep_table()
        self._show_chart(self.chart)

    def set_ttft_rows(self, rows: list[dict]) -> None:
        """Draw the twin's rows (as `app.replay.whatif_twin.run` returns them) beside the hit ratios,
        and add their TTFT and goodput to the configurations' rows they predict."""
        self.chart.set_ttft_rows(rows)
        self._show_sweep_table()
        self._show_chart(self.chart)

    def _enable_predict(self) -> None:
        """Predict needs a step cost and a sweep whose capacities it predicts."""
        self.predict_button.setEnabled(not self._busy and self._has_cost and bool(self.chart.rows))
        self.calibrate_button.setEnabled(not self._busy and self._can_calibrate)

    def _show_sweep_table(self) -> None:
        twin = {(t["page_rows"], t["budget"], t["policy"]): t for t in self.chart.ttft_rows}
        cells = []
        for r in self.chart.rows:
            t = None if r.get("disk_budget") else twin.get((r["page_rows"], r["budget"], r["policy"]))
            predicted = ("-",) * len(TTFT_COLUMNS) if t is None else (
                f"{t['ttft_s']['p50']:.3f}", f"{t['ttft_s']['p90']:.3f}",
                "-" if t["slo_ttft_s"] is None else f"{t['goodput_rps']:.3f}")
            cells.append((str(r["page_rows"]), _budget_text(r["budget"]),
                          f"{r['disk_budget']:,}" if r.get("disk_budget") else "-", r["policy"],
                          f"{r['token_hit_ratio']:.2%}", f"{r['tokens_saved']:,}",
                          f"{r['hits']:,} / {r['requests']:,}", f"{r['evicted']:,}", *predicted))
        slo = next((t["slo_ttft_s"] for t in self.chart.ttft_rows), None)
        predicted = (*TTFT_COLUMNS[:2], f"goodput, TTFT <= {slo:g} s (req/s)" if slo else TTFT_COLUMNS[2])
        self._show_table(COLUMNS + (predicted if self.chart.ttft_rows else ()), cells)

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
