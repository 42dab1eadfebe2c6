"""The window's questions and notices: error and info boxes, yes/no, file dialogs (tests patch them)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog, QMessageBox


class AskAndTell:
    """Mixed into a QWidget: non-blocking error and info boxes, a yes/no question, file paths."""

    def show_error(self, title: str, message: str) -> None:
        """An error box that does not block; the part after a blank line goes into its details."""
        head, _, detail = message.partition("\n\n")
        box = QMessageBox(QMessageBox.Icon.Critical, title, head, QMessageBox.StandardButton.Ok, self)
        if detail:
            box.setDetailedText(detail)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.setModal(False)
        box.show()

    def show_info(self, title: str, message: str) -> None:
        box = QMessageBox(QMessageBox.Icon.Information, title, message, QMessageBox.StandardButton.Ok, self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.setModal(False)
        box.show()

    def confirm(self, title: str, message: str) -> bool:
        """Ask yes/no (modal; tests patch it)."""
        answer = QMessageBox.question(self, title, message,
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.Yes)
        return answer == QMessageBox.StandardButton.Yes

    def ask_open_path(self, title: str, start: str, filters: str) -> str:
        return QFileDialog.getOpenFileName(self, title, start, filters)[0]

    def ask_save_path(self, title: str, suggested: str, filters: str) -> str:
        return QFileDialog.getSaveFileName(self, title, suggested, filters)[0]
