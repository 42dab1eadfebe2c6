"""The guided tour's panel: the step's title and caption, the tutorial's calls that made it, the
two prompts with their shared part marked, Next, Skip, Copy as Python, and Run all at the end.

Plain data in (step number, title, caption HTML, code lines, prompt texts); what the buttons mean
is wired by app.desktop.tour.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QTextEdit, QVBoxLayout, QWidget

from .theme import color, icon


def prompts_html(a: str, b: str, shared: int) -> str:
    """A's and B's prompt texts, one paragraph each, their first `shared` characters marked."""
    mark = f"background:{color('accent')}33"  # the accent, faint
    rows = []
    for name, text in (("A", a), ("B", b)):
        head, tail = html.escape(text[:shared]), html.escape(text[shared:])
        rows.append(f"<p style='margin:0 0 4px 0'><b>{name}</b> <span style='{mark}'>{head}</span>{tail}</p>")
    return "".join(rows).replace("\n", "⏎")


class TourPanel(QFrame):
    """One step of the tour at a time; Skip is always there."""

    next_clicked = Signal()
    skip_clicked = Signal()
    run_all_clicked = Signal()
    copy_clicked = Signal()  # Copy as Python

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("tourPanel")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.heading = QLabel()
        self.heading.setObjectName("tourHeading")
        self.heading.setTextFormat(Qt.TextFormat.RichText)
        self.caption = QLabel()
        self.caption.setObjectName("tourCaption")
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        self.caption.setWordWrap(True)
        self.caption.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        self.code = QLabel()  # the tutorial's calls this step made, with what they returned
        self.code.setObjectName("tourCode")
        self.code.setFont(mono)
        self.code.setTextFormat(Qt.TextFormat.PlainText)
        self.code.setWordWrap(False)  # short lines; a wrapping label is laid out too short in the dock
        self.code.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.code.hide()
        self.prompts = QTextEdit()  # A's and B's prompts, the shared part marked
        self.prompts.setObjectName("tourPrompts")
        self.prompts.setReadOnly(True)
        self.prompts.setMaximumHeight(64)
        self.prompts.setToolTip("The two prompts as the model reads them (⏎: a new line); "
                                "the marked start is what they share")
        self.prompts.hide()
        self.next_button = QPushButton("&Next")
        self.next_button.setDefault(True)
        self.next_button.setToolTip("Do the next step on the engine (Alt+N)")
        self.next_button.clicked.connect(self.next_clicked)
        self.run_button = QPushButton(icon("run"), "Run all (Ctrl+Enter)")
        self.run_button.setToolTip("Run the loaded prompts together through the scheduler")
        self.run_button.clicked.connect(self.run_all_clicked)
        self.run_button.hide()
        self.skip_button = QPushButton("S&kip tour")
        self.skip_button.setToolTip("Close the tour (Help → Tour opens it again)")
        self.skip_button.clicked.connect(self.skip_clicked)
        self.copy_button = QPushButton("Copy as &Python")
        self.copy_button.setToolTip("Copy the steps so far as a script on the public API "
                                    "(import engine as dl)")
        self.copy_button.clicked.connect(self.copy_clicked)
        self.copy_button.setEnabled(False)
        text = QVBoxLayout()
        text.setSpacing(2)
        text.addWidget(self.heading)
        text.addWidget(self.caption)
        text.addWidget(self.code)
        text.addWidget(self.prompts)
        buttons = QVBoxLayout()
        buttons.setSpacing(4)
        for b in (self.next_button, self.run_button, self.copy_button, self.skip_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(10, 6, 8, 6)
        lay.addLayout(text, 1)
        lay.addLayout(buttons)

    def show_step(self, number: int, total: int, title: str, caption: str, last: bool = False,
                  code: list[str] = ()) -> None:
        """Step `number` of `total` (1-based): its title, caption and calls; the last offers Run all."""
        self.heading.setText(f"<b>The Prefix Cache by Hand</b> · step {number} of {total}: <b>{title}</b>")
        self.caption.setText(caption)
        self.code.setText("\n".join(code))
        self.code.setVisible(bool(code))
        self.code.setMinimumHeight(self.code.sizeHint().height())  # the dock grows to show every line
        self.copy_button.setEnabled(bool(code) or self.copy_button.isEnabled())
        self.next_button.setVisible(not last)
        self.next_button.setEnabled(True)
        self.run_button.setVisible(last)
        self.skip_button.setText("&Close" if last else "S&kip tour")
        (self.run_button if last else self.next_button).setFocus()

    def show_prompts(self, a: str, b: str, shared: int) -> None:
        """The two prompts the tour runs, their shared start marked."""
        self.prompts.setHtml(prompts_html(a, b, shared))
        self.prompts.show()

    def show_working(self, what: str) -> None:
        """A step runs on the engine: say what, and wait."""
        self.next_button.setEnabled(False)
        self.caption.setText(f"<i>{what}…</i>")

    def set_next_enabled(self, enabled: bool, why: str = "") -> None:
        self.next_button.setEnabled(enabled)
        self.next_button.setToolTip(why or "Do the next step on the engine (Alt+N)")
