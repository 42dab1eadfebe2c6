"""The engine's one long-lived worker thread (DESIGN §6).

`EngineWorker` is a QObject moved to a parentless QThread. It holds the Model
and the Scheduler; nothing else touches them. The UI feeds it by queued
signals (through `EngineClient`, which lives in the UI thread) and gets plain
data back by signals: token pieces batched per step, finished records, and a
Snapshot copy at most ~10 times a second. Cancellation is a flag the worker
checks between steps, so a stop lands within one step even while the event
queue is busy.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback

from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

import engine
from engine.scheduler import POOL_FIELDS, Scheduler, SubmitRefused
from engine.snapshot import SnapshotMaker

from .blas_share import leave_core_for_ui
from .driver import EngineDriver, finished_records, token_pieces
from .model_info import model_info
from .probe import probe_prompt
from .report import build_report
from .settings import AppSettings

STATS_INTERVAL_S = 0.1        # stats_updated at most ~10 Hz: each costs both threads time
LOAD_POLL_S = 0.05            # a load in progress looks this often whether the app quits


def guarded(fn):
    """Run a worker slot; any exception becomes the `failed` signal, never a dead thread."""

    @functools.wraps(fn)
    def wrapper(self, *args):
        try:
            return fn(self, *args)
        except Exception as e:  # noqa: BLE001 - reported to the user, the thread lives on
            self.failed.emit(f"{fn.__name__}: {type(e).__name__}: {e}\n\n{traceback.format_exc(limit=6)}")
            return None

    return wrapper


class EngineWorker(QObject):
    """Holds the Model and the Scheduler; steps the scheduler while there is work."""

    token_generated = Signal(list)       # [(request_id, text piece), ...], one list per step
    requests_submitted = Signal(list)    # [(tag, request_id, n_prompt), ...]
    request_refused = Signal(str, str)   # tag, why
    request_finished = Signal(object)    # RequestRecord (a copy)
    stats_updated = Signal(object)       # engine.snapshot.Snapshot (a copy)
    model_loaded = Signal(dict)          # app.model_info.model_info(model)
    model_load_failed = Signal(str)
    model_checked = Signal(str, str)     # path, "" when it opens as a model, else why it does not
    scheduler_reset = Signal(dict)       # a new Scheduler (new pool, empty cache): its settings
    run_finished = Signal()
    failed = Signal(str)
    probe_ready = Signal(dict)
    cache_flushed = Signal(int)
    report_ready = Signal(str, object)   # path, report data (built here, rendered in the UI thread)
    trace_saved = Signal(str, str)       # path, "" when written, else why not
    served_submitted = Signal(list)      # [(request_id, client, preview, n_prompt), ...] from HTTP clients
    _served_waiting = Signal()           # an HTTP request arrived (emitted on the server's thread)

    def __init__(self):
        super().__init__()
        self.model = None
        self.driver = EngineDriver()
        self._settings = AppSettings()
        self._pending_settings: AppSettings | None = None
        self._maker = SnapshotMaker()
        self._last_stats = 0.0
        self.busy = False
        self._quitting = False
        # A zero-interval timer (a child, so it moves to the thread with us): each step is
        # one timer event, and queued submit/cancel/settings events run between steps.
        self._timer = QTimer(self)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self.pump)
        self.broker = None  # app.serve.broker.RequestBroker while the Server toggle is on
        self._served_waiting.connect(self._wake_for_served)

    @property
    def scheduler(self) -> Scheduler | None:
        return self.driver.scheduler

    # thread-safe flags (called from the UI thread) -------------------------
    def request_cancel(self, tags) -> None:
        """Stop these requests (by the tags they were submitted with) at the next step."""
        self.driver.request_cancel(tags)

    def attach_broker(self, broker) -> None:
        """Run HTTP requests from this broker on this worker's scheduler (None: stop taking them)."""
        if broker is not None:
            broker.wake = self._served_waiting.emit  # queued into this thread
        self.broker = broker
        self._served_waiting.emit()

    def request_shutdown(self) -> None:
        """Stop stepping at once; the queued `shutdown` slot then ends the thread."""
        self._quitting = True

    # slots (queued from the UI thread) --------------------------------------
    @Slot(str)
    @guarded
    def load_model(self, path: str) -> None:
        """Load a GGUF (the bundled model for ""); on failure keep the current model.

        The load runs in a helper thread that this one joins in short slices, so a quit
        (`request_shutdown`) ends the wait at once instead of after a big GGUF's load; the
        abandoned load is a daemon thread and touches no Qt object.
        """
        if self._quitting:
            return
        self._stop_everything()
        result: dict = {}

        def work() -> None:
            try:
                result["model"] = engine.load_model(path or None)
            except BaseException as e:  # noqa: BLE001 - handed back to this thread
                result["error"] = e

        loader = threading.Thread(target=work, name="prefixlab-load", daemon=True)
        loader.start()
        while loader.is_alive():
            loader.join(LOAD_POLL_S)
            if self._quitting:
                return
        error, model = result.get("error"), result.get("model")
        if isinstance(error, engine.ModelLoadError):
            self.model_load_failed.emit(str(error))
            return
        if model is None:  # any broken file must leave the old model
            self.model_load_failed.emit(f"{path or 'the bundled model'}: {type(error).__name__}: {error}")
            return
        self.model = model
        self._new_scheduler()
        self.model_loaded.emit(model_info(model))

    @Slot(str)
    @guarded
    def check_model(self, path: str) -> None:
        """Whether `path` opens as a model (header, metadata and tensor table only: fast)."""
        from engine.gguf_loader import open_gguf

        try:
            open_gguf(path)
        except engine.ModelLoadError as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - any broken file is only a "no"
            why = f"{path}: {type(e).__name__}: {e}"
        else:
            why = ""
        self.model_checked.emit(path, why)

    @Slot(dict)
    @guarded
    def apply_settings(self, values: dict) -> None:
        """New preferences: live ones now, pool ones (a new Scheduler) when idle."""
        new = AppSettings.from_dict(values)
        new.validate()
        self._settings = new
        s = self.scheduler
        if s is None:
            return
        live = new.scheduler_settings()
        if any(getattr(live, f) != getattr(s.settings, f) for f in POOL_FIELDS):
            if s.has_work():
                self._pending_settings = new
            else:
                self._new_scheduler()
            return
        if live != s.settings:
            s.update_settings(live)
            self._emit_stats(force=True)

    @Slot(list)
    @guarded
    def submit(self, jobs: list) -> None:
        """Queue requests (the job dicts of `EngineDriver.submit`)."""
        s = self.scheduler
        accepted = []
        for job in jobs:
            tag = job["tag"]
            if s is None:
                self.request_refused.emit(tag, "no model is loaded")
                continue
            try:
                rid = self.driver.submit(job)
            except (SubmitRefused, ValueError) as e:
                self.request_refused.emit(tag, str(e))
                continue
            accepted.append((tag, rid, s.records[rid].n_prompt))
        if accepted:
            self.requests_submitted.emit(accepted)
            leave_core_for_ui()
            self.busy = True
            if not self._timer.isActive():
                self._timer.start()

    @Slot()
    @guarded
    def flush_cache(self) -> None:
        if self.scheduler is None:
            return
        n = self.scheduler.flush_cache()
        self.cache_flushed.emit(n)
        self._emit_stats(force=True)

    @Slot(int, bool)
    @guarded
    def pin_chain(self, chain_id: int, pinned: bool) -> None:
        if self.scheduler is not None and chain_id in self.scheduler.cache.chains:
            self.scheduler.cache.pin(chain_id, pinned)
            self._emit_stats(force=True)

    @Slot(dict)
    @guarded
    def probe(self, request: dict) -> None:
        """How far a prompt (system + user) would match the cache, and where it differs."""
        if self.scheduler is None or self.model is None:
            return
        self.probe_ready.emit(probe_prompt(self.scheduler, request.get("system", ""),
                                           request.get("user", ""), request.get("namespace", "")))

    @Slot(dict)
    @guarded
    def make_report(self, request: dict) -> None:
        """Build the session's report data here (it reads the scheduler); the UI thread renders it."""
        if self.scheduler is None or self.model is None:
            raise RuntimeError("no model is loaded, so there is nothing to report")
        report = build_report(self.scheduler, self.model, request.get("system", ""),
                              self._settings.sampling(), request.get("title", ""),
                              namespace=self._settings.namespace)
        self.report_ready.emit(request["path"], report)

    @Slot(str)
    def save_trace(self, path: str) -> None:
        """Write the session's ended requests as a trace (the What-if tab's "This session")."""
        from app.replay.record import save_session_trace
        try:
            if self.scheduler is None or self.model is None:
                raise RuntimeError("no model is loaded yet, so there is no session to replay")
            save_session_trace(path, self.scheduler, self.model.name)
        except Exception as e:  # noqa: BLE001 - the tab shows why; the thread lives on
            self.trace_saved.emit(path, str(e))
            return
        self.trace_saved.emit(path, "")

    @Slot()
    def shutdown(self) -> None:
        """Stop stepping and end the thread's event loop (the UI thread then waits)."""
        self._quitting = True
        self._timer.stop()
        QThread.currentThread().quit()

    # stepping ---------------------------------------------------------------
    @Slot()
    def pump(self) -> None:
        """One scheduler step, then back to the event loop (the timer calls us again)."""
        s = self.scheduler
        if self._quitting or s is None:
            self._timer.stop()
            return
        try:
            self._take_served()
            self._emit_events(self.driver.step())
        except Exception as e:  # noqa: BLE001 - a broken step must not kill the thread
            self.failed.emit(f"scheduler step: {type(e).__name__}: {e}\n\n{traceback.format_exc(limit=6)}")
            self._recover()
        if self.scheduler is None or not self.scheduler.has_work():
            self._timer.stop()
            self._run_done()
        else:
            self._emit_stats()

    @Slot()
    def _wake_for_served(self) -> None:
        if self.broker is not None and self.scheduler is not None and not self._quitting \
                and not self._timer.isActive():
            leave_core_for_ui()
            self.busy = True
            self._timer.start()

    def _take_served(self) -> None:
        broker, s = self.broker, self.scheduler
        if broker is None or s is None:
            return
        taken = broker.drain(s)
        if taken:
            self.busy = True
            self.served_submitted.emit([(j.request_id, j.client, s.records[j.request_id].preview,
                                         s.records[j.request_id].n_prompt) for j in taken])

    def _emit_events(self, events: list) -> None:
        if self.broker is not None and self.scheduler is not None:
            self.broker.dispatch(self.scheduler, events)
        pieces = token_pieces(events)
        if pieces:
            self.token_generated.emit(pieces)
        for record in finished_records(events):
            self.request_finished.emit(record)

    def _run_done(self) -> None:
        self._emit_stats(force=True)
        if self.busy:
            self.busy = False
            if self._pending_settings is not None:
                self._pending_settings = None
                self._new_scheduler()
            self.run_finished.emit()

    def _stop_everything(self) -> None:
        """Cancel every request and reap them (finish events go out as `cancelled`)."""
        if not self.driver.has_work():
            return
        self.driver.stop_everything(self._emit_events)
        self._timer.stop()
        self._run_done()

    def _recover(self) -> None:
        """After a failed step: cancel what runs; if even that fails, start a fresh scheduler."""
        try:
            self._stop_everything()
        except Exception:  # noqa: BLE001
            for record in self.driver.abandon():
                self.request_finished.emit(record)
            self._new_scheduler()

    def _new_scheduler(self) -> None:
        if self.model is None:
            return
        if self.broker is not None:  # their requests lived in the old scheduler
            self.broker.fail_all("the engine restarted (a new model or pool settings); retry")
        self.driver.reset(Scheduler(self.model, self._settings.scheduler_settings()))
        self._maker = SnapshotMaker()
        self.scheduler_reset.emit(self.scheduler.settings.to_dict())
        self._emit_stats(force=True)

    def _emit_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.scheduler is None or (not force and now - self._last_stats < STATS_INTERVAL_S):
            return
        self._last_stats = now
        self.stats_updated.emit(self._maker.take(self.scheduler))


