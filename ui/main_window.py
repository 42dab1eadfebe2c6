"""PrefixLab's main window: prompts on the left, streams in the middle, charts and cache on the right.

Widgets only: the window draws plain data (model info dicts, transcripts, engine records and
snapshots) and offers its actions; `app.desktop` wires them to the controller. Stream text
arrives on the controller's timer and the charts refresh on their own, so 8 streams cost
the UI thread little.
"""

from __future__ import annotations

import os

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QMainWindow,
    QMenu,
    QSizePolicy,
    QSplitter,
    QTabWidget,
    QToolBar,
    QVBoxLayout,
    QWidget,
)

from .advisor_panel import AdvisorPanel
from .ask import AskAndTell
from .cache_panel import CachePanel
from .charts import ChartsPanel
from .format import pool_summary
from .model_bar import ModelBar
from .prompt_pane import PromptPane
from .requests_table import RequestsTable
from .served_view import ServedView
from .stream_grid import StreamGrid
from .stream_view import StreamView
from .theme import apply_theme, current_theme, icon, titled_box
from .whatif_panel import WhatIfPanel
from .window_state import THEME_KEY, default_size, restore_window, save_window

DEFAULT_SPLIT = [250, 330, 700]  # 1280 px: the charts need ~700, a card ~300
DROP_SUFFIXES = (".gguf", ".json")
POOL_TIP = "KV pool pages by state, cached chains, hits and prefill saved"


