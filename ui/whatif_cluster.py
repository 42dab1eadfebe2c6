"""Cluster charts of a trace replay: hit ratio and p99 TTFT against replicas, one line per router.

Plain data in: rows as `prefixlab replay --replicas ... --json` writes them
(replicas, router, budget, policy, token_hit_ratio, ttft_p99_s).
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QVBoxLayout, QWidget

from .colors import theme_for
from .flow_layout import FlowLayout
from .whatif import PlotStack

# Okabe-Ito hues, one per router (colour-blind safe).
ROUTER_COLORS = {"round-robin": "#999999", "prefix-hash": "#e69f00", "random": "#56b4e9",
                 "least-loaded": "#3d85c6", "cache-aware": "#1fa774", "kv-cost": "#d55e00"}
_SPARE = ("#cc5fa0", "#8e6bd8")


def router_color(router: str, index: int = 0) -> QColor:
    return QColor(ROUTER_COLORS.get(router, _SPARE[index % len(_SPARE)]))


def cluster_lines(rows: list[dict]) -> dict[tuple, tuple[list[int], list[float], list[float]]]:
    """(router, budget, policy) -> (replica counts, hit ratios, p99 TTFTs), sorted by replicas."""
    lines: dict[tuple, list[tuple[int, float, float]]] = {}
    for r in rows:
        lines.setdefault((r["router"], r["budget"], r["policy"]), []).append(
            (r["replicas"], r["token_hit_ratio"], r["ttft_p99_s"]))
    out = {}
    for key, pts in lines.items():
        pts.sort()
        out[key] = ([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])
    return out


class ClusterChart(PlotStack):
    """Two plots against replicas: token hit ratio, and simulated p99 TTFT (log)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__((("Token hit ratio vs replicas", "replicas", "token hit ratio (%)"),
                          ("Simulated TTFT p99 vs replicas (queueing included)", "replicas",
                           "TTFT p99 (s, log)")), parent)
        self.hit, self.ttft = self.plots
        self.ttft.getPlotItem().setLogMode(x=False, y=True)  # TTFTs span orders of magnitude
        self.apply_theme(theme_for(self))

    def set_rows(self, rows: list[dict]) -> None:
        """Draw these cluster rows."""
        self.rows = list(rows)
        self._draw()

    def _draw(self) -> None:
        self._clear()
        lines = cluster_lines(self.rows)
        settings = {(b, p) for _, b, p in lines}
        routers = sorted({k[0] for k in lines})
        styles = [Qt.PenStyle.SolidLine, Qt.PenStyle.DashLine, Qt.PenStyle.DotLine]
        setting_style = {s: styles[i % len(styles)] for i, s in enumerate(sorted(settings, key=str))}
        for (router, budget, policy), (ns, hits, p99) in sorted(lines.items(), key=str):
            name = router if len(settings) == 1 else f"{router}, {_budget(budget)} pages, {policy}"
            pen = pg.mkPen(router_color(router, routers.index(router)), width=2.2,
                           style=setting_style[(budget, policy)])
            for pw, ys in ((self.hit, [100 * h for h in hits]), (self.ttft, p99)):
                pw.plot(ns, ys, pen=pen, symbol="o", symbolSize=6, symbolBrush=pen.color(), symbolPen=None,
                        name=name)
        ticks = [(n, str(n)) for n in sorted({r["replicas"] for r in self.rows})]
        for pw in (self.hit, self.ttft):
            item = pw.getPlotItem()
            item.getAxis("bottom").setTicks([ticks] if ticks else None)
            item.legend.setColumnCount(max(1, min(3, len(item.legend.items))))
            item.vb.enableAutoRange(x=True, y=True)
        top = max((r["token_hit_ratio"] for r in self.rows), default=0.0)
        self.hit.getPlotItem().vb.setYRange(0, 100 * max(0.05, top), padding=0.05)


def _budget(budget: int | None) -> str:
    return "inf" if budget is None else f"{budget:,}"


class ClusterControls(QWidget):
    """The What-if tab's cluster knobs: replica counts, pages per replica, routers, a Run button."""

    run_requested = Signal(str, str, list)  # replicas text, budgets text, router names

    def __init__(self, parent: QWidget | None = None, routers=tuple(ROUTER_COLORS)):
        super().__init__(parent)
        self.replicas = QLineEdit("1,2,4,8")
        self.replicas.setPlaceholderText("replicas: 1,2,4,8")
        self.budgets = QLineEdit("3000")
        self.budgets.setPlaceholderText("pages per replica")
        self.routers = {name: QCheckBox(name) for name in routers}
        for box in self.routers.values():
            box.setChecked(True)
        self.run_button = QPushButton("Run cluster")
        rows = QVBoxLayout(self)
        rows.setContentsMargins(0, 0, 0, 0)
        row, checks = QHBoxLayout(), FlowLayout(spacing=8)  # six routers wrap in a narrow pane
        for label, edit in (("replicas", self.replicas), ("pages each", self.budgets)):
            row.addWidget(QLabel(label))
            edit.setMaximumWidth(110)
            row.addWidget(edit)
        row.addStretch(1)
        row.addWidget(self.run_button)
        for box in self.routers.values():
            checks.addWidget(box)
        rows.addLayout(row)
        rows.addLayout(checks)
        self.run_button.clicked.connect(self._run)

    def _run(self) -> None:
        chosen = [name for name, box in self.routers.items() if box.isChecked()]
        self.run_requested.emit(self.replicas.text(), self.budgets.text(), chosen)


CLUSTER_COLUMNS = ("replicas", "router", "budget", "hit ratio", "per replica", "imbalance",
                   "TTFT p50", "TTFT p99")


def cluster_cells(r: dict) -> tuple[str, ...]:
    """One table row of a cluster result."""
    per = [p["token_hit_ratio"] for p in r["per_replica"]]
    return (str(r["replicas"]), r["router"], _budget(r["budget"]), f"{r['token_hit_ratio']:.2%}",
            f"{min(per):.1%}-{max(per):.1%}", f"{r['load_imbalance']:.2f}",
            f"{r['ttft_p50_s']:,.2f} s", f"{r['ttft_p99_s']:,.2f} s")
