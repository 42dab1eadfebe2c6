"""A live `prefixlab serve` on a free port over the bundled model, for the server tests."""

from __future__ import annotations

import httpx

from app.serve.runner import Server
from engine.metrics import PAGE_PRIVATE, PAGE_SHARED
from engine.scheduler import SchedulerSettings
from tests.wait import wait_until

WAIT_S = 120.0


def start_server(load, **kw) -> Server:
    """Start a server on a free port and wait until /health answers 200."""
    server = Server(load, host="127.0.0.1", port=0, **kw).start()
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, WAIT_S,
               lambda: f"the server to become ready ({server.engine.load_error})", interval=0.05)
    return server


def scheduler_on(model, **settings):
    """What the engine thread loads: an already loaded model, and the scheduler's settings."""
    return lambda: (model, SchedulerSettings(**settings))


def wait_idle(server: Server) -> None:
    """Until every request has finished and its pages went back (the engine thread is then idle)."""
    sch = server.engine.scheduler
    wait_until(lambda: not (sch.has_work() or server.engine.loop.in_flight()), WAIT_S,
               "every request to finish")


def pages_held_by_sessions(server: Server) -> int:
    """Pool pages a session still holds (0: every page in use is held by the cache alone)."""
    states = server.engine.scheduler.page_states()
    return int(((states == PAGE_PRIVATE) | (states == PAGE_SHARED)).sum())
