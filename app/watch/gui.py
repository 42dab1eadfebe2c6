"""The app's "Watch a server" window: a WatchView fed by a WatchSession, endpoints remembered."""

from __future__ import annotations

import threading

from PySide6.QtCore import QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMainWindow, QWidget

from ui.watch_view import WatchView

from ..desktop.settings import qsettings
from ..kv_wire import normalize_endpoint
from .session import WatchSession

REFRESH_MS = 250  # the session builds snapshots off the UI thread; this only picks up the latest


class WatchWindow(QMainWindow):
    """Watch serving engines' KV events; File → Watch a server opens one."""

    def __init__(self, parent: QWidget | None = None, store=None, tokenize=None):
        super().__init__(parent)
        self.setWindowTitle("PrefixLab: watch a server")
        self.resize(1200, 760)
        self.store = store if store is not None else qsettings()
        self.view = WatchView()
        self.setCentralWidget(self.view)
        self.view.set_fields(self._list("watch/endpoints"), self._list("watch/replay_endpoints"),
                             str(self.store.value("watch/topic", "")))
        self.view.connect_requested.connect(self.start_watching)
        self.view.disconnect_requested.connect(self.stop_watching)
        self.view.prompt_requested.connect(self.route_prompt)
        self.tokenize = tokenize  # text -> token ids; None: the bundled model's tokenizer, loaded once
        self.session: WatchSession | None = None
        self._shown = None
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)

    def _list(self, key: str) -> list[str]:
        value = self.store.value(key, "")
        return value.split() if isinstance(value, str) else [str(v) for v in value or []]

    def start_watching(self, endpoints: list[str], replays: list[str], topic: str) -> bool:
        """Connect to the endpoints (remembered); False with the reason in the status line."""
        self.stop_watching()
        try:
            endpoints = [normalize_endpoint(e) for e in endpoints]
            replays = [normalize_endpoint(e) for e in replays]
            self.session = WatchSession(endpoints, replays, topic=topic).start()
        except ValueError as e:
            self.view.set_connected(False, f"Cannot watch: {e}")
            return False
        self.store.setValue("watch/endpoints", " ".join(endpoints))
        self.store.setValue("watch/replay_endpoints", " ".join(replays))
        self.store.setValue("watch/topic", topic)
        self.store.sync()
        self.view.set_fields(endpoints, replays, topic)
        self.view.clear()
        self.view.prepare(len(endpoints))
        self.view.set_connected(True, f"Watching {len(endpoints)} engine(s); waiting for events…")
        self.timer.start()
        return True

    def refresh(self) -> None:
        """Show the session's latest snapshot, if it is new."""
        s = self.session
        if s is None:
            return
        if s.error:
            self.stop_watching(f"The watcher stopped: {s.error}")
            return
        snap = s.latest
        if snap is not None and snap is not self._shown:
            self._shown = snap
            self.view.set_snapshot(snap)
            live = sum(e.summary["live_blocks"] for e in snap.engines)
            self.view.status.setText(f"Watching {len(snap.engines)} engine(s): {live:,} live blocks.")

    def route_prompt(self, text: str) -> None:
        """Score a prompt (token ids, or text to tokenize off the UI thread) on every engine."""
        words = text.replace(",", " ").split()
        if not words or all(w.isdigit() for w in words):
            self._set_prompt([int(w) for w in words])
            return
        threading.Thread(target=self._tokenize, args=(text,), daemon=True, name="watch-tokenize").start()

    def _tokenize(self, text: str) -> None:
        if self.tokenize is None:
            import engine as dl
            tok = dl.load_model().tokenizer  # the model `prefixlab serve` runs by default
            self.tokenize = tok.encode
        self._set_prompt(self.tokenize(text))

    def _set_prompt(self, tokens: list[int]) -> None:
        if self.session is not None:
            self.session.set_prompt(tokens)

    def stop_watching(self, status: str = "Not connected.") -> None:
        """Stop the session (its sockets close) and say why in the status line."""
        self.timer.stop()
        if self.session is not None:
            self.session.stop()
            self.session = None
        self.view.set_connected(False, status)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.stop_watching()
        super().closeEvent(event)


def install_watch_action(main_window: QMainWindow) -> QAction:
    """Add File → "Watch a server…" to the app's main window (before Quit); it opens a WatchWindow."""
    file_menu = next((a.menu() for a in main_window.menuBar().actions()
                      if a.menu() is not None and a.text().replace("&", "") == "File"), None)
    if file_menu is None:
        file_menu = main_window.menuBar().addMenu("&File")
    act = QAction("&Watch a server…", main_window)
    act.setStatusTip("Watch serving engines' prefix caches from their KV events (vLLM's format)")

    opened: list[WatchWindow] = []  # one window, made on first use

    def open_window() -> None:
        if not opened:
            # A child of the main window (still its own window): it closes when the app does.
            opened.append(WatchWindow(main_window))
            closing = getattr(main_window, "closing", None)  # the app's window says when it closes
            if closing is not None:
                closing.connect(opened[0].stop_watching)
        win = opened[0]
        win.show()
        win.raise_()
        win.activateWindow()

    act.triggered.connect(open_window)
    quit_action = next((a for a in file_menu.actions() if a.text().replace("&", "") == "Quit"), None)
    file_menu.insertAction(quit_action, act) if quit_action else file_menu.addAction(act)
    return act
