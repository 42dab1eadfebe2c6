"""A live `prefixlab serve` on a free port over the bundled model, for the server tests."""

from __future__ import annotations

import time

import httpx

from app.serve.runner import Server
from engine.metrics import PAGE_PRIVATE, PAGE_SHARED
from engine.scheduler import Scheduler, SchedulerSettings

WAIT_S = 120.0


def start_server(factory, **kw) -> Server:
    """Start a server on a free port and wait until /health answers 200."""
    server = Server(factory, host="127.0.0.1", port=0, **kw).start()
    deadline = time.monotonic() + WAIT_S
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, f"the server never became ready: {server.engine.load_error}"
        time.sleep(0.05)
    return server


def scheduler_on(model, **settings):
    """A factory for the engine thread: a Scheduler over an already loaded model."""
    return lambda: Scheduler(model, SchedulerSettings(**settings))


def wait_idle(server: Server) -> None:
    """Until every request has finished and its pages went back (the engine thread is then idle)."""
    deadline = time.monotonic() + WAIT_S
    sch = server.engine.scheduler
    while sch.has_work() or server.engine.loop.in_flight():
        assert time.monotonic() < deadline, "requests never finished"
        time.sleep(0.02)


def pages_held_by_sessions(server: Server) -> int:
    """Pool pages a session still holds (0: every page in use is held by the cache alone)."""
    states = server.engine.scheduler.page_states()
    return int(((states == PAGE_PRIVATE) | (states == PAGE_SHARED)).sum())
