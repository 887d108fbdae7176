"""Logs panel: the engine's output, tailing (follows the end unless scrolled up)."""

from __future__ import annotations

from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QLabel, QPlainTextEdit, QVBoxLayout, QWidget

from moetray.ui.theme import mute
from moetray.ui.viewmodels import LOG_LINES, LogsModel


class LogsView(QWidget):
    def __init__(self, model: LogsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        layout = QVBoxLayout(self)
        self.source_label = mute(QLabel())
        self.source_label.setWordWrap(True)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setToolTip("The engine's output and the tray's own notes ([moetray] lines)")
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