class MainWindow(AskAndTell, QMainWindow):
    """The desktop app's one window (its actions are wired by app.desktop)."""

    file_dropped = Signal(str)       # a .gguf or .json dropped on the window
    scenario_chosen = Signal(object)  # the payload given to set_scenarios
    recent_chosen = Signal(str)
    builtin_chosen = Signal(str)     # a built-in model's name (Models menu)
    recent_cleared = Signal()
    closing = Signal()

    def __init__(self, store: QSettings):
        super().__init__()
        self.store = store
        self.setWindowTitle("PrefixLab")
        self.setWindowIcon(icon("prefixlab"))
        self.setAcceptDrops(True)
        self._splits_restored = False
        self._build_central()
        self._build_actions()
        self._build_menus()
        self._build_toolbar()
        self._build_status_bar()
        self._splits_restored = restore_window(store, self, self._splitters(), self.tabs)
        self.theme_actions[current_theme()].setChecked(True)

    # layout -------------------------------------------------------------------
    def _build_central(self) -> None:
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.setChildrenCollapsible(False)
        self.prompt_pane = PromptPane()
        self.system_edit = self.prompt_pane.system_edit
        self.prompt_list = self.prompt_pane.prompt_list
        self.left_splitter = self.prompt_pane.splitter
        self.splitter.addWidget(self.prompt_pane)

        self.streams = StreamGrid()
        self.splitter.addWidget(titled_box("STREAMS", self.streams, (4, 8, 4, 8)))

        self.tabs = QTabWidget()
        self.tabs.setObjectName("sideTabs")
        self.tabs.setDocumentMode(False)
        self.charts = ChartsPanel()
        # The charts' one-line summary grows with the session's numbers; unwrapped, its
        # width raises the pane's minimum and the splitter squeezes the streams mid-run.
        self.charts.summary.setWordWrap(True)
        self.cache_panel = CachePanel()
        self.requests_table = RequestsTable()
        self.served_view = ServedView()
        self.tabs.addTab(self.charts, "Charts")
        self.tabs.addTab(self.cache_panel, "Cache")
        self.tabs.addTab(self.requests_table, "Requests")
        self.tabs.addTab(self.served_view, "Served")
        self.whatif = WhatIfPanel()
        self.tabs.addTab(self.whatif, "What-if")
        self.advisor = AdvisorPanel()
        self.tabs.addTab(self.advisor, "Advisor")
        right = QWidget()
        right_lay = QVBoxLayout(right)
        right_lay.setContentsMargins(4, 8, 8, 8)
        right_lay.addWidget(self.tabs)
        self.splitter.addWidget(right)

        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 0)
        self.splitter.setSizes(DEFAULT_SPLIT)
        self.setCentralWidget(self.splitter)
        self.prompt_list.changed.connect(self.refresh_titles)

    def _splitters(self) -> dict[str, QSplitter]:
        return {"splitter": self.splitter, "left_splitter": self.left_splitter}

    def _action(self, text: str, shortcut=None, icon_name: str | None = None, tip: str = "") -> QAction:
        act = QAction(text, self)
        if icon_name:
            act.setIcon(icon(icon_name))
        if shortcut is not None:
            if isinstance(shortcut, (list, tuple)):
                act.setShortcuts([QKeySequence(s) for s in shortcut])
            else:
                act.setShortcut(QKeySequence(shortcut))
        if tip:
            act.setStatusTip(tip)
            act.setToolTip(tip)
        self.addAction(act)  # shortcuts work even with the menu bar hidden
        return act

    def _build_actions(self) -> None:
        a = self._action
        self.act_open = a("&Open model…", QKeySequence.StandardKey.Open, "open", "Open a GGUF model (Ctrl+O)")
        self.act_open_scenario = a("Open scenario &file…", icon_name="scenario")
        self.act_export = a("&Export report…", "Ctrl+E", "export", "Export a report of this session (Ctrl+E)")
        self.act_open_report = a("Open &report…", "Ctrl+Shift+E")
        self.act_quit = a("&Quit", QKeySequence.StandardKey.Quit)
        self.act_quit.triggered.connect(self.close)
        self.act_run_all = a("&Run all", ["Ctrl+Return", "Ctrl+Enter"], "run",
                             "Submit every prompt together (Ctrl+Enter)")
        self.act_run_selected = a("Run &selected", "Ctrl+R", "run-one",
                                  "Run the selected prompt alone (Ctrl+R)")
        self.act_stop_all = a("&Stop all", "Esc", "stop", "Stop every stream (Esc)")
        self.act_flush = a("&Flush cache", icon_name="flush",
                           tip="Give back every cached page no stream is using")
        self.act_save_cache = a("Save the &cache now", tip="Write the cache's chains to disk now "
                                "(loaded after the model loads when Settings keeps the cache)")
        self.act_probe = a("&Probe selected prompt", "Ctrl+P",
                           tip="How far the selected prompt would match the cache")
        self.act_server = a("Ser&ver", tip="Serve the model over an OpenAI-compatible HTTP API "
                                          "(host, port and key in Settings)")
        self.act_server.setCheckable(True)
        self.act_settings = a("&Settings…", "Ctrl+,", "settings",
                              "Pool, cache, scheduler and sampling settings")
        self.act_about = a("&About PrefixLab", icon_name="info")
        self.act_reset_layout = a("Reset &layout")
        self.act_reset_layout.triggered.connect(self.reset_layout)
        self.prompt_pane.run_button.clicked.connect(self.act_run_all.trigger)
        self.prompt_pane.stop_button.clicked.connect(self.act_stop_all.trigger)
        self.cache_panel.probe_requested.connect(self.act_probe.trigger)
        self.theme_group = QActionGroup(self)
        self.theme_group.setExclusive(True)
        self.theme_actions = {}
        for name in ("light", "dark"):
            act = QAction(f"{name.title()} theme", self, checkable=True)
            act.triggered.connect(lambda _=False, n=name: self.set_theme(n))
            self.theme_group.addAction(act)
            self.theme_actions[name] = act

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        file_menu.addAction(self.act_open)
        self.recent_menu = file_menu.addMenu("Recent &models")
        self.set_recent_models([])
        file_menu.addSeparator()
        self.scenario_menus = [file_menu.addMenu(icon("scenario"), "&Scenarios"), QMenu(self)]
        self.prompt_list.scenario_button.setMenu(self.scenario_menus[1])  # the same list on the prompt list
        file_menu.addSeparator()
        file_menu.addAction(self.act_export)
        file_menu.addAction(self.act_open_report)
        file_menu.addSeparator()
        file_menu.addAction(self.act_quit)
        self.models_menu = bar.addMenu("&Models")
        self.set_builtin_models([])
        run_menu = bar.addMenu("&Run")
        for act in (self.act_run_all, self.act_run_selected, self.act_stop_all, None, self.act_probe,
                    self.act_flush, self.act_save_cache, None, self.act_server, self.act_settings):
            run_menu.addSeparator() if act is None else run_menu.addAction(act)
        view_menu = bar.addMenu("&View")
        for act in self.theme_actions.values():
            view_menu.addAction(act)
        view_menu.addSeparator()
        view_menu.addAction(self.act_reset_layout)
        bar.addMenu("&Help").addAction(self.act_about)

    def set_builtin_models(self, models: list[tuple[str, str, bool, str]]) -> None:
        """Fill the Models menu with (name, title, installed, note); an uninstalled one offers to install."""
        self.models_menu.clear()
        for name, title, installed, note in models:
            act = self.models_menu.addAction(title if installed else f"{title} — install…")
            act.setToolTip(note)
            act.setStatusTip(note)
            act.triggered.connect(lambda _=False, n=name: self.builtin_chosen.emit(n))
        if not models:
            self.models_menu.addAction("(none)").setEnabled(False)

    def set_recent_models(self, paths: list[str]) -> None:
        """Fill File → Recent models."""
        self.recent_menu.clear()
        for path in paths:
            act = self.recent_menu.addAction(os.path.basename(path))
            act.setToolTip(path)
            act.setStatusTip(path)
            act.triggered.connect(lambda _=False, p=path: self.recent_chosen.emit(p))
        if not paths:
            self.recent_menu.addAction("(none yet)").setEnabled(False)
        else:
            self.recent_menu.addSeparator()
            self.recent_menu.addAction("Clear list", self.recent_cleared.emit)

    def set_scenarios(self, items: list[tuple[str, str, object]], problem: str = "") -> None:
        """Fill both scenario menus with (name, description, payload); `problem`: why some are missing."""
        for menu in self.scenario_menus:
            menu.clear()
            if problem:
                menu.addAction(f"(scenarios unreadable: {problem})").setEnabled(False)
            for name, description, payload in items:
                act = menu.addAction(name)
                act.setToolTip(description)
                act.setStatusTip(description)
                act.triggered.connect(lambda _=False, p=payload: self.scenario_chosen.emit(p))
            menu.addSeparator()
            menu.addAction(self.act_open_scenario)

    def _build_toolbar(self) -> None:
        tb = QToolBar("Main")
        tb.setObjectName("mainToolbar")
        tb.setMovable(False)
        tb.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        # Run all and Stop all are the prompt pane's buttons (and the Run menu's, with their keys):
        # one of each on screen, beside the prompts they act on.
        for act in (self.act_flush, self.act_server, self.act_settings):
            tb.addAction(act)
        tb.addSeparator()
        self.model_bar = ModelBar()
        self.model_bar.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.model_bar.open_clicked.connect(self.act_open.trigger)
        tb.addWidget(self.model_bar)
        self.addToolBar(tb)
        self.toolbar = tb

    def _build_status_bar(self) -> None:
        sb = self.statusBar()
        self.state_label = QLabel("starting")
        self.pool_label = QLabel("no pool yet")
        self.pool_label.setToolTip(POOL_TIP)
        self.server_label = QLabel("")
        self.server_label.setToolTip("The OpenAI-compatible server: point clients at this base URL")
        sb.addPermanentWidget(self.server_label)
        sb.addPermanentWidget(self.pool_label)
        sb.addPermanentWidget(self.state_label)

    # drawing what the controller says ---------------------------------------------------
    def show_loading(self, what: str) -> None:
        self.model_bar.set_loading(what)
        self.state_label.setText("loading model…")

    def show_model(self, info: dict) -> None:
        self.model_bar.set_model(info)
        # The document's name only: Qt's X11 and Windows back ends append " — PrefixLab" (the
        # application's display name) themselves, so "PrefixLab — name" read "... — PrefixLab" twice.
        self.setWindowTitle(info["name"])

    def show_state(self, ready: bool, loading: bool, running: int) -> None:
        """Enable what can be done now; the state label says what goes on."""
        for act in (self.act_run_all, self.act_run_selected, self.act_flush, self.act_probe):
            act.setEnabled(ready)
        self.prompt_pane.run_button.setEnabled(ready)
        self.act_stop_all.setEnabled(bool(running))
        self.prompt_pane.stop_button.setEnabled(bool(running))
        self.act_open.setEnabled(not loading)
        if loading:
            self.state_label.setText("loading model…")
        elif running:
            self.state_label.setText(f"● running {running} stream(s)")
        else:
            self.state_label.setText("idle" if ready else "no model")

    def show_kv_budget(self, info: dict) -> None:
        """The KV budget the pool runs under: a model bar chip, and its line in the pool's tip."""
        self.model_bar.set_kv_budget(info.get("kv_budget_bytes", 0), info.get("line", ""))
        self.pool_label.setToolTip(f"{POOL_TIP}\n{info.get('line', '')}")

    def show_server(self, base_url: str) -> None:
        """The server's base URL in the status bar ("" when it is off)."""
        self.act_server.setChecked(bool(base_url))
        self.server_label.setText(f"serving {base_url}" if base_url else "")

    def show_status(self, text: str, ms: int = 0) -> None:
        self.statusBar().showMessage(text, ms)

    def add_card(self, transcript) -> StreamView:
        """A card for a new Transcript, placed in the prompt list's order."""
        card = StreamView(transcript)
        self.streams.add(card)
        self.streams.order([u for u, _ in self.prompt_list.prompts()])
        return card

    def show_stats(self, snap, rows: list, redraw: bool) -> None:
        """A live Snapshot: new chart rows (all of them after a report was shown), pool, chains."""
        if redraw:
            self.charts.set_data(list(snap.timeline), snap.records, snap.prefill_tok_s)
        elif rows:
            self.charts.append(rows, snap.records, snap.prefill_tok_s)
        self.cache_panel.update_snapshot(snap)
        self.pool_label.setText(pool_summary(snap))
        self.model_bar.set_kv_pages(snap.kv_dtype, snap.bytes_per_page)

    def show_report(self, report, snap, path: str) -> None:
        """A saved report's charts, pool and chains, until the next live data."""
        self.charts.set_data(list(report.timeline), list(report.requests), report.totals.prefill_tok_s)
        self.cache_panel.update_snapshot(snap)
        self.pool_label.setText(pool_summary(snap))
        self.tabs.setCurrentIndex(0)
        ttft = "" if report.ttft_from == "arrival" else "; its TTFT counts from admission (an older report)"
        self.show_status(f"Showing the report {os.path.basename(path)} ({report.title}){ttft}; "
                         "the next run shows live data again", 10000)

    def refresh_titles(self) -> None:
        """Cards not running take their prompt's text as title, and the prompt list's order."""
        for uid, text in self.prompt_list.prompts():
            card = self.streams.card(uid)
            if card is not None and not card.running:
                card.set_title(text)
        self.streams.order([u for u, _ in self.prompt_list.prompts()])

    # drag and drop ----------------------------------------------------------------------
    @staticmethod
    def _dropped_file(mime) -> str | None:
        if mime is None or not mime.hasUrls():
            return None
        for url in mime.urls():
            if url.isLocalFile() and url.toLocalFile().lower().endswith(DROP_SUFFIXES):
                return url.toLocalFile()
        return None

    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt override
        if self._dropped_file(event.mimeData()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.dragEnterEvent(event)

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt override
        path = self._dropped_file(event.mimeData())
        if path is None:
            event.ignore()
            return
        event.acceptProposedAction()
        self.file_dropped.emit(path)

    # view -------------------------------------------------------------------------------
    def set_theme(self, name: str) -> None:
        app = QApplication.instance()
        name = apply_theme(app, name) if app is not None else name
        self.theme_actions[name].setChecked(True)
        self.store.setValue(THEME_KEY, name)
        for card in self.streams.cards.values():
            card.rerender()  # the charts and the cache panel follow the palette change themselves

    def reset_layout(self) -> None:
        self.resize(*default_size())
        self._default_splits()

    def _default_splits(self) -> None:
        self.splitter.setSizes(DEFAULT_SPLIT)
        self.prompt_pane.default_split()

    def showEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().showEvent(event)
        if not self._splits_restored:
            self._splits_restored = True  # first show without a saved layout: the default split
            self._default_splits()

    def save_layout(self) -> None:
        """Remember geometry, splitters, tab and theme (synced by the caller)."""
        save_window(self.store, self, self._splitters(), self.tabs)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.closing.emit()
        super().closeEvent(event)
