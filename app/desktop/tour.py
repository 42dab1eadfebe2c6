"""The guided tour in the window: "The Prefix Cache by Hand", one step per Next, on the real engine.

The engine work (app.tour_engine) runs on the tour's own thread, on the loaded model and a
small pool and cache of its own, so the UI thread never waits on a prefill and the app's
scheduler is left alone. Each step's snapshot is drawn by the window's own page map, chains
table and charts; its caption quotes the step's numbers. The first start opens the tour
(remembered in QSettings); Help -> Tour opens it again.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QDockWidget, QWidget

from engine.snapshot import SnapshotMaker
from ui.tour_panel import TourPanel

from ..scenario import bundled_scenarios
from .tour_engine import TourEngine

SEEN_KEY = "tour/seen"
SCENARIO = "hardware store"   # the tutorial's store: its system prompt and first two questions
TITLES = {"intro": "two questions, one system prompt", "prefill_a": "A prefills its prompt",
          "donate_a": "A donates its pages", "release_a": "A releases its session",
          "attach_b": "B attaches the cached pages", "prefill_b": "B prefills only its tail",
          "chains": "the chains and the held pages", "teardown": "teardown", "done": "your turn"}
TABS = {"prefill_b": "charts"}  # the rest show the Cache tab: the page map and the chains
STEPS = TourEngine.STEPS + ("done",)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f} ms"


def caption(f: dict) -> str:
    """One or two sentences for a step's facts (the numbers come from the engine)."""
    s, rows = f["step"], f.get("page_rows", 0)
    if s == "intro":
        return (f"Two customers ask the store's assistant: A's prompt is {f['n_prompt_a']} tokens, B's "
                f"{f['n_prompt_b']}, and both start with the same system prompt. Each cell of the page map "
                f"is a KV page of {rows} positions; Next prefills A on the loaded model.")
    if s == "prefill_a":
        return (f"A prefilled all <b>{f['n_prompt']}</b> prompt tokens in <b>{_ms(f['seconds'])}</b>: they "
                f"fill <b>{f['pages']}</b> pages ({f['full_pages']} full), all private to A.")
    if s == "donate_a":
        return (f"A donated <b>{f['added']}</b> full pages ({f['tokens']} of its {f['n_past']} tokens) to "
                f"the prefix cache: they are shared now, held by A and by the cache. A page only part "
                f"full is never cached.")
    if s == "release_a":
        return (f"A released its session: {f['returned']} page(s) went back to the free list, and the cache "
                f"still holds <b>{f['held']}</b> pages, now held only by the cache (reference count 1).")
    if s == "attach_b":
        refs = ", ".join(f"page {p}: {n}" for p, n in f["refcounts"].items())
        parts = ", ".join(f"{k} {n}" for k, n in f["parts"].items() if n and k != "disk")
        return (f"B attached <b>cached {f['matched']} of {f['n_prompt']}</b> prompt tokens: "
                f"{f['matched_pages']} pages by reference, not copied. Their reference counts: {refs} "
                f"(the cache and B). Where B's prompt tokens went: <b>{parts}</b>.")
    if s == "prefill_b":
        return (f"B prefilled only its <b>{f['tail']}</b>-token tail, in <b>{_ms(f['seconds'])}</b>; its "
                f"whole prompt of {f['n_prompt']} tokens would take ≈ {_ms(f['whole_estimate'])}: the tail "
                f"plus the cached tokens at this session's prefill rate (the TTFT chart: B's bar beside "
                f"its estimate without the cache).")
    if s == "chains":
        chains = "; ".join(f"chain #{c['id']}: {c['n_tokens']} tokens, {c['pages_live']} pages live, "
                           f"{c['hits']} hit(s)" for c in f["chains"]) or "no chain"
        return (f"The cache's chain list — {chains}. It holds pages {f['held']}, <b>{len(f['shared'])}</b> "
                f"of them shared with B.")
    if s == "teardown":
        return (f"Teardown, in order: B released its session, then the cache handed back its "
                f"<b>{f['released']}</b> pages. The pool has <b>{f['pages_in_use']}</b> pages in use of "
                f"{f['capacity']}: empty.")
    return ("Your turn: the store's system prompt and its questions are loaded. Press <b>Run all</b> "
            "(Ctrl+Enter): the scheduler runs them together, and the first one's pages serve the others.")


