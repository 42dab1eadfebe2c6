"""The main window's controller: every book the window keeps, with no widget in sight.

It owns the engine driver, the settings, the transcripts (one per prompt card), which open
turn (by the engine loop's ticket) belongs to which card, the scripted turns of a scenario,
the reports and the probe. Widgets never call the engine: `app.desktop` hands user actions to this object
and draws what its signals say (plain data: uids, dicts, engine records and snapshots).
"""

from __future__ import annotations

import os
import secrets

from PySide6.QtCore import QObject, QSettings, QTimer, Signal, Slot

from engine.loop import Accepted, Refused
from engine.scheduler import POOL_FIELDS, FinishEvent, TokenEvent
from engine.snapshot import Snapshot

from ..report import load_report, snapshot_from_report
from .desktop_engine import (
    CacheFlushed,
    CacheNote,
    Failed,
    KvBudget,
    LoadFailed,
    ModelChecked,
    ModelLoaded,
    ProbeReady,
    ReportReady,
    RunFinished,
    SchedulerReset,
    Served,
    TraceSaved,
)
from .engine_driver import EngineDriver
from .settings import AppSettings, add_recent_model, kept_cache_root
from .transcript import Transcript
from .turns import TurnBook

FLUSH_INTERVAL_MS = 100  # text to the cards 10x a second: UI Python stalls the engine (docs/design.md §7)


