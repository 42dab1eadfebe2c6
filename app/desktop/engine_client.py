"""The UI thread's handle on the engine worker (docs/design.md §7): owns its thread, sends requests.

Typed turns go straight into the worker's engine loop (thread-safe, like HTTP requests) and
come back under their tickets in the worker's `job_events`; every other request (load,
settings, reports, probes) is one call queued into the worker's thread through `_call`.
"""

from __future__ import annotations

import functools

from PySide6.QtCore import QObject, QThread, Signal

from .settings import AppSettings
from .worker import EngineWorker


class EngineClient(QObject):
    """The UI thread's handle on the worker: owns the thread, queues calls into it."""

    _call = Signal(object)  # a call for the worker's thread (a queued connection runs it there)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()  # no parent: it must outlive nothing and be waited for
        self.thread.setObjectName("prefixlab-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self._call.connect(self.worker.run_call)
        self.thread.start()

    def _queue(self, method, *args) -> None:
        self._call.emit(functools.partial(method, *args))

    def load_model(self, path: str | None) -> None:
        self._queue(self.worker.load_model, path or "")

    def check_model(self, path: str) -> None:
        """Ask whether `path` opens as a model; the answer comes as `worker.model_checked`."""
        self._queue(self.worker.check_model, path)

    def apply_settings(self, settings: AppSettings) -> None:
        self._queue(self.worker.apply_settings, settings.to_dict())

    def submit(self, chat_args: dict) -> int:
        """A typed turn into the engine loop (thread-safe: no queued call needed); its ticket."""
        return self.worker.submit(chat_args)

    def cancel(self, tickets) -> None:
        """Stop these jobs (by ticket) at the loop's next step."""
        self.worker.cancel(list(tickets))

    def flush_cache(self) -> None:
        self._queue(self.worker.flush_cache)

    def probe(self, system: str, user: str, namespace: str = "") -> None:
        self._queue(self.worker.probe, {"system": system, "user": user, "namespace": namespace})

    def pin_chain(self, chain_id: int, pinned: bool) -> None:
        self._queue(self.worker.pin_chain, chain_id, pinned)

    def make_report(self, path: str, system: str = "", title: str = "") -> None:
        self._queue(self.worker.make_report, {"path": path, "system": system, "title": title})

    def save_trace(self, path: str) -> None:
        """Ask for the session's trace at `path`; the answer comes as `worker.trace_saved`."""
        self._queue(self.worker.save_trace, path)

    def set_cache_root(self, root: str) -> None:
        """The folder kept caches live in (queued before any load, so it is set first)."""
        self._queue(self.worker.set_cache_root, root)

    def save_cache(self) -> None:
        """Save the cache now; the worker answers with `cache_note`."""
        self._queue(self.worker.save_cache)

    def shutdown(self) -> None:
        """Stop, quit() and wait() (docs/design.md §7); safe to call twice."""
        if not self.thread.isRunning():
            return
        self.worker.request_shutdown()
        self._queue(self.worker.shutdown)
        self.thread.wait()
