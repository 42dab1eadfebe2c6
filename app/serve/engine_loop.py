"""A Qt-free engine thread for `prefixlab serve`: loads the model, owns the Scheduler.

It loops: drain the broker (submissions, cancels), step the scheduler while it
has work, dispatch the step's events; when idle it sleeps until the broker
wakes it. The desktop app does not use this thread: its Qt worker drains the
same `RequestBroker` between its own steps.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable

from .broker import RequestBroker

IDLE_WAIT_S = 0.5  # an idle loop also wakes this often to notice a stop


class EngineLoop:
    """One thread that builds the scheduler (`factory()`, e.g. a model load) and steps it."""

    def __init__(self, factory: Callable[[], object], broker: RequestBroker | None = None):
        self.broker = broker or RequestBroker()
        self.broker.wake = self._wake
        self._factory = factory
        self._event = threading.Event()
        self._stop = False
        self.scheduler = None
        self.ready = threading.Event()        # set once the scheduler exists (or loading failed)
        self.load_error: str | None = None
        self.step_error: str | None = None    # the last step that raised (the loop lives on)
        self._thread = threading.Thread(target=self._run, name="prefixlab-serve-engine", daemon=True)

    def start(self) -> EngineLoop:
        """Start the thread (it builds the scheduler first)."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what runs, end the thread and wait for it."""
        self._stop = True
        self._wake()
        self._thread.join(timeout)

    def _wake(self) -> None:
        self._event.set()

    def _run(self) -> None:
        try:
            self.scheduler = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported by /health and the CLI
            self.load_error = f"{type(e).__name__}: {e}"
            self.ready.set()
            self.broker.fail_all(f"the model failed to load: {self.load_error}")
            return
        self.ready.set()
        s = self.scheduler
        while not self._stop:
            self._event.clear()
            self.broker.drain(s)
            if not s.has_work():
                self._event.wait(IDLE_WAIT_S)
                continue
            try:
                events = s.step()
            except Exception as e:  # noqa: BLE001 - a broken step must not kill the server
                self.step_error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
                self._recover(s)
                continue
            self.broker.dispatch(s, events)
        self._shutdown(s)

    def _recover(self, s) -> None:
        """After a failed step: every open request gets an error, and its pages go back."""
        self.broker.fail_all(f"the engine failed: {self.step_error.splitlines()[0]}", 500)
        s.cancel_all()
        try:
            s.step()  # reaps the cancelled streams
        except Exception:  # noqa: BLE001 - the next request's step tries again
            pass

    def _shutdown(self, s) -> None:
        s.cancel_all()
        for _ in range(3):  # one step reaps cancelled streams; the loop is only a guard
            if not s.has_work():
                break
            self.broker.dispatch(s, s.step())
        self.broker.fail_all("the server is shutting down", 503)
