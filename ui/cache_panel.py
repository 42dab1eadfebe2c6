"""The cache panel: the page map, the cached chains and 'why it missed', wired together."""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from engine.snapshot import Snapshot

from .chains_table import ChainsTable
from .colors import theme_for
from .disk_tier_strip import DiskTierStrip
from .page_map import PageMap
from .probe_view import ProbeView
from .visibility import hidden_in_window


def _section(title: str, body: QWidget, *extra: QWidget) -> QWidget:
    """A titled block: a small caps title row (with optional widgets on the right) over its body."""
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.setSpacing(3)
    head = QHBoxLayout()
    head.setContentsMargins(0, 0, 0, 0)
    label = QLabel(title)
    label.setObjectName("panelTitle")
    head.addWidget(label)
    head.addStretch(1)
    for w in extra:
        head.addWidget(w)
    layout.addLayout(head)
    layout.addWidget(body, 1)
    return box


class CachePanel(QWidget):
    """Page map, chains table and probe view; selecting a chain outlines its pages in the map."""

    probe_requested = Signal()
    pin_requested = Signal(int, bool)  # chain id, pinned: the chains table's pin box

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._snapshot: Snapshot | None = None
        self._shown = True  # the snapshot held is the one drawn
        self.summary = QLabel(self)
        self.summary.setObjectName("cacheSummary")
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setWordWrap(True)
        self.page_map = PageMap(self)
        self.disk_tier = DiskTierStrip(self)  # under the pool's map, shown when there is a tier
        self.chains_table = ChainsTable(self)
        self.probe_view = ProbeView(self)
        self.probe_button = QPushButton("Explain miss for selected prompt", self)
        self.probe_button.setToolTip("Probe the cache with the selected prompt (read-only): how far it "
                                     "would match and why the match stops")
        self.probe_button.setSizePolicy(QSizePolicy.Policy.Maximum, QSizePolicy.Policy.Fixed)
        self.probe_button.clicked.connect(self.probe_requested)

        splitter = QSplitter(Qt.Orientation.Vertical, self)
        splitter.setChildrenCollapsible(False)
        pages = QWidget()
        pages_lay = QVBoxLayout(pages)
        pages_lay.setContentsMargins(0, 0, 0, 0)
        pages_lay.setSpacing(2)
        pages_lay.addWidget(self.page_map, 1)
        pages_lay.addWidget(self.disk_tier)
        splitter.addWidget(_section("KV POOL PAGES", pages))
        splitter.addWidget(_section("CACHED CHAINS", self.chains_table))
        splitter.addWidget(_section("WHY IT MISSED", self.probe_view, self.probe_button))
        splitter.setStretchFactor(0, 5)
        splitter.setStretchFactor(1, 3)
        splitter.setStretchFactor(2, 3)
        splitter.setSizes([400, 220, 200])
        self.splitter = splitter
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.setSpacing(4)
        layout.addWidget(self.summary)
        layout.addWidget(splitter, 1)
        self.setMinimumSize(360, 420)

        self.chains_table.chain_selected.connect(self.page_map.highlight_chain)
        self.chains_table.pin_toggled.connect(self.pin_requested)
        self.page_map.page_clicked.connect(self._on_page_clicked)
        self._update_summary()

    def update_snapshot(self, snapshot: Snapshot) -> None:
        """Show a new snapshot; the selected chain stays selected (and outlined) while it lives.
        On a hidden tab it waits for showEvent: the chains table's fit to its contents alone
        cost the UI thread 1.6 ms a snapshot."""
        self._snapshot = snapshot
        self._shown = False
        if not hidden_in_window(self):
            self._show_snapshot()

    def showEvent(self, e) -> None:  # noqa: N802 - Qt's name
        super().showEvent(e)
        if not self._shown:
            self._show_snapshot()

    def _show_snapshot(self) -> None:
        self._shown = True
        self.page_map.set_snapshot(self._snapshot)
        s = self._snapshot
        self.disk_tier.set_tier(s.disk_tier, s.disk_capacity, s.page_rows)
        self.chains_table.set_chains(self._snapshot.chains)
        self._update_summary()

    def show_probe(self, info: dict) -> None:
        """Show a probe result ('why it missed'); see ProbeView.show_probe for the keys."""
        self.probe_view.show_probe(info)
        chain = info.get("chain_id")
        if chain is not None:
            self.chains_table.select_chain(chain)

    def clear(self) -> None:
        self._snapshot = None
        self._shown = True
        self.page_map.clear()
        self.disk_tier.set_tier([], 0, 0)
        self.chains_table.set_chains([])
        self.probe_view.clear()
        self._update_summary()

    def _on_page_clicked(self, page: int) -> None:
        info = self._snapshot.pages.get(page) if self._snapshot is not None else None
        chain = info.chain_id if info is not None else None
        if chain is None or not self.chains_table.select_chain(chain):
            self.chains_table.select_chain(None)

    def _update_summary(self) -> None:
        t = theme_for(self)
        s = self._snapshot
        if s is None:
            self.summary.setText(f"<span style='color:{t.muted}'>The pool and the cache appear here "
                                 f"once the engine runs.</span>")
            return
        counts = self.page_map.counts_by_state()
        cached = counts["cached"] + counts["shared"]
        parts = [("pool", f"{len(s.page_states):,} pages × {s.page_rows}"),
                 ("pages", f"{s.kv_dtype}, {s.bytes_per_page / 1024:,.0f} KiB each"),
                 ("in cache", f"{cached:,}"), ("chains", f"{len(s.chains):,}")]
        if s.disk_capacity:
            parts.append(("disk tier", _disk_text(s)))
        if s.prefill_tok_s:
            parts.append(("prefill", f"{s.prefill_tok_s:,.0f} tok/s"))
        parts.append(("time saved", f"≈ {s.seconds_saved:.1f} s"))
        self.summary.setText("&nbsp;&nbsp;·&nbsp;&nbsp;".join(
            f"<span style='color:{t.muted}'>{k}</span> <b>{v}</b>" for k, v in parts))

    def changeEvent(self, e: QEvent) -> None:  # noqa: N802 - Qt's name
        if e.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange) \
                and hasattr(self, "page_map"):
            self._update_summary()
        super().changeEvent(e)


def _disk_text(s: Snapshot) -> str:
    """Disk-tier pages, and what loading them back cost beside recomputing them."""
    text = f"{s.disk_pages:,} / {s.disk_capacity:,} pages"
    if s.disk_hit_pages:
        text += f", {s.disk_hit_pages:,} loaded back in {s.disk_load_s * 1e3:,.0f} ms"
        if s.prefill_tok_s:
            text += f" (recompute ≈ {s.disk_hit_pages * s.page_rows / s.prefill_tok_s * 1e3:,.0f} ms)"
    return text
