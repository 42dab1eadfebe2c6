"""The engine thread and the UI thread's handle on it (docs/design.md §7).

`EngineDriver` owns a parentless QThread and lives in it, with the `DesktopEngine`
(desktop_engine.py, plain Python) it drives. Typed turns and cancels go straight into the
engine's loop (thread-safe, like HTTP requests); the loop wakes this thread by a queued
signal, and a zero-interval timer steps the engine while there is work. Every other request
(load, settings, reports, probes) is one call queued into the thread through `_call`. What
the engine says comes back by two signals, queued into the UI thread: `job_events` (each
step's events under their tickets) and `reported` (one typed report, or a Snapshot).
"""

from __future__ import annotations

import functools

from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

from .desktop_engine import DesktopEngine
from .settings import AppSettings


class EngineDriver(QObject):
    """Owns the engine thread, queues calls into it, steps the engine, emits what it reports."""

    job_events = Signal(list)   # [(ticket, event), ...] in order, one list per step
    reported = Signal(object)   # a desktop_engine report (ModelLoaded, Failed, ...) or a Snapshot
    _call = Signal(object)      # a call for the engine thread (a queued connection runs it there)
    _woken = Signal()           # a job or a cancel reached the loop (emitted on any thread)

    def __init__(self):
        super().__init__()  # no parent: it moves to its thread
        self.engine = DesktopEngine(self.job_events.emit, self.reported.emit)
        self.engine.loop.wake = self._woken.emit  # queued into the engine thread
        # A zero-interval timer (a child, so it moves with us): each step is one timer event,
        # and queued calls, submits and cancels run between steps.
        self._timer = QTimer(self)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self._pump)
        self._woken.connect(self._wake)
        self._call.connect(self._run)
        self.thread = QThread()  # no parent: it must outlive nothing and be waited for
        self.thread.setObjectName("prefixlab-engine")
        self.moveToThread(self.thread)
        self.thread.start()

    # the UI thread's requests -----------------------------------------------------------------
    def _queue(self, method, *args) -> None:
        self._call.emit(functools.partial(method, *args))

    def load_model(self, path: str | None) -> None:
        self._queue(self.engine.load_model, path or "")

    def check_model(self, path: str) -> None:
        """Ask whether `path` opens as a model; the answer is a `ModelChecked` report."""
        self._queue(self.engine.check_model, path)

    def apply_settings(self, settings: AppSettings) -> None:
        self._queue(self.engine.apply_settings, settings.to_dict())

    def submit(self, chat_args: dict) -> int:
        """A typed turn into the engine loop (thread-safe: no queued call needed); its ticket."""
        return self.engine.submit(chat_args)

    def cancel(self, tickets) -> None:
        """Stop these jobs (by ticket) at the loop's next step."""
        self.engine.cancel(list(tickets))

    def flush_cache(self) -> None:
        self._queue(self.engine.flush_cache)

    def probe(self, system: str, user: str, namespace: str = "") -> None:
        self._queue(self.engine.probe, {"system": system, "user": user, "namespace": namespace})

    def pin_chain(self, chain_id: int, pinned: bool) -> None:
        self._queue(self.engine.pin_chain, chain_id, pinned)

    def make_report(self, path: str, system: str = "", title: str = "") -> None:
        self._queue(self.engine.make_report, {"path": path, "system": system, "title": title})

    def save_trace(self, path: str) -> None:
        """Ask for the session's trace at `path`; the answer is a `TraceSaved` report."""
        self._queue(self.engine.save_trace, path)

    def set_cache_root(self, root: str) -> None:
        """The folder kept caches live in (queued before any load, so it is set first)."""
        self._queue(self.engine.set_cache_root, root)

    def save_cache(self) -> None:
        """Save the cache now; the answer is a `CacheNote` report."""
        self._queue(self.engine.save_cache)

    def shutdown(self) -> None:
        """Stop, quit() and wait() (docs/design.md §7); safe to call twice."""
        if not self.thread.isRunning():
            return
        self.engine.request_shutdown()
        self._queue(self._close)
        self.thread.wait()

    # the engine thread ------------------------------------------------------------------------
    @Slot(object)
    def _run(self, call) -> None:
        """Run one queued request (a `functools.partial` of an engine method) in this thread."""
        call()

    @Slot()
    def _wake(self) -> None:
        if not self._timer.isActive() and self.engine.begin_run():
            self._timer.start()

    @Slot()
    def _pump(self) -> None:
        """One engine step, then back to the event loop (the timer calls us again)."""
        if not self.engine.step():
            self._timer.stop()

    def _close(self) -> None:
        """Stop stepping, keep the cache when asked to, and end the thread's event loop (the UI
        thread then waits)."""
        self._timer.stop()
        self.engine.close()
        self.thread.quit()
