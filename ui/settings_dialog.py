"""The Settings dialog: pool, cache, scheduler, sampling and server; validated before it closes."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from .theme import icon


def _spin(low: int, high: int, tip: str, special: str = "") -> QSpinBox:
    w = QSpinBox()
    w.setRange(low, high)
    w.setToolTip(tip)
    w.setAccelerated(True)
    if special:
        w.setSpecialValueText(special)
    return w


def _dspin(low: float, high: float, step: float, decimals: int, tip: str) -> QDoubleSpinBox:
    w = QDoubleSpinBox()
    w.setRange(low, high)
    w.setSingleStep(step)
    w.setDecimals(decimals)
    w.setToolTip(tip)
    return w


class SettingsDialog(QDialog):
    """Edits the settings' values (a dict); `accept()` refuses invalid values and says why.

    `check(values)` returns every problem as a sentence (the app's validation); `defaults`
    are the values Restore Defaults puts back.
    """

    flush_requested = Signal()

    def __init__(self, values: dict, defaults: dict, check: Callable[[dict], list[str]],
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(520)
        self._check = check
        self.result_values: dict | None = None
        lay = QVBoxLayout(self)

        pool = QGroupBox("KV pool and prefix cache")
        f = QFormLayout(pool)
        self.page_rows = _spin(1, 4096, "Positions per KV page: the cache shares whole pages only")
        self.pool_pages = _spin(0, 1_000_000, "Pages in the pool; 0 lets the pool grow", "0 (grows)")
        self.cache_pages = _spin(0, 1_000_000, "Most pages the cache may keep; 0: no budget", "0 (unbounded)")
        self.cache_enabled = QCheckBox("Reuse cached prefixes")
        self.cache_enabled.setToolTip("Off: every prompt is prefilled in full (for comparison)")
        self.namespace = QLineEdit()
        self.namespace.setPlaceholderText("(none)")
        self.namespace.setToolTip("A salt for cache keys: prompts only share pages within one namespace")
        f.addRow("Page rows", self.page_rows)
        f.addRow("Pool pages", self.pool_pages)
        f.addRow("Cache budget (pages)", self.cache_pages)
        f.addRow("Prefix cache", self.cache_enabled)
        f.addRow("Namespace", self.namespace)
        flush_row = QHBoxLayout()
        self.flush_button = QPushButton(icon("flush"), "Flush cache")
        self.flush_button.setToolTip("Give back every cached page no stream is using")
        self.flush_button.clicked.connect(self.flush_requested)
        flush_row.addWidget(self.flush_button)
        note = QLabel("Changing page rows or pool pages makes a new pool (the cache starts empty) "
                      "once no stream runs.")
        note.setObjectName("hint")
        note.setWordWrap(True)
        flush_row.addWidget(note, 1)
        f.addRow(flush_row)
        lay.addWidget(pool)

        sched = QGroupBox("Scheduler")
        f = QFormLayout(sched)
        self.max_streams = _spin(1, 64, "Streams decoded together in one batch")
        self.chunk_tokens = _spin(1, 65_536, "Prompt tokens prefilled per step (shared by all streams)")
        self.spec_enabled = QCheckBox("Draft tokens from the prompt")
        self.spec_enabled.setToolTip("Drafts up to k tokens per stream from n-grams of the prompt, verified "
                                     "in the same pass; greedy output unchanged. Off by default: it measured "
                                     "slower on 2 cores for the shipped workloads")
        self.spec_k = _spin(1, 16, "Tokens drafted and verified per stream and step, at most")
        self.spec_enabled.toggled.connect(self.spec_k.setEnabled)  # k means nothing while drafting is off
        f.addRow("Max streams", self.max_streams)
        f.addRow("Chunk tokens", self.chunk_tokens)
        f.addRow("Speculative decoding", self.spec_enabled)
        f.addRow("Draft tokens (k)", self.spec_k)
        lay.addWidget(sched)

        samp = QGroupBox("Sampling")
        f = QFormLayout(samp)
        self.temperature = _dspin(0.0, 10.0, 0.1, 2, "0: greedy (always the most likely token)")
        self.top_k = _spin(0, 1_000_000, "Keep the k most likely tokens; 0: off")
        self.top_p = _dspin(0.0, 1.0, 0.05, 2, "Keep the smallest set of tokens whose probability reaches p")
        self.min_p = _dspin(0.0, 1.0, 0.01, 3, "Drop tokens less likely than min-p × the top token")
        self.repeat_penalty = _dspin(0.0, 10.0, 0.05, 2, "Above 1 discourages repeating recent tokens")
        self.seed = _spin(-1, 2**31 - 1, "A fixed seed makes sampling repeatable", "random")
        self.max_new_tokens = _spin(1, 65_536, "Longest answer, in tokens")
        for name, w in (("Temperature", self.temperature), ("Top-k", self.top_k), ("Top-p", self.top_p),
                        ("Min-p", self.min_p), ("Repetition penalty", self.repeat_penalty),
                        ("Seed", self.seed), ("Max new tokens", self.max_new_tokens)):
            f.addRow(name, w)
        lay.addWidget(samp)

        server = QGroupBox("Server (OpenAI-compatible HTTP; Run → Server turns it on)")
        f = QFormLayout(server)
        self.server_host = QLineEdit()
        self.server_host.setToolTip("Address to listen on: 127.0.0.1 is this machine only; 0.0.0.0 is every "
                                    "network this machine is on")
        self.server_port = _spin(1, 65_535, "TCP port; clients use http://host:port/v1")
        self.server_api_key = QLineEdit()
        self.server_api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.server_api_key.setPlaceholderText("(none: no key asked)")
        self.server_api_key.setToolTip("Clients must send 'Authorization: Bearer <key>'; the key is also "
                                       "their cache namespace")
        f.addRow("Host", self.server_host)
        f.addRow("Port", self.server_port)
        f.addRow("API key", self.server_api_key)
        self.server_api_key_remember = QCheckBox("Remember the key")
        self.server_api_key_remember.setToolTip(
            "The key goes to the system keyring where there is one. Without a keyring it is kept only "
            "when this is ticked, in a file only you can read; unticked, it is forgotten at quit")
        f.addRow("", self.server_api_key_remember)
        self.server_kv_events = QLineEdit()
        self.server_kv_events.setPlaceholderText("(off) e.g. 127.0.0.1:5557")
        self.server_kv_events.setToolTip("Publish the prefix cache as KV events in vLLM's format on this "
                                         "ZeroMQ endpoint (File → Watch a server, llm-d, Dynamo read it); "
                                         "ZeroMQ has no authentication: keep it on 127.0.0.1")
        f.addRow("KV events", self.server_kv_events)
        lay.addWidget(server)

        self.error = QLabel()
        self.error.setObjectName("errorText")
        self.error.setWordWrap(True)
        self.error.hide()
        lay.addWidget(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
                                   | QDialogButtonBox.StandardButton.RestoreDefaults)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(
            lambda: self.set_values(defaults))
        lay.addWidget(buttons)
        self.set_values(values)

    def set_values(self, s: dict) -> None:
        for name, value in s.items():
            w = getattr(self, name, None)
            if isinstance(w, QCheckBox):
                w.setChecked(bool(value))
            elif isinstance(w, QLineEdit):
                w.setText(str(value))
            elif isinstance(w, (QSpinBox, QDoubleSpinBox)):
                w.setValue(value)
        self.spec_k.setEnabled(self.spec_enabled.isChecked())  # toggled does not fire when unchanged

    def values(self) -> dict:
        """The values as the widgets show them (not validated)."""
        return {
            "page_rows": self.page_rows.value(), "pool_pages": self.pool_pages.value(),
            "cache_pages": self.cache_pages.value(), "cache_enabled": self.cache_enabled.isChecked(),
            "namespace": self.namespace.text().strip(), "max_streams": self.max_streams.value(),
            "chunk_tokens": self.chunk_tokens.value(), "spec_enabled": self.spec_enabled.isChecked(),
            "spec_k": self.spec_k.value(), "temperature": round(self.temperature.value(), 4),
            "top_k": self.top_k.value(), "top_p": round(self.top_p.value(), 4),
            "min_p": round(self.min_p.value(), 4), "repeat_penalty": round(self.repeat_penalty.value(), 4),
            "seed": self.seed.value(), "max_new_tokens": self.max_new_tokens.value(),
            "server_host": self.server_host.text().strip(), "server_port": self.server_port.value(),
            "server_api_key": self.server_api_key.text().strip(),
            "server_api_key_remember": self.server_api_key_remember.isChecked(),
            "server_kv_events": self.server_kv_events.text().strip()}

    def accept(self) -> None:
        values = self.values()
        errors = self._check(values)
        if errors:
            self.error.setText("Please fix:\n• " + "\n• ".join(errors))
            self.error.show()
            return
        self.error.hide()
        self.result_values = values
        super().accept()
