"""The left pane: the shared system prompt, the prompt list, Run all / Stop all and a settings hint."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from .prompt_list import PromptList
from .theme import icon, titled_box

DEFAULT_SPLIT = [240, 460]


def run_hint(s: dict) -> str:
    """One line saying how the next run goes, from the settings' values."""
    sampling = "greedy" if s["temperature"] <= 0 else f"temperature {s['temperature']:g}"
    cache = "cache on" if s["cache_enabled"] else "cache OFF"
    ns = f", namespace “{s['namespace']}”" if s["namespace"] else ""
    return f"{s['max_new_tokens']} new tokens · {sampling} · up to {s['max_streams']} streams · {cache}{ns}"


class PromptPane(QWidget):
    """System prompt above the prompt list, the run buttons below."""

    def __init__(self, parent=None):
        super().__init__(parent)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 8, 4, 8)
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setObjectName("leftSplitter")
        self.system_edit = QPlainTextEdit()
        self.system_edit.setObjectName("systemPrompt")
        self.system_edit.setPlaceholderText("Shared by every prompt: the part the cache can reuse.")
        self.system_edit.setTabChangesFocus(True)
        self.splitter.addWidget(titled_box("SYSTEM PROMPT", self.system_edit))
        self.prompt_list = PromptList()
        self.splitter.addWidget(self.prompt_list)
        self.splitter.setSizes(DEFAULT_SPLIT)
        lay.addWidget(self.splitter, 1)
        run_row = QHBoxLayout()
        self.run_button = QPushButton(icon("run"), "Run all")
        self.run_button.setObjectName("primary")
        self.run_button.setToolTip("Submit every prompt together (Ctrl+Enter)")
        self.stop_button = QPushButton(icon("stop"), "Stop all")
        self.stop_button.setToolTip("Stop every stream (Esc)")
        run_row.addWidget(self.run_button, 2)
        run_row.addWidget(self.stop_button, 1)
        lay.addLayout(run_row)
        self.hint = QLabel()
        self.hint.setObjectName("hint")
        self.hint.setWordWrap(True)
        lay.addWidget(self.hint)

    def system_prompt(self) -> str:
        """The system prompt as typed, without surrounding blanks."""
        return self.system_edit.toPlainText().strip()

    def set_system_prompt(self, text: str) -> None:
        self.system_edit.setPlainText(text)

    def show_settings(self, values: dict) -> None:
        self.hint.setText(run_hint(values))

    def default_split(self) -> None:
        self.splitter.setSizes(DEFAULT_SPLIT)