class EngineClient(QObject):
    """The UI thread's handle on the worker: owns the thread, sends queued requests."""

    _load = Signal(str)
    _check = Signal(str)
    _settings = Signal(dict)
    _submit = Signal(list)
    _flush = Signal()
    _probe = Signal(dict)
    _pin = Signal(int, bool)
    _report = Signal(object)
    _trace = Signal(str)
    _shutdown = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()  # no parent: it must outlive nothing and be waited for
        self.thread.setObjectName("prefixlab-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load_model)
        self._check.connect(self.worker.check_model)
        self._settings.connect(self.worker.apply_settings)
        self._submit.connect(self.worker.submit)
        self._flush.connect(self.worker.flush_cache)
        self._probe.connect(self.worker.probe)
        self._pin.connect(self.worker.pin_chain)
        self._report.connect(self.worker.make_report)
        self._trace.connect(self.worker.save_trace)
        self._shutdown.connect(self.worker.shutdown)
        self._tags = 0
        self.thread.start()

    def new_tag(self) -> str:
        self._tags += 1
        return f"t{self._tags}"

    def load_model(self, path: str | None) -> None:
        self._load.emit(path or "")

    def check_model(self, path: str) -> None:
        """Ask whether `path` opens as a model; the answer comes as `worker.model_checked`."""
        self._check.emit(path)

    def apply_settings(self, settings: AppSettings) -> None:
        self._settings.emit(settings.to_dict())

    def submit(self, jobs: list[dict]) -> None:
        self._submit.emit(jobs)

    def cancel(self, tags) -> None:
        self.worker.request_cancel(list(tags))

    def flush_cache(self) -> None:
        self._flush.emit()

    def probe(self, system: str, user: str, namespace: str = "") -> None:
        self._probe.emit({"system": system, "user": user, "namespace": namespace})

    def pin_chain(self, chain_id: int, pinned: bool) -> None:
        self._pin.emit(chain_id, pinned)

    def make_report(self, path: str, system: str = "", title: str = "") -> None:
        self._report.emit({"path": path, "system": system, "title": title})

    def save_trace(self, path: str) -> None:
        """Ask for the session's trace at `path`; the answer comes as `worker.trace_saved`."""
        self._trace.emit(path)

    def shutdown(self) -> None:
        """Stop, quit() and wait() (DESIGN §6); safe to call twice."""
        if not self.thread.isRunning():
            return
        self.worker.request_shutdown()
        self._shutdown.emit()
        self.thread.wait()
