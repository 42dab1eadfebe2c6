"""The desktop app's Server toggle: the HTTP server over the desktop engine's own scheduler.

No engine thread of its own: HTTP requests go to the desktop engine's loop, the same one
typed prompts go through, so they share one scheduler, one pool and one cache (and so the
window's charts, page map and reports). The engine watches every served job's events (its
`job_event`), so each one reaches the window under its ticket, like a typed turn's.
"""

from __future__ import annotations

from .guard import ConnectionLimit, limited
from .runner import HttpThread, JsonErrorsH11, latest_row
from .server import Backend, create_app


class DesktopServer:
    """Start and stop serving for the desktop's EngineDriver (app/desktop/engine_driver.py)."""

    def __init__(self, driver):
        self.driver = driver
        self.engine = driver.engine  # its .model, .scheduler, .loop, .job_event
        self.http: HttpThread | None = None
        self.backend: Backend | None = None
        self.publisher = None   # the KV-event publisher, while serving with kv_events
        self._published = None  # the scheduler whose cache it publishes

    @property
    def url(self) -> str | None:
        """The base address while serving, else None."""
        return self.http.url if self.http is not None else None

    def start(self, host: str = "127.0.0.1", port: int = 8000, api_keys: list[str] | None = None,
              cors: bool = False, kv_events: str = "") -> str:
        """Serve at host:port (ServeError when the port is taken; ValueError for a bad or taken
        KV-event endpoint); return the base URL. `kv_events`: also publish the cache there."""
        self.stop()
        e = self.engine
        if kv_events:
            self._publish(kv_events)
        self.backend = Backend(e.loop, model=lambda: e.model if e.scheduler is not None else None,
                               stats=lambda: latest_row(e.scheduler))
        self.backend.watchers.append(e.job_event)
        try:
            self.http = HttpThread(create_app(self.backend, api_keys, cors, host=host), host, port,
                                   http=limited(JsonErrorsH11, ConnectionLimit())).start()
        except Exception:
            self.stop()  # a taken HTTP port: the publisher must not keep its port either
            raise
        return self.http.url

    def _publish(self, endpoint: str) -> None:
        from ..kv_wire import normalize_endpoint
        from .kv_events_publisher import KVEventPublisher
        self.publisher = KVEventPublisher(normalize_endpoint(endpoint))
        # A new scheduler (new model, new pool) has a new cache: the publisher follows it. The
        # engine reports a new scheduler before its first request; this looks at every report,
        # in the engine's thread as it is made, so no insert of the new cache is missed.
        self.driver.reported.connect(self._follow_scheduler)
        self._follow_scheduler()

    def _follow_scheduler(self, *_) -> None:
        scheduler = self.engine.scheduler
        if self.publisher is not None and scheduler is not None and scheduler is not self._published:
            self.publisher.attach(scheduler.cache)
            self._published = scheduler

    def stop(self) -> None:
        """Stop taking requests, end open ones and close the connections."""
        if self.publisher is not None:
            self.driver.reported.disconnect(self._follow_scheduler)
            self.publisher.detach()
            self.publisher.close()
            self.publisher = self._published = None
        if self.http is None:
            return
        self.backend.loop.cancel_all(served_only=True)  # ended at the engine's next step: streams finish
        self.http.stop()
        self.backend.close()
        self.http = self.backend = None
