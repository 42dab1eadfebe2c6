"""The desktop app's Server toggle: the HTTP server over the worker's own scheduler.

No engine thread of its own: HTTP requests go through a RequestBroker that the Qt
worker drains between its steps, so served requests and typed prompts share one
scheduler, one pool and one cache (and so the window's charts, page map and reports).
"""

from __future__ import annotations

from .broker import RequestBroker
from .runner import HttpThread, latest_row
from .server import Backend, create_app


class DesktopServer:
    """Start and stop serving for an EngineWorker (anything with .model, .scheduler, .attach_broker)."""

    def __init__(self, worker):
        self.worker = worker
        self.http: HttpThread | None = None
        self.backend: Backend | None = None

    @property
    def url(self) -> str | None:
        """The base address while serving, else None."""
        return self.http.url if self.http is not None else None

    def start(self, host: str = "127.0.0.1", port: int = 8000, api_keys: list[str] | None = None,
              cors: bool = False) -> str:
        """Serve at host:port (ServeError when the port is taken); return the base URL."""
        self.stop()
        w = self.worker
        broker = RequestBroker()
        self.backend = Backend(broker, model=lambda: w.model if w.scheduler is not None else None,
                               stats=lambda: latest_row(w.scheduler))
        self.http = HttpThread(create_app(self.backend, api_keys, cors), host, port).start()
        w.attach_broker(broker)
        return self.http.url

    def stop(self) -> None:
        """Stop taking requests, end open ones and close the connections."""
        if self.http is None:
            return
        self.backend.broker.cancel_all()  # the worker ends them at its next step: streams finish
        self.http.stop()
        self.worker.attach_broker(None)
        self.http = self.backend = None
