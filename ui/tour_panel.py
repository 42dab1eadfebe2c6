"""The guided tour's panel: the step's title and caption, Next, Skip, and Run all at the end.

Plain data in (step number, title, caption HTML); what the buttons mean is wired by app.desktop.tour.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from .theme import icon


class TourPanel(QFrame):
    """One step of the tour at a time; Skip is always there."""

    next_clicked = Signal()
    skip_clicked = Signal()
    run_all_clicked = Signal()

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
        text = QVBoxLayout()
        text.setSpacing(2)
        text.addWidget(self.heading)
        text.addWidget(self.caption)
        buttons = QVBoxLayout()
        buttons.setSpacing(4)
        for b in (self.next_button, self.run_button, self.skip_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(10, 6, 8, 6)
        lay.addLayout(text, 1)
        lay.addLayout(buttons)

    def show_step(self, number: int, total: int, title: str, caption: str, last: bool = False) -> None:
        """Step `number` of `total` (1-based): its title and caption; the last offers Run all."""
        self.heading.setText(f"<b>The Prefix Cache by Hand</b> · step {number} of {total}: <b>{title}</b>")
        self.caption.setText(caption)
        self.next_button.setVisible(not last)
        self.next_button.setEnabled(True)
        self.run_button.setVisible(last)
        self.skip_button.setText("&Close" if last else "S&kip tour")
        (self.run_button if last else self.next_button).setFocus()

    def show_working(self, what: str) -> None:
        """A step runs on the engine: say what, and wait."""
        self.next_button.setEnabled(False)
        self.caption.setText(f"<i>{what}…</i>")

    def set_next_enabled(self, enabled: bool, why: str = "") -> None:
        self.next_button.setEnabled(enabled)
        self.next_button.setToolTip(why or "Do the next step on the engine (Alt+N)")
