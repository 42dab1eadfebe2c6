"""The UI thread's handle on the engine worker (docs/design.md §7): owns its thread, sends requests.

Typed turns go straight into the worker's engine loop (thread-safe, like HTTP requests);
everything else (load, settings, reports, probes) goes as queued signals to the worker's slots.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QThread, Signal

from .settings import AppSettings
from .worker import EngineWorker


class EngineClient(QObject):
    """The UI thread's handle on the worker: owns the thread, sends queued requests."""

    _load = Signal(str)
    _check = Signal(str)
    _settings = Signal(dict)
    _flush = Signal()
    _probe = Signal(dict)
    _pin = Signal(int, bool)
    _report = Signal(object)
    _trace = Signal(str)
    _cache_root = Signal(str)
    _save_cache = Signal()
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
        self._flush.connect(self.worker.flush_cache)
        self._probe.connect(self.worker.probe)
        self._pin.connect(self.worker.pin_chain)
        self._report.connect(self.worker.make_report)
        self._trace.connect(self.worker.save_trace)
        self._cache_root.connect(self.worker.set_cache_root)
        self._save_cache.connect(self.worker.save_cache)
        self._shutdown.connect(self.worker.shutdown)
        self.thread.start()

    def load_model(self, path: str | None) -> None:
        self._load.emit(path or "")

    def check_model(self, path: str) -> None:
        """Ask whether `path` opens as a model; the answer comes as `worker.model_checked`."""
        self._check.emit(path)

    def apply_settings(self, settings: AppSettings) -> None:
        self._settings.emit(settings.to_dict())

    def submit(self, chat_args: dict) -> int:
        """A typed turn into the engine loop (thread-safe: no queued signal needed); its ticket."""
        return self.worker.submit(chat_args)

    def cancel(self, tickets) -> None:
        """Stop these jobs (by ticket) at the loop's next step."""
        self.worker.cancel(list(tickets))

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

    def set_cache_root(self, root: str) -> None:
        """The folder kept caches live in (queued before any load, so it is set first)."""
        self._cache_root.emit(root)

    def save_cache(self) -> None:
        """Save the cache now; the worker answers with `cache_note`."""
        self._save_cache.emit()

    def shutdown(self) -> None:
        """Stop, quit() and wait() (docs/design.md §7); safe to call twice."""
        if not self.thread.isRunning():
            return
        self.worker.request_shutdown()
        self._shutdown.emit()
        self.thread.wait()