class TourRunner(QObject):
    """Lives on the tour's thread: makes the TourEngine and runs its steps."""

    done = Signal(dict, object)  # the step's facts, a Snapshot for the page map, chains and charts
    failed = Signal(str)

    def __init__(self):
        super().__init__()
        self.engine: TourEngine | None = None
        self._maker = SnapshotMaker()

    @Slot(object, str, str, str)
    def begin(self, model, system: str, question_a: str, question_b: str) -> None:
        try:
            self.engine = TourEngine(model, system, question_a, question_b)
        except Exception as e:  # noqa: BLE001 - shown in the panel, never a dead thread
            self.failed.emit(f"{type(e).__name__}: {e}")
            return
        self._maker = SnapshotMaker()
        self.step("intro")

    @Slot(str)
    def step(self, name: str) -> None:
        try:
            facts = self.engine.run(name)
            facts["script"] = self.engine.python_script(self.engine.model.path)  # Copy as Python
            if name == "intro":
                facts["texts"] = (self.engine.texts[1], self.engine.texts[2], self.engine.shared_chars())
            snap = self._maker.take(self.engine, since_row=0)
        except Exception as e:  # noqa: BLE001
            self.failed.emit(f"{type(e).__name__}: {e}")
            return
        self.done.emit(facts, snap)


