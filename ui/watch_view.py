"""The "Watch a server" view: serving engines' caches from their KV events, side by side.

Widgets only: `set_snapshot` takes plain data shaped like app/watch/session.py's
`WatchSnapshot` (`.engines`: each with `.summary` dict, `.history` rows
`(ts, stored, removed, live)`, `.chains` dicts, `.cells` chain ranks for the block
map; `.cross_engine` dict).
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRect, Qt, Signal
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import (
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from .chart_plots import cache_static_items
from .colors import series_color, theme_for
from .page_map import MARGIN, fit_grid, grid_image

MAX_CHAIN_ROWS = 200   # the table shows the biggest chains; the JSON export has them all
CHAIN_COLUMNS = ("root", "blocks", "depth", "leaves", "tier", "first tokens")
CURVES = (("stored", "stored (cumulative)"), ("removed", "removed (cumulative)"), ("live", "live blocks"))
CURVE_COLORS = {"stored": "cached_pages", "removed": "prefill_computed", "live": "chains"}


# Okabe-Ito and friends: one hue per chain (tree), cycling; the table's first column repeats it.
CHAIN_PALETTE = ("#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00", "#cc79a7", "#8e6bd8")


def chain_color(rank: int) -> QColor:
    """The colour of the rank-th biggest chain."""
    return QColor(CHAIN_PALETTE[rank % len(CHAIN_PALETTE)])


class BlockMap(QWidget):
    """One cell per live block, grouped and coloured by chain (biggest first)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMinimumSize(200, 80)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.cells = np.zeros(0, dtype=np.int64)
        self._image = None
        self._image_key = None
        self._lut = np.array([[c.red(), c.green(), c.blue(), 255] for c in map(QColor, CHAIN_PALETTE)],
                             dtype=np.uint8)

    def set_cells(self, cells) -> None:
        """Each block's chain rank, in map order."""
        cells = np.asarray(cells, dtype=np.int64)
        if not np.array_equal(cells, self.cells):
            self.cells = cells
            self._image = None
            self.update()

    def paintEvent(self, e) -> None:  # noqa: N802 - Qt's name
        painter = QPainter(self)
        theme = theme_for(self)
        painter.fillRect(self.rect(), theme.color("background"))
        area: QRect = self.rect().adjusted(MARGIN, MARGIN, -MARGIN, -MARGIN)
        key = (area.width(), area.height(), theme.background)
        if self._image is None or self._image_key != key:  # the image costs ~20 ms: only when it changed
            geo = fit_grid(len(self.cells), area.width(), area.height())
            colors = self._lut[self.cells % len(self._lut)]
            self._image, self._image_key = grid_image(colors, geo, theme.color("background")), key
        painter.drawImage(area.topLeft(), self._image)
        painter.end()


def _short(h) -> str:
    text = str(h)
    return text if len(text) <= 14 else text[:6] + "…" + text[-6:]


