"""SIGTERM and Ctrl+C as a request to stop: the long-running commands finish cleanly on either."""

from __future__ import annotations

import signal
import threading


class StopOnSignals:
    """`with StopOnSignals() as stop:` sets the event `stop` on SIGTERM or SIGINT; the old
    handlers come back after. Installed even where SIGINT was ignored at start (a command run
    in the background of a script inherits that), as uvicorn does, so Ctrl+C and `kill`
    always reach a clean shutdown."""

    def __init__(self):
        self.stop = threading.Event()
        self.old: dict = {}

    def __enter__(self) -> threading.Event:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, lambda signum, frame: self.stop.set())
        return self.stop

    def __exit__(self, *exc) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


class TerminateRaises:
    """`with TerminateRaises():` SIGTERM raises SystemExit (status 143) in the main thread while the
    block runs, as Ctrl+C raises KeyboardInterrupt, so `finally` clauses run: a file half written
    to a temporary name is removed rather than left behind by `kill`."""

    def __enter__(self) -> TerminateRaises:
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, _exit_on_term)
        return self

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def _exit_on_term(signum, frame):
    raise SystemExit(128 + signum)