class Controller(QObject):
    """The window's state and its dealings with the engine (a QObject, no widgets)."""

    model_loading = Signal(str)           # what is loading, for people
    model_loaded = Signal(dict)           # app.model_info.model_info
    model_failed = Signal()
    model_checked = Signal(str)           # a dropped path that opens as a model
    state_changed = Signal(bool, bool, int)  # ready, loading, running streams
    settings_changed = Signal(dict)       # AppSettings.to_dict()
    status = Signal(str, int)             # a status bar message and its milliseconds
    error = Signal(str, str)              # title, message
    transcript_added = Signal(object)     # a new Transcript (its card is to be made)
    turn_started = Signal(str)            # uid
    turn_accepted = Signal(str)
    text_arrived = Signal(str, str)       # uid, answer text
    turn_live = Signal(str, object)       # uid, the running RequestRecord
    turn_finished = Signal(str)
    turn_refused = Signal(str, str)       # uid, why
    request_finished = Signal(object)     # RequestRecord
    stats = Signal(object, list, bool)    # Snapshot, its new timeline rows, whether to redraw all
    scheduler_reset = Signal()
    kv_budget = Signal(dict)              # the KV budget the pool runs under (AppSettings.kv_budget)
    probe_ready = Signal(dict)
    cache_flushed = Signal(int)           # pages flushed
    trace_saved = Signal(str, str)        # path, "" when written, else why not
    report_opened = Signal(object, object, str)  # Report, its Snapshot, the path
    run_done = Signal()

    def __init__(self, store: QSettings, parent: QObject | None = None):
        super().__init__(parent)
        self.store = store
        self.settings = AppSettings.load(store)
        self.driver = EngineDriver()
        self.model_info: dict | None = None
        self.loading = False
        self._loading_path: str | None = None
        self.snapshot = None
        self.finished_records: list = []
        self.advice_of = lambda: None  # the Advisor tab's advice (the desktop wires it) for reports
        self.last_error: str | None = None
        self.last_probe: dict | None = None
        self.opened_report = None
        self.last_report_paths: list[str] = []
        self.book = TurnBook()
        self._nonce = secrets.token_hex(3)  # served card ids differ across app runs (sessions keep cards)
        self._last_step = 0
        self._showing_report = False
        self.closed = False
        # Bound methods of this QObject: Qt queues the calls into the UI thread.
        self.driver.job_events.connect(self._on_job_events)
        self.driver.reported.connect(self._on_report)
        self._flush_timer = QTimer(self)
        self._flush_timer.setInterval(FLUSH_INTERVAL_MS)
        self._flush_timer.timeout.connect(self.flush_text)
        self._flush_timer.start()
        self.driver.set_cache_root(kept_cache_root(store))
        self.driver.apply_settings(self.settings)

    # state ------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """A model is loaded and no other is loading."""
        return self.model_info is not None and not self.loading

    @property
    def running(self) -> int:
        """How many turns are submitted and not finished."""
        return self.book.running

    @property
    def transcripts(self) -> dict[str, Transcript]:
        return self.book.transcripts

    def _changed(self) -> None:
        self.state_changed.emit(self.ready, self.loading, self.running)

    def report_error(self, title: str, message: str) -> None:
        """Every error the window shows goes through here (`last_error`, the `error` signal)."""
        self.last_error = message
        self.error.emit(title, message)

    # the model ----------------------------------------------------------------------
    def load_model(self, path: str | None) -> None:
        """Load a model on the engine thread (None: the bundled one); the caller asked about running
        streams."""
        self.loading = True
        self._loading_path = path
        self.model_loading.emit(os.path.basename(path) if path else "the bundled model")
        self._changed()
        self.driver.load_model(path)

    def check_model(self, path: str) -> None:
        """Ask whether a file opens as a model; `model_checked` or an error answers."""
        self.status.emit(f"Checking {os.path.basename(path)}…", 4000)
        self.driver.check_model(os.path.abspath(path))

    def _still_using(self) -> str:
        return f"\n\nStill using {self.model_info['name']}." if self.model_info else ""

    def _on_model_loaded(self, info: dict) -> None:
        self.model_info = info
        self.loading = False
        if self._loading_path:
            add_recent_model(info["path"], self.store)
        self._loading_path = None
        self.model_loaded.emit(info)
        if info.get("template_warning"):
            self.status.emit(f"Warning: {info['template_warning']}", 0)
        else:
            self.status.emit(f"Loaded {info['file']} in {info['load_seconds']:.2f} s", 6000)
        self._changed()

    def _on_model_load_failed(self, message: str) -> None:
        self.loading = False
        self._loading_path = None
        self.model_failed.emit()
        self._changed()
        self.report_error("Could not load the model", message + self._still_using())

    def _on_model_checked(self, path: str, why: str) -> None:
        if self.closed:
            return
        if why:
            self.report_error("Could not load the model", why + self._still_using())
        else:
            self.model_checked.emit(path)

    # running ------------------------------------------------------------------------
    def _can_run(self) -> bool:
        if self.model_info is None:
            self.status.emit("No model is loaded yet", 4000)
            return False
        if self.loading:
            self.status.emit("Wait for the model to load", 4000)
            return False
        return True

    def transcript(self, uid: str, title: str) -> Transcript:
        """The transcript of a prompt's card, made (and announced) on first use."""
        t = self.transcripts.get(uid)
        if t is None:
            t = self.book.add(Transcript(uid, title))
            self.transcript_added.emit(t)
        return t

    def run_all(self, system: str, prompts: list[tuple[str, str]]) -> int:
        """Submit every (uid, text) prompt not running now, each as a new conversation; return how many."""
        if not self._can_run():
            return 0
        turns = [(t, text) for uid, text in prompts if not (t := self.transcript(uid, text)).running]
        if not turns:
            self.status.emit("Add a prompt first (type it under the list and press Enter)", 5000)
            return 0
        for t, text in turns:
            self._submit(t, self.book.first_turn(t, text, system, self.settings))
        self._changed()
        return len(turns)

    def run_prompt(self, uid: str, text: str | None, system: str) -> bool:
        """Run one prompt alone, as a new conversation (`text` None: its card's first message)."""
        if not self._can_run():
            return False
        known = self.transcripts.get(uid)
        if text is None:  # the prompt was removed; its card can still rerun its first message
            text = known.first_message() if known is not None else None
            if text is None:
                return False
        t = self.transcript(uid, text)
        if t.running:
            return False
        self._submit(t, self.book.first_turn(t, text, system, self.settings))
        self._changed()
        return True

    def send_followup(self, uid: str, text: str) -> bool:
        """A follow-up turn in the card's conversation (the scheduler extends its tokens)."""
        t = self.transcripts.get(uid)
        if t is None or t.running or not self._can_run():
            return False
        self._submit(t, self.book.turn(t, text, self.settings))
        self._changed()
        return True

    def stop_all(self) -> None:
        """Stop every stream; what they produced stays."""
        self.book.drop_scripts()
        if self.running:
            self.driver.cancel(self.book.open_tickets())
            self.status.emit(f"Stopping {self.running} stream(s)…", 3000)

    def stop_stream(self, uid: str) -> None:
        """Stop a card's running turn (typed or served: its client sees the answer end)."""
        self.book.drop_scripts(uid)
        self.driver.cancel(self.book.open_tickets(uid))

    def _submit(self, t: Transcript, chat_args: dict) -> None:
        """Hand a card's turn to the engine loop and file it under the ticket the loop gives."""
        self.book.opened(t, self.driver.submit(chat_args))
        self.turn_started.emit(t.uid)

    # what the engine says ---------------------------------------------------------------
    @Slot(object)
    def _on_report(self, report) -> None:
        """One report of the engine's (desktop_engine.py), in the order it was made."""
        match report:
            case Snapshot():
                self._on_stats(report)
            case ModelLoaded(info):
                self._on_model_loaded(info)
            case LoadFailed(message):
                self._on_model_load_failed(message)
            case ModelChecked(path, why):
                self._on_model_checked(path, why)
            case SchedulerReset(settings):
                self._on_scheduler_reset(settings)
            case KvBudget(budget):
                self.kv_budget.emit(budget)
            case RunFinished():
                self._changed()
                self.run_done.emit()
            case Failed(message):
                self.report_error("Engine error", message)
            case ProbeReady(result):
                self._on_probe_ready(result)
            case CacheFlushed(pages):
                self.status.emit(f"Flushed {pages} cached page(s)", 5000)
                self.cache_flushed.emit(pages)
            case ReportReady(path, data):
                self._on_report_ready(path, data)
            case TraceSaved(path, why):
                self.trace_saved.emit(path, why)
            case CacheNote(line):
                self.status.emit(line, 10000)

    @Slot(list)
    def _on_job_events(self, events: list) -> None:
        """One step's events of the jobs, in order, each under its ticket."""
        changed = False  # a turn opened or ended (tokens alone change no state)
        for ticket, ev in events:
            if isinstance(ev, TokenEvent):
                t = self.book.by_ticket(ticket)
                if t is not None:
                    t.add_piece(ev.text)
                continue
            changed = True
            if isinstance(ev, Served):
                self._served(ticket, ev)
            elif isinstance(ev, Accepted):
                t = self.book.by_ticket(ticket)
                if t is not None:
                    t.accept(ev.request_id, ev.n_prompt)
                    self.turn_accepted.emit(t.uid)
            elif isinstance(ev, Refused) and ev.record is not None:
                self._finished(ticket, ev.record)  # the engine failed under it: it ends as cancelled
            elif isinstance(ev, Refused):
                self._refused(ticket, ev.message)
            elif isinstance(ev, FinishEvent):
                self._finished(ticket, ev.record)
        if changed:
            self._changed()

    def _served(self, ticket: int, ev: Served) -> None:
        """An HTTP request the app's server took: a card of its own, labelled with its client."""
        t = self.transcript(f"http-{self._nonce}-{ticket}", f"{ev.client}: {ev.preview}")
        self.book.served(t, ticket, ev.preview)
        t.accept(ev.request_id, ev.n_prompt)
        self.turn_started.emit(t.uid)
        self.turn_accepted.emit(t.uid)

    def _refused(self, ticket: int, message: str) -> None:
        t = self.book.close(ticket)
        if t is not None:  # a served job's refusal is its client's to read
            self._flush(t)
            t.refuse(message)
            self.turn_refused.emit(t.uid, message)
            self.status.emit(f"Request refused: {message}", 8000)

    def flush_text(self) -> None:
        """Hand the answer text that came in since the last flush to the cards (on a timer)."""
        for t in self.transcripts.values():
            self._flush(t)

    def _flush(self, t: Transcript) -> None:
        text = t.take_pending()
        if text:
            self.text_arrived.emit(t.uid, text)

    def _finished(self, ticket: int, record) -> None:
        t = self.book.close(ticket)
        if t is not None:
            self._flush(t)
            t.finish(record)
            self.turn_finished.emit(t.uid)
        self.finished_records.append(record)
        self.request_finished.emit(record)
        if t is not None and record.finish_reason != "cancelled":
            text = self.book.next_scripted(t.uid)
            if text is not None:
                self._submit(t, self.book.turn(t, text, self.settings))

    def _on_stats(self, snap) -> None:
        self.snapshot = snap
        # by step number: the scheduler's timeline is a ring, so its length stops growing
        rows = [r for r in snap.timeline if r.step > self._last_step]
        self._last_step = snap.timeline[-1].step if snap.timeline else self._last_step
        self.stats.emit(snap, rows, self._showing_report)  # after a report: redraw the live data
        self._showing_report = False
        running = {t.request_id: t for t in self.transcripts.values() if t.request_id is not None}
        for r in snap.records:
            t = running.get(r.id) if r.finish_reason is None else None
            if t is not None:
                self.turn_live.emit(t.uid, r)

    def _on_scheduler_reset(self, settings: dict) -> None:
        self._last_step = 0
        self.snapshot = None
        self.scheduler_reset.emit()
        self.status.emit(f"New KV pool: {settings.get('page_rows')} rows per page, "
                         f"{settings.get('pool_pages') or 'growing'} pages; the cache is empty", 6000)

    def _on_probe_ready(self, result: dict) -> None:
        self.last_probe = result
        self.probe_ready.emit(result)
        self.status.emit(f"Probe: {result['matched_tokens']} of {result['n_prompt']} tokens would come from "
                         f"the cache ({result['stop_reason']})", 8000)

    # cache, probe, settings ------------------------------------------------------
    def flush_cache(self) -> None:
        self.driver.flush_cache()
    def probe(self, system: str, user: str | None) -> bool:
        """Ask the engine how far (system, user) would match the cache."""
        if user is None or self.model_info is None:
            self.status.emit("Select a prompt to probe", 4000)
            return False
        self.driver.probe(system, user, self.settings.namespace)
        return True

    def apply_settings(self, s: AppSettings) -> None:
        """Use and remember new settings (pool changes take effect when no stream runs)."""
        s.validate()
        pool_change = any(getattr(s, f) != getattr(self.settings, f) for f in POOL_FIELDS)
        self.settings = s
        s.save(self.store)
        self.driver.apply_settings(s)
        self.settings_changed.emit(s.to_dict())
        if pool_change and self.running:
            self.status.emit("The new pool starts when the running streams finish", 6000)

    # reports ----------------------------------------------------------------------------
    def export_report(self, path: str, system: str) -> None:
        """Build the report in the engine thread; it is written (any format) when it comes back."""
        self.driver.make_report(path, system)

    def _on_report_ready(self, path: str, report) -> None:
        from ..report.render import export_report  # Qt rendering, loaded on the first export

        report.advice = self.advice_of()  # the Advisor tab's advice, when it has some
        try:
            written = export_report(path, report)
        except Exception as e:  # noqa: BLE001 - show any rendering problem
            self.report_error("Could not export the report", f"{path}: {type(e).__name__}: {e}")
            return
        self.last_report_paths = list(written or [path])
        self.status.emit(f"Report written to {', '.join(self.last_report_paths)}", 8000)

    def open_report(self, path: str) -> bool:
        """Show a saved report's charts, pool and chains (live data returns with the next run)."""
        try:
            report = load_report(path)
            snap = snapshot_from_report(report)
        except Exception as e:  # noqa: BLE001 - any broken file is an error shown, never a crash
            self.report_error("Could not open the report", f"{path}: {type(e).__name__}: {e}")
            return False
        self.opened_report = report
        self._showing_report = True
        self.report_opened.emit(report, snap, path)
        return True

    # the session --------------------------------------------------------------------------
    def session_data(self, system: str, prompts: list, order: list[str]) -> dict:
        """System prompt, prompts, scripts and every transcript (what the next start restores)."""
        return {"system": system, "prompts": prompts, "scripts": self.book.scripts,
                "cards": self.book.session_cards(order)}

    def restore_transcripts(self, data: dict) -> None:
        """The scripts and transcripts of `session_data` (a session saved by any earlier version)."""
        for t in self.book.restore(data):
            self.transcript_added.emit(t)

    def shutdown(self) -> None:
        """Stop the engine thread (stop, quit, wait). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._flush_timer.stop()
        self.driver.shutdown()