class EnginePane(QWidget):
    """One engine: who it is, its counters, stored/removed/live over time, its biggest chains."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.title = QLabel()
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.counters = QLabel()
        self.counters.setWordWrap(True)
        theme = theme_for(self)
        self.plot = pg.PlotWidget(background=theme.background)
        self.plot.setMinimumHeight(160)
        self.plot.addLegend(offset=(5, 5))
        self.plot.setLabel("bottom", "seconds")
        self.curves = {name: self.plot.plot([], [], name=label,
                                            pen=pg.mkPen(series_color(CURVE_COLORS[name], theme), width=2))
                       for name, label in CURVES}
        cache_static_items(self.plot)
        self.block_map = BlockMap()
        self.chains = QTableWidget(0, len(CHAIN_COLUMNS))
        self.chains.setHorizontalHeaderLabels(CHAIN_COLUMNS)
        self.chains.horizontalHeader().setSectionResizeMode(len(CHAIN_COLUMNS) - 1,
                                                            QHeaderView.ResizeMode.Stretch)
        self.chains.verticalHeader().setVisible(False)
        self.chains.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        for w in (self.title, self.counters, self.plot, self.block_map, self.chains):
            lay.addWidget(w)
        self._chains_key = None

    def set_engine(self, view) -> None:
        """Show one EngineView-shaped object (summary, history, chains)."""
        s = view.summary
        rank = "" if s.get("data_parallel_rank") is None else f", DP rank {s['data_parallel_rank']}"
        self.title.setText(f"<b>engine {s['engine']}</b>: {s['endpoint']}{rank}")
        self.counters.setText(
            f"live {s['live_blocks']:,} blocks · stored {s['stored_blocks']:,} · removed "
            f"{s['removed_blocks']:,} · cleared {s['cleared']} · gaps {s['seq_gaps']} "
            f"({s['repaired_batches']} batches replayed) · bad frames {s['bad_frames']} · "
            f"epochs {s['epochs']}" + (f" · over cap {s['over_cap']:,}" if s.get("over_cap") else ""))
        if view.history:
            h = np.asarray(view.history, dtype=np.float64)
            t = h[:, 0] - h[0, 0]
            for i, (name, _) in enumerate(CURVES, start=1):
                self.curves[name].setData(t, h[:, i])
        else:
            for c in self.curves.values():
                c.setData([], [])
        self.block_map.set_cells(view.cells)
        self._set_chains(view.chains[:MAX_CHAIN_ROWS])

    def _set_chains(self, chains: list[dict]) -> None:
        key = [(c["root"], c["blocks"], c["depth"]) for c in chains]
        if key == self._chains_key:
            return  # rebuilding the rows is the costly part of an update: skip when unchanged
        self._chains_key = key
        table = self.chains
        table.setUpdatesEnabled(False)
        table.setRowCount(len(chains))
        for r, c in enumerate(chains):
            tier = f"{c['medium']}" + ("" if c["group_idx"] is None else f"/{c['group_idx']}")
            first = c.get("preview") or " ".join(str(t) for t in c["first_tokens"][:16])
            cells = (_short(c["root"]) + (" (orphan)" if c["orphan"] else ""), c["blocks"], c["depth"],
                     c["leaves"], tier, first)
            for col, value in enumerate(cells):
                item = table.item(r, col)
                if item is None:  # rows are reused: only new rows get new items
                    item = QTableWidgetItem()
                    if isinstance(value, int):
                        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                    if col == 0:
                        item.setData(Qt.ItemDataRole.DecorationRole, chain_color(r))  # its colour in the map
                    table.setItem(r, col, item)
                text = str(value)
                if item.text() != text:
                    item.setText(text)
        table.setUpdatesEnabled(True)


class WatchView(QWidget):
    """Endpoints to watch, then one pane per engine side by side and what they cache in common."""

    connect_requested = Signal(list, list, str)   # endpoints, replay endpoints, topic
    disconnect_requested = Signal()
    prompt_requested = Signal(str)                # a prompt to score as a precise router would

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.endpoints = QLineEdit()
        self.endpoints.setPlaceholderText("tcp://127.0.0.1:5557 tcp://127.0.0.1:5558  (one per engine)")
        self.replays = QLineEdit()
        self.replays.setPlaceholderText("optional, same order: tcp://127.0.0.1:5567 ...")
        self.topic = QLineEdit()
        self.topic.setPlaceholderText("all topics")
        self.connect_button = QPushButton("Connect")
        self.connect_button.clicked.connect(self._on_connect)
        self.status = QLabel("Not connected. ZeroMQ has no authentication: watch engines you trust.")
        self.status.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Event endpoints", self.endpoints)
        form.addRow("Replay endpoints", self.replays)
        row = QHBoxLayout()
        row.addWidget(self.topic, 1)
        row.addWidget(self.connect_button)
        form.addRow("Topic", row)
        self.prompt = QLineEdit()
        self.prompt.setPlaceholderText("token ids (1 2 3 ...) or text: where would a precise router send it?")
        self.prompt.returnPressed.connect(lambda: self.prompt_requested.emit(self.prompt.text()))
        form.addRow("Route a prompt", self.prompt)
        self.router = QLabel()
        self.router.setWordWrap(True)
        self.panes_box = QSplitter(Qt.Orientation.Horizontal)
        self.panes: list[EnginePane] = []
        self.cross = QLabel()
        self.cross.setWordWrap(True)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.status)
        lay.addWidget(self.panes_box, 1)
        lay.addWidget(self.cross)
        lay.addWidget(self.router)
        self.connected = False

    def set_fields(self, endpoints: list[str], replays: list[str], topic: str) -> None:
        """Fill the form (the remembered endpoints)."""
        self.endpoints.setText(" ".join(endpoints))
        self.replays.setText(" ".join(replays))
        self.topic.setText(topic)

    def _on_connect(self) -> None:
        if self.connected:
            self.disconnect_requested.emit()
        else:
            self.connect_requested.emit(self.endpoints.text().split(), self.replays.text().split(),
                                        self.topic.text())

    def set_connected(self, connected: bool, status: str) -> None:
        """Switch the form between connected and not, with a status line."""
        self.connected = connected
        self.connect_button.setText("Disconnect" if connected else "Connect")
        for w in (self.endpoints, self.replays, self.topic):
            w.setEnabled(not connected)
        self.status.setText(status)

    def prepare(self, n_engines: int) -> None:
        """Make the engines' panes now (a plot costs ~100 ms to build: not while events flow)."""
        while len(self.panes) < n_engines:
            pane = EnginePane()
            self.panes.append(pane)
            self.panes_box.addWidget(pane)

    def set_snapshot(self, snap) -> None:
        """Show a WatchSnapshot-shaped object."""
        self.prepare(len(snap.engines))
        for pane, view in zip(self.panes, snap.engines):
            pane.set_engine(view)
        self.set_router(getattr(snap, "router", None))
        x = snap.cross_engine
        if len(snap.engines) < 2:
            self.cross.setText("")
        elif not x.get("shared_blocks"):
            self.cross.setText("Across engines: no prefix is cached on more than one engine.")
        else:
            by = ", ".join(f"engines {k}: {v:,}" for k, v in x["by_engines"].items())
            deepest = x["deepest"][0]
            self.cross.setText(f"Across engines: {x['shared_blocks']:,} blocks cached on several engines "
                               f"({by}); the deepest shared prefix is {deepest['depth_blocks']} blocks.")

    def set_router(self, scores: dict | None) -> None:
        """Show a precise router's scores for the prompt (app/watch/router_score.py's dict)."""
        if not scores or not scores["engines"]:
            self.router.setText("")
            return
        parts = [f"engine {e['engine']}: {e['score']:.0%} ({e['matched_blocks']}/{e['prompt_blocks']} blocks)"
                 for e in scores["engines"]]
        best = next(e for e in scores["engines"] if e["engine"] == scores["pick"])
        why = ("no engine holds its first block: a router falls back to load" if best["score"] == 0
               else f"it picks engine {best['engine']}")
        self.router.setText(f"Precise prefix-cache router, prompt of {scores['tokens']} tokens: "
                            f"{'; '.join(parts)}. {why[0].upper()}{why[1:]}.")

    def clear(self) -> None:
        """Remove every engine pane."""
        for pane in self.panes:
            pane.setParent(None)
            pane.deleteLater()
        self.panes = []
        self.cross.setText("")
