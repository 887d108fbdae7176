"""Requests panel: the live table (id, state, tokens, age) with Stop per row and Stop all."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from moetray.ui.format import fmt_age, fmt_int
from moetray.ui.viewmodels import RequestsModel

COLUMNS = ["Request", "State", "Prompt tokens", "Generated", "Age", ""]


class RequestsView(QWidget):
    """Emits ``stop_clicked(id)`` and ``stop_all_clicked()``; rows come from the model only."""

    stop_clicked = Signal(str)
    stop_all_clicked = Signal()

    def __init__(self, model: RequestsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        self.summary = QLabel()
        self.stop_all_button = QPushButton("Stop all")
        self.stop_all_button.clicked.connect(self.stop_all_clicked)
        top.addWidget(self.summary, 1)
        top.addWidget(self.stop_all_button)
        layout.addLayout(top)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in range(1, len(COLUMNS)):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        layout.addWidget(self.table, 1)
        self._row_ids: list[str] = []
        self.stop_buttons: dict[str, QPushButton] = {}
        model.rows_changed.connect(self._update_rows)
        self._update_rows()

    def row_ids(self) -> list[str]:
        return list(self._row_ids)

    def _update_rows(self) -> None:
        rows = self.model.rows
        ids = [r.id for r in rows]
        if ids != self._row_ids:
            self.table.setRowCount(len(rows))
            self.stop_buttons.clear()
            for i, row in enumerate(rows):
                button = QPushButton("Stop")
                button.clicked.connect(lambda _=False, rid=row.id: self.stop_clicked.emit(rid))
                self.table.setCellWidget(i, len(COLUMNS) - 1, button)
                self.stop_buttons[row.id] = button
            self._row_ids = ids
        for i, row in enumerate(rows):
            state = self.model.display_state(row)
            cells = [row.id, state, fmt_int(row.prompt_tokens), fmt_int(row.tokens), fmt_age(row.age_s)]
            for col, text in enumerate(cells):
                item = self.table.item(i, col)
                if item is None:
                    item = QTableWidgetItem()
                    if col >= 2:
                        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                    self.table.setItem(i, col, item)
                if item.text() != text:
                    item.setText(text)
            self.stop_buttons[row.id].setEnabled(state != "stopping")
        self.summary.setText(f"{len(rows)} active request{'s' if len(rows) != 1 else ''}"
                             if rows else "No active requests.")
        self.stop_all_button.setEnabled(bool(rows))
