"""The window's Server toggle: serve the app's own scheduler over HTTP, one card per request.

HTTP requests run on the engine's scheduler (through app.serve.desktop), so they share
the pool and the cache with typed prompts and enter the charts, the page map, the chains
table and reports like them; each one gets a card labelled with its client (the controller
makes it from the served job's events, under the job's ticket like a typed turn).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from ..serve.desktop import DesktopServer
from ..serve.runner import ServeError


class ServerToggle(QObject):
    """Starts and stops the server with the controller's settings."""

    changed = Signal(str)  # the base URL clients use (…/v1), "" when off

    def __init__(self, controller, parent: QObject | None = None):
        super().__init__(parent)
        self.controller = controller
        self.server = DesktopServer(controller.driver)
        self._address: tuple | None = None     # (host, port, key, KV events) the running server uses
        controller.settings_changed.connect(self._on_settings)

    @property
    def base_url(self) -> str:
        """What clients set as OPENAI_BASE_URL ("" when off)."""
        return f"{self.server.url}/v1" if self.server.url else ""

    def set_on(self, on: bool) -> bool:
        """Start (with the settings' host, port and key) or stop serving; False if it cannot start."""
        c = self.controller
        if not on:
            self.server.stop()
            self._address = None
            self.changed.emit("")
            return True
        s = c.settings
        try:
            self.server.start(s.server_host, s.server_port, [s.server_api_key] if s.server_api_key else [],
                              kv_events=s.server_kv_events)
            self._address = (s.server_host, s.server_port, s.server_api_key, s.server_kv_events)
        except (ServeError, ValueError) as e:
            c.report_error("Could not start the server", str(e))
            self.changed.emit("")
            return False
        self.changed.emit(self.base_url)
        c.status.emit(f"Serving on {self.base_url}: set OPENAI_BASE_URL={self.base_url} in a client", 10000)
        return True

    def _on_settings(self, values: dict) -> None:
        """A new host, port, key or KV-events endpoint while serving: restart on it."""
        new = (values["server_host"], values["server_port"], values["server_api_key"],
               values["server_kv_events"])
        if self._address is not None and new != self._address:
            self.set_on(False)
            self.set_on(True)

    def stop_all(self) -> None:
        """Stop every served request (Stop all)."""
        if self.server.backend is not None:
            self.server.backend.loop.cancel_all(served_only=True)

    def friendliness(self) -> dict:
        """The served traffic's cache-friendliness (GET /v1/prefixlab/friendliness's data)."""
        backend = self.server.backend
        return backend.friendliness.to_dict() if backend is not None else {"clients": []}

    def shutdown(self) -> None:
        """Stop serving (the app quits)."""
        self.server.stop()
