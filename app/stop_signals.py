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
