"""The Settings dialog: pool, cache, scheduler, sampling and server; validated before it closes."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
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

GROUPS = {"pool": "KV pool and prefix cache", "scheduler": "Scheduler", "sampling": "Sampling",
          "server": "Server (OpenAI-compatible HTTP; Run → Server turns it on)"}


def setting_widget(row: dict) -> QWidget:
    """The editor for one row of the settings table (a dict: kind, limits, tip, text)."""
    kind = row["kind"]
    if kind == "bool":
        w = QCheckBox(row["text"])
    elif kind in ("text", "secret"):
        w = QLineEdit()
        w.setPlaceholderText(row["text"])
        if kind == "secret":
            w.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
    elif kind == "choice":
        w = QComboBox()
        for value in row["choices"]:
            w.addItem(str(value), value)
    elif kind == "float":
        w = QDoubleSpinBox()
        w.setDecimals(row["decimals"])
        w.setRange(row["low"], row["high"])
        w.setSingleStep(row["step"])
    else:
        w = QSpinBox()
        w.setRange(int(row["low"]), int(row["high"]))
        w.setAccelerated(True)
        if row["special"]:
            w.setSpecialValueText(row["special"])
    w.setToolTip(row["tip"])
    return w


class SettingsDialog(QDialog):
    """Edits the settings' values (a dict); `accept()` refuses invalid values and says why.

    `table` is the settings table as plain dicts (name, group, kind, default, label, tip,
    limits): one widget per row, named after it. `check(values)` returns every problem as a
    sentence (the app's validation); Restore Defaults puts back the table's defaults.
    """

    flush_requested = Signal()

    def __init__(self, values: dict, table: list[dict], check: Callable[[dict], list[str]],
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(520)
        self._check = check
        self._kinds = {row["name"]: row["kind"] for row in table}
        self.result_values: dict | None = None
        lay = QVBoxLayout(self)
        # Two columns (pool and scheduler | sampling and server): one column is taller than a
        # 1280x800 screen.
        columns = QHBoxLayout()
        lay.addLayout(columns)
        stacks = [QVBoxLayout(), QVBoxLayout()]
        for stack in stacks:
            columns.addLayout(stack, 1)
        forms = {}
        for i, (group, title) in enumerate(GROUPS.items()):
            box = QGroupBox(title)
            forms[group] = QFormLayout(box)
            stacks[i // 2].addWidget(box)
        for stack in stacks:
            stack.addStretch(1)
        for row in table:
            w = setting_widget(row)
            setattr(self, row["name"], w)
            forms[row["group"]].addRow(row["label"], w)
        forms["pool"].addRow(self._flush_row())
        self.spec_enabled.toggled.connect(self.spec_k.setEnabled)  # k means nothing while drafting is off
        lay.addWidget(self._error_label())
        lay.addWidget(self._buttons({row["name"]: row["default"] for row in table}))
        self.set_values(values)

    def _flush_row(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.flush_button = QPushButton(icon("flush"), "Flush cache")
        self.flush_button.setToolTip("Give back every cached page no stream is using")
        self.flush_button.clicked.connect(self.flush_requested)
        row.addWidget(self.flush_button)
        note = QLabel("Changing page rows, pool pages, the page dtype or the disk tier makes a new "
                      "pool (the cache starts empty) once no stream runs.")
        note.setObjectName("hint")
        note.setWordWrap(True)
        row.addWidget(note, 1)
        return row

    def _error_label(self) -> QLabel:
        self.error = QLabel()
        self.error.setObjectName("errorText")
        self.error.setWordWrap(True)
        self.error.hide()
        return self.error

    def _buttons(self, defaults: dict) -> QDialogButtonBox:
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
                                   | QDialogButtonBox.StandardButton.RestoreDefaults)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(
            lambda: self.set_values(defaults))
        return buttons

    def set_values(self, s: dict) -> None:
        for name, value in s.items():
            w = getattr(self, name, None)
            if isinstance(w, QCheckBox):
                w.setChecked(bool(value))
            elif isinstance(w, QLineEdit):
                w.setText(str(value))
            elif isinstance(w, (QSpinBox, QDoubleSpinBox)):
                w.setValue(value)
            elif isinstance(w, QComboBox):
                w.setCurrentIndex(max(0, w.findData(value)))
        self.spec_k.setEnabled(self.spec_enabled.isChecked())  # toggled does not fire when unchanged

    def values(self) -> dict:
        """The values as the widgets show them (not validated)."""
        out = {}
        for name, kind in self._kinds.items():
            w = getattr(self, name)
            if kind == "bool":
                out[name] = w.isChecked()
            elif kind in ("text", "secret"):
                out[name] = w.text().strip()
            elif kind == "choice":
                out[name] = w.currentData()
            else:
                out[name] = round(w.value(), 4) if kind == "float" else w.value()
        return out

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
