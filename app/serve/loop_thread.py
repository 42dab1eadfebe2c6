"""`prefixlab serve`'s engine thread: loads the model, then runs the one engine loop on it.

The loop itself (submit, cancel, step, stop) is engine/loop.py's, the same one the desktop
worker and `prefixlab run` drive; this thread only loads the model (the loop builds its
scheduler) and steps the loop until stopped. `/health` reads `state()`: loading, failed,
serving or dead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.loop import EngineLoop


class LoopThread:
    """One thread that loads the model (`load()` -> (model, SchedulerSettings)), gives the loop
    its scheduler, runs `prepare(scheduler)` (e.g. a KV-event publisher attaching to its cache)
    and steps the loop until stopped."""

    def __init__(self, load: Callable[[], tuple], prepare: Callable[[object], None] | None = None,
                 loop: EngineLoop | None = None):
        self.loop = loop or EngineLoop()  # `serve --step-log`: engine/step_log.py's StepLogLoop
        self._load, self._prepare = load, prepare
        self._stopping = threading.Event()
        self.ready = threading.Event()        # set once the scheduler exists (or loading failed)
        self.load_error: str | None = None
        self.died: str | None = None          # the loop itself raised: nothing is served any more
        self._thread = threading.Thread(target=self._run, name="prefixlab-serve-engine", daemon=True)

    @property
    def scheduler(self):
        return self.loop.scheduler

    def start(self) -> LoopThread:
        """Start the thread (it loads the model first)."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what runs, end the thread and wait for it."""
        self._stopping.set()
        self.loop.wake()
        self._thread.join(timeout)

    def state(self) -> str:
        """"loading", "failed" (the model did not load), "serving", or "dead" (the loop ended)."""
        if self.load_error:
            return "failed"
        if not self.ready.is_set():
            return "loading"
        return "serving" if self._thread.is_alive() and not self.died else "dead"

    def _run(self) -> None:
        try:
            self.loop.reset(*self._load())
            if self._prepare is not None:
                self._prepare(self.loop.scheduler)
        except BaseException as e:  # noqa: BLE001 - reported by /health and the CLI
            self.load_error = f"{type(e).__name__}: {e}"
            self.ready.set()
            self.loop.fail_all(f"the model failed to load: {self.load_error}")
            return
        self.ready.set()
        try:
            self.loop.serve_forever(self._stopping)
        except BaseException as e:  # noqa: BLE001 - /health must tell, and requests must not hang
            self.died = f"{type(e).__name__}: {e}"
            self.loop.fail_all(f"the engine stopped: {self.died}", 503)
            raise
