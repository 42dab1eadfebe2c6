"""PrefixLab's main window: prompts on the left, streams in the middle, charts and cache on the right.

The window never touches engine objects: it talks to the engine worker through
`app.worker.EngineClient` and draws the copies the worker sends back (token
pieces, finished records, snapshots). Stream text is flushed on a timer and
the charts refresh on their own timers, so 8 streams cost the UI thread little.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import secrets

import numpy as np
from PySide6.QtCore import QByteArray, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QToolBar,
    QVBoxLayout,
    QWidget,
)

from app.scenario import Scenario, bundled_scenarios, load_scenario
from app.settings import AppSettings, add_recent_model, qsettings, recent_models
from app.worker import EngineClient
from engine.metrics import PAGE_CACHED, PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED

from .about import AboutDialog
from .model_bar import ModelBar
from .prompt_list import PromptList
from .settings_dialog import SettingsDialog
from .stream_view import StreamGrid, StreamView
from .theme import apply_theme, current_theme, icon

DEFAULT_SIZE = (1400, 900)
DEFAULT_SPLIT = [290, 470, 640]  # the charts need ~600 px
DEFAULT_LEFT_SPLIT = [240, 460]
FLUSH_INTERVAL_MS = 40
REQUEST_COLUMNS = ["Req", "Prompt", "Prompt tok", "Cached", "Prefilled", "Generated", "TTFT",
                   "tok/s", "Finish"]


def optional_panels() -> tuple[type | None, type | None]:
    """ChartsPanel and CachePanel if their modules are there (another engineer writes them)."""
    found = []
    for module, name in (("ui.charts", "ChartsPanel"), ("ui.cache_panel", "CachePanel")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except Exception:  # noqa: BLE001 - missing or half-written: show a placeholder
            found.append(None)
    return found[0], found[1]


def _placeholder(text: str) -> QLabel:
    label = QLabel(text)
    label.setObjectName("placeholder")
    label.setAlignment(Qt.AlignmentFlag.AlignCenter)
    label.setWordWrap(True)
    return label


class MainWindow(QMainWindow):
    """The desktop app's one window."""

    model_ready = Signal(dict)        # UI-thread echoes of worker events (tests wait on these)
    stream_finished = Signal(object)
    run_done = Signal()
    error_reported = Signal(str)

    def __init__(self, model_path: str | None = None, autoload: bool = True):
        super().__init__()
        self.setWindowTitle("PrefixLab")
        self.setWindowIcon(icon("prefixlab"))
        self.setAcceptDrops(True)
        self.store = qsettings()
        self.settings = AppSettings.load(self.store)
        self.client = EngineClient(self)
        self.model_info: dict | None = None
        self.snapshot = None
        self.finished_records: list = []
        self.last_error: str | None = None
        self.opened_report = None
        self._showing_report = False
        self.last_report_paths: list[str] = []
        self.last_probe: dict | None = None
        self._rows_seen = 0
        self._tag_card: dict[str, StreamView] = {}
        self._rid_tag: dict[int, str] = {}
        self._open_tags: set[str] = set()
        self._scripts: dict[str, list[str]] = {}       # uid -> the scenario's later turns
        self._script_queue: dict[str, list[str]] = {}  # uid -> turns still to send in this run
        self._nonce = secrets.token_hex(3)
        self._conversations = 0
        self._loading = False
        self._loading_path: str | None = None
        self._closed = False
        self._splits_restored = False

        self._build_central()
        self._build_actions()
        self._build_menus()
        self._build_toolbar()
        self._build_status_bar()
        self._connect_worker()
        self._flush_timer = QTimer(self)
        self._flush_timer.setInterval(FLUSH_INTERVAL_MS)
        self._flush_timer.timeout.connect(self._flush_streams)
        self._flush_timer.start()
        self._restore_state()
        self._update_actions()
        self.client.apply_settings(self.settings)
        if autoload:
            self.load_model(model_path)

    # layout -------------------------------------------------------------------
    def _build_central(self) -> None:
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.setChildrenCollapsible(False)

        left = QWidget()
        left_lay = QVBoxLayout(left)
        left_lay.setContentsMargins(8, 8, 4, 8)
        self.left_splitter = QSplitter(Qt.Orientation.Vertical)
        self.left_splitter.setObjectName("leftSplitter")
        sys_box = QWidget()
        sys_lay = QVBoxLayout(sys_box)
        sys_lay.setContentsMargins(0, 0, 0, 0)
        sys_lay.setSpacing(4)
        title = QLabel("SYSTEM PROMPT")
        title.setObjectName("panelTitle")
        sys_lay.addWidget(title)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setObjectName("systemPrompt")
        self.system_edit.setPlaceholderText("Shared by every prompt: the part the cache can reuse.")
        self.system_edit.setTabChangesFocus(True)
        sys_lay.addWidget(self.system_edit)
        self.left_splitter.addWidget(sys_box)
        self.prompt_list = PromptList()
        self.left_splitter.addWidget(self.prompt_list)
        self.left_splitter.setSizes(DEFAULT_LEFT_SPLIT)
        left_lay.addWidget(self.left_splitter, 1)
        run_row = QHBoxLayout()
        self.run_button = QPushButton(icon("run"), "Run all")
        self.run_button.setObjectName("primary")
        self.run_button.setToolTip("Submit every prompt together (Ctrl+Enter)")
        self.run_button.clicked.connect(self.run_all)
        self.stop_button = QPushButton(icon("stop"), "Stop all")
        self.stop_button.setToolTip("Stop every stream (Esc)")
        self.stop_button.clicked.connect(self.stop_all)
        run_row.addWidget(self.run_button, 2)
        run_row.addWidget(self.stop_button, 1)
        left_lay.addLayout(run_row)
        self.run_hint = QLabel()
        self.run_hint.setObjectName("hint")
        self.run_hint.setWordWrap(True)
        left_lay.addWidget(self.run_hint)
        self.splitter.addWidget(left)

        self.streams = StreamGrid()
        center = QWidget()
        center_lay = QVBoxLayout(center)
        center_lay.setContentsMargins(4, 8, 4, 8)
        center_lay.setSpacing(4)
        head = QLabel("STREAMS")
        head.setObjectName("panelTitle")
        center_lay.addWidget(head)
        center_lay.addWidget(self.streams, 1)
        self.splitter.addWidget(center)

        self.tabs = QTabWidget()
        self.tabs.setObjectName("sideTabs")
        self.tabs.setDocumentMode(False)
        charts_cls, cache_cls = optional_panels()
        self.charts = charts_cls() if charts_cls else None
        self.cache_panel = cache_cls() if cache_cls else None
        summary = getattr(self.charts, "summary", None)
        if isinstance(summary, QLabel):
            # The charts' one-line summary grows with the session's numbers; unwrapped, its
            # width raises the pane's minimum and the splitter squeezes the streams mid-run.
            summary.setWordWrap(True)
        self.tabs.addTab(self.charts or _placeholder("Live charts will appear here (ui.charts)."), "Charts")
        self.tabs.addTab(self.cache_panel or _placeholder("The cache visualizer will appear here "
                                                          "(ui.cache_panel)."), "Cache")
        if self.cache_panel is not None and hasattr(self.cache_panel, "probe_requested"):
            self.cache_panel.probe_requested.connect(self.probe_selected)
        self.requests_table = QTableWidget(0, len(REQUEST_COLUMNS))
        self.requests_table.setHorizontalHeaderLabels(REQUEST_COLUMNS)
        self.requests_table.verticalHeader().hide()
        self.requests_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.requests_table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.requests_table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.tabs.addTab(self.requests_table, "Requests")
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

        self.prompt_list.run_requested.connect(self.run_prompt)
        self.prompt_list.changed.connect(self._prompts_changed)

    def _action(self, text: str, slot, shortcut=None, icon_name: str | None = None, tip: str = "") -> QAction:
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
        act.triggered.connect(slot)
        self.addAction(act)  # shortcuts work even with the menu bar hidden
        return act

    def _build_actions(self) -> None:
        self.act_open = self._action("&Open model…", self.open_model_dialog, QKeySequence.StandardKey.Open,
                                     "open", "Open a GGUF model (Ctrl+O)")
        self.act_open_scenario = self._action("Open scenario &file…", self.open_scenario_dialog,
                                              icon_name="scenario")
        self.act_export = self._action("&Export report…", self.export_report, "Ctrl+E", "export",
                                       "Export a report of this session (Ctrl+E)")
        self.act_open_report = self._action("Open &report…", self.open_report, "Ctrl+Shift+E")
        self.act_quit = self._action("&Quit", self.close, QKeySequence.StandardKey.Quit)
        self.act_run_all = self._action("&Run all", self.run_all, ["Ctrl+Return", "Ctrl+Enter"], "run",
                                        "Submit every prompt together (Ctrl+Enter)")
        self.act_run_selected = self._action("Run &selected", self.run_selected, "Ctrl+R", "run-one",
                                             "Run the selected prompt alone (Ctrl+R)")
        self.act_stop_all = self._action("&Stop all", self.stop_all, "Esc", "stop", "Stop every stream (Esc)")
        self.act_flush = self._action("&Flush cache", self.flush_cache, icon_name="flush",
                                      tip="Give back every cached page no stream is using")
        self.act_probe = self._action("&Probe selected prompt", self.probe_selected, "Ctrl+P",
                                      tip="How far the selected prompt would match the cache")
        self.act_settings = self._action("&Settings…", self.open_settings, "Ctrl+,", "settings",
                                         "Pool, cache, scheduler and sampling settings")
        self.act_about = self._action("&About PrefixLab", self.show_about, icon_name="info")
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
        self.recent_menu.aboutToShow.connect(self._fill_recent_menu)
        self._fill_recent_menu()
        file_menu.addSeparator()
        self.scenario_menu = file_menu.addMenu(icon("scenario"), "&Scenarios")
        self._fill_scenario_menu(self.scenario_menu)
        file_menu.addSeparator()
        file_menu.addAction(self.act_export)
        file_menu.addAction(self.act_open_report)
        file_menu.addSeparator()
        file_menu.addAction(self.act_quit)
        run_menu = bar.addMenu("&Run")
        for act in (self.act_run_all, self.act_run_selected, self.act_stop_all):
            run_menu.addAction(act)
        run_menu.addSeparator()
        run_menu.addAction(self.act_probe)
        run_menu.addAction(self.act_flush)
        run_menu.addSeparator()
        run_menu.addAction(self.act_settings)
        view_menu = bar.addMenu("&View")
        for act in self.theme_actions.values():
            view_menu.addAction(act)
        view_menu.addSeparator()
        view_menu.addAction(self._action("Reset &layout", self.reset_layout))
        help_menu = bar.addMenu("&Help")
        help_menu.addAction(self.act_about)
        # The prompt list's scenario button opens the same list.
        button_menu = QMenu(self)
        self._fill_scenario_menu(button_menu)
        self.prompt_list.scenario_button.setMenu(button_menu)

    def _build_toolbar(self) -> None:
        tb = QToolBar("Main")
        tb.setObjectName("mainToolbar")
        tb.setMovable(False)
        tb.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        for act in (self.act_run_all, self.act_stop_all, self.act_flush, self.act_settings):
            tb.addAction(act)
        tb.addSeparator()
        self.model_bar = ModelBar()
        self.model_bar.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.model_bar.open_clicked.connect(self.open_model_dialog)
        tb.addWidget(self.model_bar)
        self.addToolBar(tb)
        self.toolbar = tb

    def _build_status_bar(self) -> None:
        sb = self.statusBar()
        self.state_label = QLabel("starting")
        self.pool_label = QLabel("no pool yet")
        self.pool_label.setToolTip("KV pool pages by state, cached chains, hits and prefill saved")
        sb.addPermanentWidget(self.pool_label)
        sb.addPermanentWidget(self.state_label)

    def _connect_worker(self) -> None:
        w = self.client.worker
        # Bound methods of this QObject: Qt queues the calls into the UI thread.
        w.model_loaded.connect(self._on_model_loaded)
        w.model_load_failed.connect(self._on_model_load_failed)
        w.model_checked.connect(self._on_model_checked)
        w.requests_submitted.connect(self._on_requests_submitted)
        w.request_refused.connect(self._on_request_refused)
        w.token_generated.connect(self._on_tokens)
        w.request_finished.connect(self._on_request_finished)
        w.stats_updated.connect(self._on_stats)
        w.scheduler_reset.connect(self._on_scheduler_reset)
        w.run_finished.connect(self._on_run_finished)
        w.failed.connect(self._on_worker_failed)
        w.probe_ready.connect(self._on_probe_ready)
        w.cache_flushed.connect(self._on_cache_flushed)
        w.report_ready.connect(self._on_report_ready)

    def _fill_recent_menu(self) -> None:
        self.recent_menu.clear()
        paths = recent_models(self.store)
        for path in paths:
            act = self.recent_menu.addAction(os.path.basename(path))
            act.setToolTip(path)
            act.setStatusTip(path)
            act.triggered.connect(lambda _=False, p=path: self.open_model_path(p))
        if not paths:
            self.recent_menu.addAction("(none yet)").setEnabled(False)
        else:
            self.recent_menu.addSeparator()
            self.recent_menu.addAction("Clear list", self._clear_recent)

    def _clear_recent(self) -> None:
        self.store.setValue("recent_models", [])
        self.store.sync()

    def _fill_scenario_menu(self, menu: QMenu) -> None:
        try:
            scenarios = bundled_scenarios()
        except (OSError, ValueError) as e:
            scenarios = []
            menu.addAction(f"(scenarios unreadable: {e})").setEnabled(False)
        for sc in scenarios:
            act = menu.addAction(sc.name)
            act.setToolTip(sc.description)
            act.setStatusTip(sc.description)
            act.triggered.connect(lambda _=False, s=sc: self.load_scenario(s))
        menu.addSeparator()
        menu.addAction(self.act_open_scenario)

    # model --------------------------------------------------------------------
    def load_model(self, path: str | None) -> bool:
        """Load a model in the worker (None: the bundled one). Asks first if streams run."""
        if self._open_tags:
            if not self.confirm("Switch model?",
                                f"{len(self._open_tags)} stream(s) are still running. Stop them and "
                                f"load {os.path.basename(path) if path else 'the bundled model'}?"):
                return False
            self.stop_all()
        self._loading = True
        self._loading_path = path
        self.model_bar.set_loading(os.path.basename(path) if path else "the bundled model")
        self.state_label.setText("loading model…")
        self._update_actions()
        self.client.load_model(path)
        return True

    def open_model_path(self, path: str) -> bool:
        return self.load_model(os.path.abspath(path))

    def open_model_dialog(self) -> None:
        start = os.path.dirname(recent_models(self.store)[0]) if recent_models(self.store) else ""
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", start,
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.open_model_path(path)

    @Slot(dict)
    def _on_model_loaded(self, info: dict) -> None:
        self.model_info = info
        self._loading = False
        self.model_bar.set_model(info)
        if self._loading_path:
            add_recent_model(info["path"], self.store)
        self._loading_path = None
        self.setWindowTitle(f"PrefixLab — {info['name']}")
        if info.get("template_warning"):
            self.statusBar().showMessage(f"Warning: {info['template_warning']}")
        else:
            self.statusBar().showMessage(f"Loaded {info['file']} in {info['load_seconds']:.2f} s", 6000)
        self._update_actions()
        self.model_ready.emit(info)

    @Slot(str)
    def _on_model_load_failed(self, message: str) -> None:
        self._loading = False
        self._loading_path = None
        self.model_bar.set_failed()
        self._update_actions()
        kept = f"\n\nStill using {self.model_info['name']}." if self.model_info else ""
        self.report_error("Could not load the model", message + kept)

    # drag and drop ------------------------------------------------------------
    @staticmethod
    def _dropped_file(mime, suffixes=(".gguf", ".json")) -> str | None:
        if mime is None or not mime.hasUrls():
            return None
        for url in mime.urls():
            if url.isLocalFile() and url.toLocalFile().lower().endswith(suffixes):
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
        self.handle_dropped_file(path)

    def handle_dropped_file(self, path: str) -> None:
        """A .gguf opens as the model; a .json loads as a scenario.

        While streams run, a dropped file is checked first: one that is no model shows its
        error and leaves the streams alone; only a real model asks to stop them.
        """
        if path.lower().endswith(".json"):
            self.load_scenario_file(path)
        elif self._open_tags:
            self.statusBar().showMessage(f"Checking {os.path.basename(path)}…", 4000)
            self.client.check_model(os.path.abspath(path))
        else:
            self.open_model_path(path)

    @Slot(str, str)
    def _on_model_checked(self, path: str, why: str) -> None:
        if self._closed:
            return
        if why:
            kept = f"\n\nStill using {self.model_info['name']}." if self.model_info else ""
            self.report_error("Could not load the model", why + kept)
        else:
            self.open_model_path(path)

    # scenarios ----------------------------------------------------------------
    def load_scenario(self, sc: Scenario) -> None:
        """Put a scenario's system prompt and prompts in the editors (earlier transcripts stay)."""
        self.system_edit.setPlainText(sc.system)
        if sc.prompts:
            self.prompt_list.set_prompts(sc.prompts)
            self._scripts = {}
        else:
            uids = self.prompt_list.set_prompts(sc.conversation[:1])
            self._scripts = {uids[0]: list(sc.conversation[1:])}
        if sc.max_new_tokens != self.settings.max_new_tokens:
            s = AppSettings.from_dict({**self.settings.to_dict(), "max_new_tokens": sc.max_new_tokens})
            if not s.errors():
                self.apply_settings(s)
        turns = f", a {len(sc.conversation)}-turn conversation" if sc.conversation else \
            f", {len(sc.prompts)} prompts"
        self.statusBar().showMessage(f"Scenario: {sc.name}{turns} — press Run all (Ctrl+Enter)", 8000)

    def load_scenario_file(self, path: str) -> None:
        try:
            self.load_scenario(load_scenario(path))
        except ValueError as e:
            self.report_error("Could not load the scenario", str(e))

    def open_scenario_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a scenario", "", "Scenarios (*.json)")
        if path:
            self.load_scenario_file(path)

    # running ------------------------------------------------------------------
    def system_prompt(self) -> str:
        return self.system_edit.toPlainText().strip()

    def _can_run(self) -> bool:
        if self.model_info is None:
            self.statusBar().showMessage("No model is loaded yet", 4000)
            return False
        if self._loading:
            self.statusBar().showMessage("Wait for the model to load", 4000)
            return False
        return True

    def run_all(self) -> int:
        """Submit every prompt together, each as a new conversation; return how many."""
        if not self._can_run():
            return 0
        jobs = []
        for uid, text in self.prompt_list.prompts():
            card = self._card_for(uid, text)
            if not card.running:
                jobs.append(self._first_turn_job(card, text))
        if not jobs:
            self.statusBar().showMessage("Add a prompt first (type it under the list and press Enter)", 5000)
            return 0
        self.client.submit(jobs)
        self._update_actions()
        return len(jobs)

    def run_selected(self) -> None:
        sel = self.prompt_list.selected()
        if sel is not None:
            self.run_prompt(sel[0])

    def run_prompt(self, uid: str) -> bool:
        """Run one prompt alone, as a new conversation."""
        if not self._can_run():
            return False
        text = self.prompt_list.text_of(uid)
        card = self.streams.card(uid)
        if text is None:  # the prompt was removed; its card can still rerun its first message
            first = [t for t in card.turns if t.conversation_id == card.conversation_id] if card else []
            if not first:
                return False
            text = first[0].user
        card = self._card_for(uid, text)
        if card.running:
            return False
        self.client.submit([self._first_turn_job(card, text)])
        self.streams.ensure_visible(uid)
        self._update_actions()
        return True

    def send_followup(self, uid: str, text: str) -> bool:
        """A follow-up turn in the card's conversation (the scheduler extends its tokens)."""
        card = self.streams.card(uid)
        if card is None or card.running or not self._can_run():
            return False
        self.client.submit([self._turn_job(card, text, followup=True)])
        self._update_actions()
        return True

    def stop_all(self) -> None:
        """Stop every stream (Esc); what they produced stays."""
        self._script_queue.clear()
        if self._open_tags:
            self.client.cancel(self._open_tags)
            self.statusBar().showMessage(f"Stopping {len(self._open_tags)} stream(s)…", 3000)

    def stop_stream(self, uid: str) -> None:
        card = self.streams.card(uid)
        self._script_queue.pop(uid, None)
        if card is not None and card.tag is not None:
            self.client.cancel([card.tag])

    def _card_for(self, uid: str, title: str) -> StreamView:
        card = self.streams.card(uid)
        if card is None:
            card = StreamView(uid, title)
            card.stop_clicked.connect(self.stop_stream)
            card.run_clicked.connect(self.run_prompt)
            card.followup_submitted.connect(self.send_followup)
            self.streams.add(card)
            self.streams.order([u for u, _ in self.prompt_list.prompts()])
        else:
            card.set_title(title)
        return card

    def _first_turn_job(self, card: StreamView, text: str) -> dict:
        self._conversations += 1
        card.start_conversation(f"{card.uid}-{self._conversations}-{self._nonce}", self.system_prompt())
        self._script_queue[card.uid] = list(self._scripts.get(card.uid, []))
        return self._turn_job(card, text, followup=False)

    def _turn_job(self, card: StreamView, text: str, followup: bool) -> dict:
        s = self.settings
        job = {"system": card.system, "user": text, "conversation_id": card.conversation_id,
               "max_new_tokens": s.max_new_tokens, "namespace": s.namespace,
               "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                            "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
                            "seed": None if s.seed < 0 else s.seed}}
        if followup:
            job["messages"] = card.history_messages(text)
        tag = self.client.new_tag()
        job["tag"] = tag
        card.begin_turn(text, tag)
        self._tag_card[tag] = card
        self._open_tags.add(tag)
        return job

    # worker events ------------------------------------------------------------
    @Slot(list)
    def _on_requests_submitted(self, accepted: list) -> None:
        for tag, rid, n_prompt in accepted:
            card = self._tag_card.get(tag)
            if card is None:
                continue
            self._rid_tag[rid] = tag
            card.set_request(rid, n_prompt)
        self._update_actions()

    @Slot(str, str)
    def _on_request_refused(self, tag: str, message: str) -> None:
        card = self._tag_card.pop(tag, None)
        self._open_tags.discard(tag)
        if card is not None:
            card.refused(message)
        self.statusBar().showMessage(f"Request refused: {message}", 8000)
        self._update_actions()

    @Slot(list)
    def _on_tokens(self, pieces: list) -> None:
        for rid, text in pieces:
            card = self._tag_card.get(self._rid_tag.get(rid, ""))
            if card is not None:
                card.append(text)

    def _flush_streams(self) -> None:
        for card in self.streams.cards.values():
            if card.dirty:
                card.flush()

    @Slot(object)
    def _on_request_finished(self, record) -> None:
        tag = self._rid_tag.pop(record.id, None)
        card = self._tag_card.pop(tag, None) if tag is not None else None
        self._open_tags.discard(tag)
        if card is not None:
            card.finish(record)
        self.finished_records.append(record)
        self._add_request_row(record)
        self._update_actions()
        self.stream_finished.emit(record)
        if card is not None and record.finish_reason != "cancelled":
            queue = self._script_queue.get(card.uid)
            if queue:
                self.client.submit([self._turn_job(card, queue.pop(0), followup=True)])

    @Slot(object)
    def _on_stats(self, snap) -> None:
        self.snapshot = snap
        rows = snap.timeline[self._rows_seen:]
        self._rows_seen = len(snap.timeline)
        if self.charts is not None and self._showing_report:
            self.charts.set_data(list(snap.timeline), snap.records)  # back from a report to live data
        elif self.charts is not None and rows:
            self.charts.append(rows, snap.records)
        self._showing_report = False
        if self.cache_panel is not None:
            self.cache_panel.update_snapshot(snap)
        for r in snap.records:
            if r.finish_reason is None and r.id in self._rid_tag:
                card = self._tag_card.get(self._rid_tag[r.id])
                if card is not None:
                    card.update_live(r)
        self._update_pool_label(snap)

    @Slot(dict)
    def _on_scheduler_reset(self, settings: dict) -> None:
        self._rows_seen = 0
        self.snapshot = None
        if self.charts is not None:
            self.charts.clear()
        pool = settings.get("pool_pages") or "growing"
        self.statusBar().showMessage(
            f"New KV pool: {settings.get('page_rows')} rows per page, {pool} pages; the cache is empty", 6000)

    @Slot()
    def _on_run_finished(self) -> None:
        self._update_actions()
        self._save_session()
        self.run_done.emit()

    @Slot(str)
    def _on_worker_failed(self, message: str) -> None:
        self.report_error("Engine error", message)

    @Slot(int)
    def _on_cache_flushed(self, n: int) -> None:
        self.statusBar().showMessage(f"Flushed {n} cached page(s)", 5000)

    @Slot(dict)
    def _on_probe_ready(self, result: dict) -> None:
        self.last_probe = result
        if self.cache_panel is not None and hasattr(self.cache_panel, "show_probe"):
            self.cache_panel.show_probe(result)
        self.statusBar().showMessage(
            f"Probe: {result['matched_tokens']} of {result['n_prompt']} tokens would come from the cache "
            f"({result['stop_reason']})", 8000)

    # cache, probe, settings ---------------------------------------------------------
    def flush_cache(self) -> None:
        self.client.flush_cache()

    def probe_selected(self) -> bool:
        """Ask the worker how far the selected prompt (else the first) would match the cache."""
        sel = self.prompt_list.selected() or next(iter(self.prompt_list.prompts()), None)
        if sel is None or self.model_info is None:
            self.statusBar().showMessage("Select a prompt to probe", 4000)
            return False
        self.client.probe(self.system_prompt(), sel[1], self.settings.namespace)
        return True

    def open_settings(self) -> None:
        dlg = SettingsDialog(self.settings, self)
        dlg.flush_requested.connect(self.flush_cache)
        if dlg.exec() and dlg.result_settings is not None:
            self.apply_settings(dlg.result_settings)

    def apply_settings(self, s: AppSettings) -> None:
        """Use and remember new settings (pool changes take effect when no stream runs)."""
        s.validate()
        pool_change = (s.page_rows, s.pool_pages) != (self.settings.page_rows, self.settings.pool_pages)
        self.settings = s
        s.save(self.store)
        self.client.apply_settings(s)
        self._update_run_hint()
        if pool_change and self._open_tags:
            self.statusBar().showMessage("The new pool starts when the running streams finish", 6000)

    # reports --------------------------------------------------------------------
    @staticmethod
    def reports_available() -> bool:
        try:
            return all(importlib.util.find_spec(m) for m in ("app.report", "app.report.render"))
        except (ImportError, ValueError):
            return False

    def export_report(self) -> None:
        if not self.reports_available():
            self.report_info("Export report", "Reports are not available yet.")
            return
        if self.model_info is None:
            self.report_info("Export report", "Load a model and run some prompts first.")
            return
        path, _ = QFileDialog.getSaveFileName(
            self, "Export report", "prefixlab-report.html",
            "HTML report (*.html);;PDF report (*.pdf);;JSON data (*.json)")
        if path:
            self.client.make_report(path, self.system_prompt())

    @Slot(str, object)
    def _on_report_ready(self, path: str, report) -> None:
        try:
            from app.report.render import export_report
            written = export_report(path, report)
        except Exception as e:  # noqa: BLE001 - show any rendering problem
            self.report_error("Could not export the report", f"{path}: {type(e).__name__}: {e}")
            return
        self.last_report_paths = list(written or [path])
        self.statusBar().showMessage(f"Report written to {', '.join(self.last_report_paths)}", 8000)

    def open_report(self) -> None:
        if not self.reports_available():
            self.report_info("Open report", "Reports are not available yet.")
            return
        path, _ = QFileDialog.getOpenFileName(self, "Open report", "", "PrefixLab reports (*.json);;All (*)")
        if path:
            self.open_report_path(path)

    def open_report_path(self, path: str) -> bool:
        """Show a saved report's charts, pool and chains (live data returns with the next run)."""
        try:
            from app.report import load_report, snapshot_from_report
            report = load_report(path)
            snap = snapshot_from_report(report)
        except Exception as e:  # noqa: BLE001
            self.report_error("Could not open the report", f"{path}: {type(e).__name__}: {e}")
            return False
        self.opened_report = report
        self._showing_report = True
        if self.charts is not None:
            self.charts.set_data(list(report.timeline), list(report.requests))
        if self.cache_panel is not None:
            self.cache_panel.update_snapshot(snap)
        self._update_pool_label(snap)
        self.tabs.setCurrentIndex(0)
        self.statusBar().showMessage(f"Showing the report {os.path.basename(path)} "
                                     f"({report.title}); the next run shows live data again", 10000)
        return True

    # messages -------------------------------------------------------------------------
    def report_error(self, title: str, message: str) -> None:
        """Show an error without blocking (tests read `last_error` or patch this method)."""
        self.last_error = message
        self.error_reported.emit(message)
        if self._closed:
            return
        head, _, detail = message.partition("\n\n")
        box = QMessageBox(QMessageBox.Icon.Critical, title, head, QMessageBox.StandardButton.Ok, self)
        if detail:
            box.setDetailedText(detail)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.setModal(False)
        box.show()

    def report_info(self, title: str, message: str) -> None:
        self.last_info = message
        box = QMessageBox(QMessageBox.Icon.Information, title, message, QMessageBox.StandardButton.Ok, self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.setModal(False)
        box.show()

    def confirm(self, title: str, message: str) -> bool:
        """Ask yes/no (modal; tests patch it)."""
        answer = QMessageBox.question(self, title, message,
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.Yes)
        return answer == QMessageBox.StandardButton.Yes

    def show_about(self) -> None:
        AboutDialog(self, self.model_bar.summary() if self.model_info else "").exec()

    # view -------------------------------------------------------------------------------
    def set_theme(self, name: str) -> None:
        app = QApplication.instance()
        name = apply_theme(app, name) if app is not None else name
        self.theme_actions[name].setChecked(True)
        self.store.setValue("view/theme", name)
        for card in self.streams.cards.values():
            card.rerender()
        for panel in (self.charts, self.cache_panel):
            if panel is not None and hasattr(panel, "set_theme"):
                panel.set_theme(name)

    def reset_layout(self) -> None:
        self.resize(*DEFAULT_SIZE)
        self._default_splits()

    def _default_splits(self) -> None:
        self.splitter.setSizes(DEFAULT_SPLIT)
        self.left_splitter.setSizes(DEFAULT_LEFT_SPLIT)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().showEvent(event)
        if not self._splits_restored:
            self._splits_restored = True  # first show without a saved layout: the default split
            self._default_splits()

    def _update_actions(self) -> None:
        ready = self.model_info is not None and not self._loading
        running = bool(self._open_tags)
        self.act_run_all.setEnabled(ready)
        self.run_button.setEnabled(ready)
        self.act_run_selected.setEnabled(ready)
        self.act_stop_all.setEnabled(running)
        self.stop_button.setEnabled(running)
        self.act_flush.setEnabled(ready)
        self.act_probe.setEnabled(ready)
        self.act_open.setEnabled(not self._loading)
        if self._loading:
            self.state_label.setText("loading model…")
        elif running:
            self.state_label.setText(f"● running {len(self._open_tags)} stream(s)")
        else:
            self.state_label.setText("idle" if ready else "no model")
        self._update_run_hint()

    def _update_run_hint(self) -> None:
        s = self.settings
        sampling = "greedy" if s.temperature <= 0 else f"temperature {s.temperature:g}"
        cache = "cache on" if s.cache_enabled else "cache OFF"
        ns = f", namespace “{s.namespace}”" if s.namespace else ""
        self.run_hint.setText(f"{s.max_new_tokens} new tokens · {sampling} · up to {s.max_streams} streams · "
                              f"{cache}{ns}")

    def _update_pool_label(self, snap) -> None:
        counts = np.bincount(snap.page_states.astype(np.int64), minlength=4) if len(snap.page_states) else \
            np.zeros(4, dtype=np.int64)
        text = (f"Pool {len(snap.page_states)} pages: {counts[PAGE_PRIVATE]} in use"
                f" · {counts[PAGE_SHARED]} shared"
                f" · {counts[PAGE_CACHED]} cached · {counts[PAGE_FREE]} free  │  {len(snap.chains)} chains")
        if snap.timeline:
            row = snap.timeline[-1]
            text += (f"  │  hits {row.hits}/{row.queries}  │  prefill saved {row.prefill_saved} tok "
                     f"({row.hit_rate:.0%})")
            if snap.seconds_saved:
                text += f" ≈ {snap.seconds_saved:.1f} s"
        self.pool_label.setText(text)

    def _prompts_changed(self) -> None:
        uids = [u for u, _ in self.prompt_list.prompts()]
        for uid, text in self.prompt_list.prompts():
            card = self.streams.card(uid)
            if card is not None and not card.running:
                card.set_title(text)
        self.streams.order(uids)

    def _add_request_row(self, r) -> None:
        t = self.requests_table
        row = t.rowCount()
        t.insertRow(row)
        ttft = f"{r.ttft_s * 1000:.0f} ms" if r.ttft_s is not None else "—"
        tps = f"{r.decode_tps:.1f}" if r.decode_tps else "—"
        values = [r.id, r.preview, r.n_prompt, r.n_cached, r.n_prefilled, r.n_gen, ttft, tps, r.finish_reason]
        for col, v in enumerate(values):
            item = QTableWidgetItem(str(v))
            if isinstance(v, (int, float)):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            t.setItem(row, col, item)
        t.scrollToBottom()

    # state ----------------------------------------------------------------------------
    def _restore_state(self) -> None:
        store = self.store
        theme = str(store.value("view/theme", current_theme()))
        if theme in self.theme_actions:
            self.theme_actions[theme].setChecked(True)
            if theme != current_theme() and QApplication.instance() is not None:
                apply_theme(QApplication.instance(), theme)
        geometry = store.value("window/geometry")
        if isinstance(geometry, QByteArray) and not geometry.isEmpty():
            self.restoreGeometry(geometry)
        else:
            self.resize(*DEFAULT_SIZE)
        for key, target in (("window/state", self.restoreState),
                            ("window/splitter", self.splitter.restoreState),
                            ("window/left_splitter", self.left_splitter.restoreState)):
            value = store.value(key)
            if isinstance(value, QByteArray) and not value.isEmpty():
                target(value)
                self._splits_restored = True
        tab = store.value("window/tab")
        if tab is not None:
            try:
                self.tabs.setCurrentIndex(int(tab))
            except (TypeError, ValueError):
                pass
        self._restore_session()

    def _restore_session(self) -> None:
        raw = self.store.value("session/json")
        if not raw:
            return
        try:
            data = json.loads(str(raw))
            self.system_edit.setPlainText(str(data.get("system", "")))
            self.prompt_list.set_prompts([(p[0], p[1]) for p in data.get("prompts", [])])
            self._scripts = {k: list(v) for k, v in data.get("scripts", {}).items()}
            for cd in data.get("cards", []):
                if cd.get("turns"):
                    card = self._card_for(cd["uid"], cd.get("title", ""))
                    card.restore(cd)
            self.streams.order([u for u, _ in self.prompt_list.prompts()])
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            pass  # a damaged session is not worth an error at start-up

    def session_data(self) -> dict:
        """System prompt, prompts and every transcript (what the next start restores)."""
        return {"system": self.system_edit.toPlainText(), "prompts": self.prompt_list.prompts(),
                "scripts": self._scripts,
                "cards": [self.streams.cards[u].to_dict() for u in self.streams._order]}

    def _save_session(self) -> None:
        self.store.setValue("session/json", json.dumps(self.session_data()))

    def save_state(self) -> None:
        self.store.setValue("window/geometry", self.saveGeometry())
        self.store.setValue("window/state", self.saveState())
        self.store.setValue("window/splitter", self.splitter.saveState())
        self.store.setValue("window/left_splitter", self.left_splitter.saveState())
        self.store.setValue("window/tab", self.tabs.currentIndex())
        self.store.setValue("view/theme", current_theme())
        self._flush_streams()
        self._save_session()
        self.store.sync()

    def shutdown(self) -> None:
        """Save, stop the engine thread (stop, quit, wait). Safe to call twice."""
        if self._closed:
            return
        self.save_state()
        self._closed = True
        self._flush_timer.stop()
        self.client.shutdown()

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.shutdown()
        super().closeEvent(event)