class Tour(QObject):
    """The tour's panel (docked at the top of the window), its thread and the steps' order."""

    step_shown = Signal(str)  # the step now shown (tests wait on it)
    closed = Signal()
    _begin = Signal(object, str, str, str)
    _step = Signal(str)

    def __init__(self, desktop):
        super().__init__(desktop)
        self.desktop, w = desktop, desktop.window
        self.scenario = next(s for s in bundled_scenarios() if SCENARIO in s.name.lower())
        self.facts: dict[str, dict] = {}
        self.current = ""
        self.panel = TourPanel()
        self.dock = QDockWidget("Tour", w)
        self.dock.setObjectName("tourDock")
        self.dock.setFeatures(QDockWidget.DockWidgetFeature.NoDockWidgetFeatures)
        self.dock.setTitleBarWidget(QWidget())  # no title bar: the panel says what it is
        self.dock.setWidget(self.panel)
        w.addDockWidget(Qt.DockWidgetArea.TopDockWidgetArea, self.dock)
        self.thread = QThread()
        self.thread.setObjectName("prefixlab-tour")
        self.runner = TourRunner()
        self.runner.moveToThread(self.thread)
        self._begin.connect(self.runner.begin)
        self._step.connect(self.runner.step)
        self.runner.done.connect(self._on_done)
        self.runner.failed.connect(self._on_failed)
        self.panel.next_clicked.connect(self.next)
        self.panel.skip_clicked.connect(self.close)
        self.panel.copy_clicked.connect(self.copy_script)
        self.panel.run_all_clicked.connect(w.act_run_all.trigger)
        w.act_run_all.triggered.connect(self._on_run_all)
        w.closing.connect(self.shutdown)
        self.thread.start()
        self.panel.show_working("Loading the model for the tour")
        c = desktop.controller
        self._waiting = not c.ready
        if c.ready:
            self._start()
        else:
            c.model_loaded.connect(self._start)

    @property
    def active(self) -> bool:
        return self.thread.isRunning()

    def _start(self, *_args) -> None:
        if self._waiting:
            self._waiting = False
            self.desktop.controller.model_loaded.disconnect(self._start)
        if not self.active:
            return  # skipped while the model loaded
        # The engine thread loaded this model; the tour thread only evaluates on it (its
        # weights are read-only), on a pool and cache of its own.
        model = self.desktop.controller.driver.engine.model
        sc = self.scenario
        self.panel.show_working("Preparing the tutorial's two prompts")
        self._begin.emit(model, sc.system, sc.prompts[0], sc.prompts[1])

    def next(self) -> None:
        """Run the step after the one shown (the last one loads the prompts)."""
        if self.current in ("", "done"):
            return  # still preparing, or nothing after the last step
        following = STEPS[STEPS.index(self.current) + 1]
        if following == "done":
            self._show_done()
            return
        self.panel.show_working(f"Step {STEPS.index(following) + 1}: {TITLES[following]}")
        self._step.emit(following)

    @Slot(dict, object)
    def _on_done(self, facts: dict, snap) -> None:
        w = self.desktop.window
        self.facts[facts["step"]] = facts
        self.current = facts["step"]
        w.show_stats(snap, [], True)
        w.tabs.setCurrentWidget(w.charts if TABS.get(self.current) == "charts" else w.cache_panel)
        if "texts" in facts:
            self.panel.show_prompts(*facts["texts"])
        self.panel.show_step(STEPS.index(self.current) + 1, len(STEPS), TITLES[self.current], caption(facts),
                             code=facts.get("code", []))
        self.step_shown.emit(self.current)

    def code_shown(self) -> list[str]:
        """The calls the panel shows now, one a line."""
        text = self.panel.code.text()
        return text.splitlines() if self.panel.code.isVisible() or text else []

    def script(self) -> str:
        """The steps shown so far as a Python script on the public API."""
        done = [self.facts[s] for s in STEPS if s in self.facts]
        return done[-1]["script"] if done else ""

    def copy_script(self) -> None:
        """Copy as Python: the script to the clipboard, and a word in the status bar."""
        QGuiApplication.clipboard().setText(self.script())
        self.desktop.window.show_status("Copied the tour's steps as Python: paste them into a terminal's "
                                        "python (PYTHONPATH at this checkout)", 6000)

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self.panel.caption.setText(f"The tour stopped: {message}")
        self.panel.set_next_enabled(False, "The tour cannot go on; Skip closes it")

    def _show_done(self) -> None:
        self.desktop.load_scenario(self.scenario)
        self.current = "done"
        self.panel.show_step(len(STEPS), len(STEPS), TITLES["done"], caption({"step": "done"}), last=True)
        self.step_shown.emit("done")

    def _on_run_all(self) -> None:
        if self.current == "done":
            self.close()

    def shutdown(self) -> None:
        """End the tour's thread (the window closes)."""
        self.thread.quit()
        self.thread.wait()

    def close(self) -> None:
        """Close the panel, end the tour's thread, and give the charts and the page map back to the app."""
        if not self.active:
            return
        self.thread.quit()
        self.thread.wait()
        w = self.desktop.window
        w.act_run_all.triggered.disconnect(self._on_run_all)
        w.removeDockWidget(self.dock)
        self.dock.deleteLater()
        w.charts.clear()
        w.cache_panel.clear()
        snap = self.desktop.controller.snapshot
        if snap is not None:
            w.show_stats(snap, [], True)
        self.closed.emit()


def start_tour(desktop) -> Tour:
    """Open the tour (closing one already open)."""
    old = getattr(desktop, "tour", None)
    if old is not None:
        old.close()
    desktop.tour = Tour(desktop)
    return desktop.tour


def install_tour_action(desktop) -> QAction:
    """Help -> Tour."""
    w = desktop.window
    act = QAction("&Tour: the prefix cache by hand", w)
    act.setStatusTip("A guided tour of the prefix cache, step by step on the loaded model")
    act.triggered.connect(lambda: start_tour(desktop))
    help_menu = next(a.menu() for a in w.menuBar().actions() if a.text() == "&Help")
    help_menu.insertAction(help_menu.actions()[0] if help_menu.actions() else None, act)
    w.act_tour = act
    return act


def maybe_start_tour(desktop) -> Tour | None:
    """Install Help -> Tour; the first start (nothing in QSettings yet) also opens the tour."""
    install_tour_action(desktop)
    store = desktop.store
    if str(store.value(SEEN_KEY, "false")).lower() == "true":
        return None
    store.setValue(SEEN_KEY, True)
    store.sync()
    return start_tour(desktop)
