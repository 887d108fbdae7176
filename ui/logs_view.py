"""Logs panel: the engine's output, tailing (follows the end unless scrolled up)."""

from __future__ import annotations

from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QLabel, QPlainTextEdit, QVBoxLayout, QWidget

from moetray.ui.viewmodels import LOG_LINES, LogsModel


class LogsView(QWidget):
    def __init__(self, model: LogsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        layout = QVBoxLayout(self)
        self.source_label = QLabel()
        self.source_label.setStyleSheet("color: #7f8c8d;")
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setMaximumBlockCount(LOG_LINES)
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        layout.addWidget(self.source_label)
        layout.addWidget(self.text, 1)
        model.appended.connect(self._append)
        model.cleared.connect(self._reload)
        model.source_changed.connect(self._update_source)
        self._reload()

    def _update_source(self) -> None:
        self.source_label.setText(self.model.source or "No engine output yet.")

    def _reload(self) -> None:
        self._update_source()
        self.text.setPlainText("\n".join(self.model.lines))
        self._to_end()

    def _append(self, lines: list[str]) -> None:
        bar = self.text.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 2
        for line in lines:
            self.text.appendPlainText(line)
        if following:
            self._to_end()

    def _to_end(self) -> None:
        bar = self.text.verticalScrollBar()
        bar.setValue(bar.maximum())
