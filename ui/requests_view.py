"""Requests panel: the live table (id, state, tokens, age) with Stop per row and Stop all, and
under it the history of the last finished requests (the engine's own feed)."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from moetray.ui.format import DASH, fmt_age, fmt_int, fmt_ms, fmt_rate
from moetray.ui.requests_model import FinishedRow, RequestHistoryModel, RequestsModel
from moetray.ui.theme import mute

COLUMNS = ["Request", "State", "Prompt tokens", "Generated", "Age", ""]
HISTORY_COLUMNS = ["Finished", "Model", "Prompt", "Completion", "TTFT", "tok/s", "Finish", "Stopped by"]
STOPPED_BY = {None: DASH, "client": "client (disconnected)", "admin": "Stop (dashboard or API)",
              "stop": "engine stop", "resplit": "re-split (Stop them and apply)", "error": "engine error"}
"""Who ended a request early, in words (``wire.FinishedRequest.stopped_by``)."""


def _table(columns: list[str]) -> QTableWidget:
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(columns)
    table.verticalHeader().setVisible(False)
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    table.setTabKeyNavigation(False)  # Tab leaves the table for the next control
    return table


def history_cells(row: FinishedRow) -> list[str]:
    """One history row as text: unknown figures are "—", never 0."""
    finished = time.strftime("%H:%M:%S", time.localtime(row.finished_at))
    return [finished, row.model or DASH, fmt_int(row.prompt_tokens), fmt_int(row.completion_tokens),
            fmt_ms(row.ttft_ms), fmt_rate(row.tok_s, ""), row.finish_reason or DASH,
            STOPPED_BY.get(row.stopped_by, str(row.stopped_by))]


class RequestsView(QWidget):
    """Emits ``stop_clicked(id)`` and ``stop_all_clicked()``; rows come from the models only.

    ``history_shown`` fires when the panel becomes visible, so the app can refresh the feed.
    """

    stop_clicked = Signal(str)
    stop_all_clicked = Signal()
    history_shown = Signal()

    def __init__(self, model: RequestsModel, history: RequestHistoryModel | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.history = history or RequestHistoryModel()
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        self.summary = QLabel()
        self.stop_all_button = QPushButton("Stop all")
        self.stop_all_button.setToolTip("Stop every running request; "
                                        "each client gets what was generated so far")
        self.stop_all_button.clicked.connect(self.stop_all_clicked)
        top.addWidget(self.summary, 1)
        top.addWidget(self.stop_all_button)
        layout.addLayout(top)
        self.table = _table(COLUMNS)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        self.table.setToolTip("Requests the engine is working on now")
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in range(1, len(COLUMNS)):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        layout.addWidget(self.table, 1)

        box = QGroupBox("Finished requests")
        blayout = QVBoxLayout(box)
        self.history_note = mute(QLabel(), small=True)
        self.history_note.setWordWrap(True)
        self.history_table = _table(HISTORY_COLUMNS)
        self.history_table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.history_table.setToolTip("The engine's record of the last finished requests, newest first")
        hheader = self.history_table.horizontalHeader()
        hheader.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        hheader.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        blayout.addWidget(self.history_note)
        blayout.addWidget(self.history_table, 1)
        layout.addWidget(box, 2)

        self._row_ids: list[str] = []
        self.stop_buttons: dict[str, QPushButton] = {}
        model.rows_changed.connect(self._update_rows)
        self.history.changed.connect(self._update_history)
        self._update_rows()
        self._update_history()

    def row_ids(self) -> list[str]:
        return list(self._row_ids)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().showEvent(event)
        self.history_shown.emit()

    def _update_rows(self) -> None:
        rows = self.model.rows
        ids = [r.id for r in rows]
        if ids != self._row_ids:
            self.table.setRowCount(len(rows))
            self.stop_buttons.clear()
            for i, row in enumerate(rows):
                button = QPushButton("Stop")
                button.setToolTip(f"Stop request {row.id} now (prefill included)")
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

    def _update_history(self) -> None:
        h = self.history
        rows = h.rows
        self.history_table.setRowCount(len(rows))
        for i, row in enumerate(rows):
            for col, text in enumerate(history_cells(row)):
                item = self.history_table.item(i, col)
                if item is None:
                    item = QTableWidgetItem()
                    if 2 <= col <= 5:
                        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                    self.history_table.setItem(i, col, item)
                if item.text() != text:
                    item.setText(text)
                item.setToolTip(row.id if col == 0 else "")
        keep = f"the last {h.capacity}" if h.capacity else "the last"
        if h.error:
            self.history_note.setText(f"The engine's request history is unavailable: {h.error}")
        elif rows:
            self.history_note.setText(f"{len(rows)} finished request{'s' if len(rows) != 1 else ''} "
                                      f"(the engine keeps {keep}).")
        else:
            self.history_note.setText("No finished requests yet.")
