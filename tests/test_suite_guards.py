"""The suite's own guards (tests/conftest.py, pyproject.toml): no test can block on a modal dialog,
and a test that hangs ends the run instead of stalling it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REFUSED_DIALOGS, ModalDialogRefused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_modal_dialog_fails_its_test_naming_the_dialog(qtbot):
    from PySide6.QtCore import QObject, Signal
    from PySide6.QtWidgets import QMessageBox, QWidget

    from ui.ask import AskAndTell

    class Asker(AskAndTell, QWidget):
        pass

    asker = Asker()
    qtbot.addWidget(asker)
    with pytest.raises(ModalDialogRefused, match=r"QMessageBox\.question\('Install Gemma\?', 'Accept"):
        asker.confirm("Install Gemma?", "Accept its terms?")
    with pytest.raises(ModalDialogRefused, match=r"QFileDialog\.getOpenFileName\('Open a trace'"):
        asker.ask_open_path("Open a trace", "", "Traces (*.jsonl)")
    with pytest.raises(ModalDialogRefused, match=r"QFileDialog\.getSaveFileName\('Export report'"):
        asker.ask_save_path("Export report", "report.html", "HTML (*.html)")
    box = QMessageBox(QMessageBox.Icon.Question, "Switch model?", "Stop the streams?", parent=asker)
    with pytest.raises(ModalDialogRefused, match=r"QMessageBox\.exec\(\) of 'Switch model\?' / 'Stop"):
        box.exec()

    class Button(QObject):
        clicked = Signal()

    def slot_that_swallows() -> None:  # the app's slots catch and report their errors
        try:
            QMessageBox.warning(asker, "Disk full", "Nothing was saved")
        except Exception:  # noqa: BLE001
            pass

    button = Button()
    button.clicked.connect(slot_that_swallows)
    button.clicked.emit()  # swallowed, yet recorded: the run fails the test all the same
    assert REFUSED_DIALOGS[-1] == "QMessageBox.warning('Disk full', 'Nothing was saved')"
    REFUSED_DIALOGS.clear()  # this test opened them on purpose


HANGS = """
def test_waits_for_ever(qapp):
    from PySide6.QtCore import QEventLoop
    QEventLoop().exec()   # nothing ever quits it: a Qt loop that Python's signals cannot interrupt
"""


def test_a_test_stuck_in_a_qt_loop_ends_the_run_with_the_stacks(tmp_path):
    """The suite's timeout settings (pyproject.toml) end a stuck test: here after 3 s instead of the
    suite's 300 s."""
    (tmp_path / "test_hangs.py").write_text(HANGS, encoding="utf-8")
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-c", os.path.join(ROOT, "pyproject.toml"), "--rootdir", str(tmp_path),
                          "--timeout", "3", str(tmp_path / "test_hangs.py")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    took = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Timeout" in out and "test_waits_for_ever" in out, out[-2000:]
    assert took < 120, f"the stuck test ended the run after {took:.0f} s"
