"""The About dialog: what PrefixLab is and the versions it runs on."""

from __future__ import annotations

import sys

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from .theme import icon


class AboutDialog(QDialog):
    """PrefixLab's name, purpose and a table of versions."""

    def __init__(self, parent: QWidget | None, versions: dict[str, str], model_summary: str = ""):
        super().__init__(parent)
        self.setWindowTitle("About PrefixLab")
        lay = QVBoxLayout(self)
        head = QHBoxLayout()
        logo = QLabel()
        logo.setPixmap(icon("prefixlab").pixmap(64, 64))
        head.addWidget(logo)
        title = QLabel(
            "<h2 style='margin:0'>PrefixLab</h2>"
            "<p>See, and measure, how a paged KV prefix cache saves work in LLM inference.<br>"
            "A pure-NumPy GGUF engine with a paged KV pool and a prefix cache, ported from dasLLAMA.</p>")
        title.setWordWrap(True)
        head.addWidget(title, 1)
        lay.addLayout(head)
        self.versions = dict(versions)
        rows = "".join(f"<tr><td style='padding-right:16px'><b>{k}</b></td><td>{v}</td></tr>"
                       for k, v in self.versions.items())
        if model_summary:
            rows += f"<tr><td style='padding-right:16px'><b>Model</b></td><td>{model_summary}</td></tr>"
        table = QLabel(f"<table>{rows}</table>")
        table.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(table)
        py = QLabel(f"<span style='font-size:10px'>{sys.executable}</span>")
        py.setObjectName("hint")
        lay.addWidget(py)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        buttons.accepted.connect(self.accept)
        lay.addWidget(buttons)

    def text(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.versions.items())
