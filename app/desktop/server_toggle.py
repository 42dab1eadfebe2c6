"""The window's Server toggle: serve the app's own scheduler over HTTP, one card per request.

HTTP requests run on the worker's scheduler (through app.serve.desktop), so they share
the pool and the cache with typed prompts and enter the charts, the page map, the chains
table and reports like them; each one gets a card labelled with its client.
"""

from __future__ import annotations

import secrets

from PySide6.QtCore import QObject, Signal, Slot

from ..serve.desktop import DesktopServer
from ..serve.runner import ServeError


class ServerToggle(QObject):
    """Starts and stops the server with the controller's settings; makes the served cards."""

    changed = Signal(str)  # the base URL clients use (…/v1), "" when off

    def __init__(self, controller, parent: QObject | None = None):
        super().__init__(parent)
        self.controller = controller
        self.server = DesktopServer(controller.client.worker)
        self._nonce = secrets.token_hex(3)  # card ids differ across app runs (sessions keep cards)
        self._request_of: dict[str, int] = {}  # served card uid -> its request id
        self._address: tuple | None = None     # (host, port, key, KV events) the running server uses
        # A bound method of this QObject: Qt queues the call into the UI thread.
        controller.client.worker.served_submitted.connect(self._on_served)
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

    def stop_card(self, uid: str) -> None:
        """A served card's Stop: cancel its request (its client sees the answer end)."""
        request_id = self._request_of.get(uid)
        if request_id is not None and self.server.backend is not None:
            self.server.backend.loop.cancel_request(request_id)

    def stop_all(self) -> None:
        """Stop every served request (Stop all)."""
        if self.server.backend is not None:
            self.server.backend.loop.cancel_all(served_only=True)

    def friendliness(self) -> dict:
        """The served traffic's cache-friendliness (GET /v1/prefixlab/friendliness's data)."""
        backend = self.server.backend
        return backend.friendliness.to_dict() if backend is not None else {"clients": []}

    @Slot(list)
    def _on_served(self, items: list) -> None:
        c = self.controller
        for request_id, client, preview, n_prompt in items:
            t = c.transcript(f"http-{self._nonce}-{request_id}", f"{client}: {preview}")
            c.book.served(t, request_id, preview)
            t.accept(request_id, n_prompt)
            self._request_of[t.uid] = request_id
            c.turn_started.emit(t.uid)
            c.turn_accepted.emit(t.uid)
        c.state_changed.emit(c.ready, c.loading, c.running)

    def shutdown(self) -> None:
        """Stop serving (the app quits)."""
        self.server.stop()
