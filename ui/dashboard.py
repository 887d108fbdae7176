"""The dashboard window: a header (engine, state, API URL, actions) over one tab per concern.

It draws the app's :class:`~moetray.ui.dashboard_model.DashboardModel` and emits intents;
it never calls the engine. Closing it emits ``closed``: the app decides whether that
hides to the tray or, with no tray, quits (the "last window" exit path).

It explains itself: every control has a tooltip and is reached with Tab; long titles are
cut with "…" (the whole text in their tooltip), so the window stays at most
:data:`MAX_MIN_WIDTH` pixels wide at its narrowest and never resizes itself.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from moetray.ui.common import ElidedLabel, Pill
from moetray.ui.dashboard_model import DashboardModel
from moetray.ui.experts_view import ExpertsView
from moetray.ui.format import DASH, fmt_age
from moetray.ui.icons import STATE_COLORS, app_icon
from moetray.ui.logs_view import LogsView
from moetray.ui.memory_view import MemoryView
from moetray.ui.pools_view import PoolsView
from moetray.ui.requests_view import RequestsView
from moetray.ui.theme import mute
from moetray.ui.throughput_view import ThroughputView
from moetray.ui.viewmodels import EngineModel, EngineState, serving_action

TABS = ("Memory", "Experts", "Throughput", "Pools", "Requests", "Logs", "Settings")
TAB_TIPS = {
    "Memory": "Device memory (engine and others) and the memory of the engine and tray processes",
    "Experts": "Which experts are in device memory, how often they hit, and what misses cost",
    "Throughput": "Tokens per second, time to first token, queue and totals",
    "Pools": "Re-split device memory between the expert cache and the KV cache, live",
    "Requests": "Running requests (with Stop) and the last finished ones",
    "Logs": "The engine's output",
    "Settings": "Model, address, port, context, threads, start-up and theme",
}
MAX_MIN_WIDTH = 900
"""The dashboard's minimum width may not exceed this many pixels (laptops, tiled windows)."""


class Header(QWidget):
    """Model, state, load progress, API URL, and the tray's actions for a window-only session."""

    start_stop_clicked = Signal()
    copy_url_clicked = Signal()
    quit_clicked = Signal()

    def __init__(self, model: EngineModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        outer = QVBoxLayout(self)
        outer.setContentsMargins(8, 8, 8, 4)
        row = QHBoxLayout()
        icon = QLabel()
        icon.setPixmap(app_icon().pixmap(32, 32))
        row.addWidget(icon)
        self.title = ElidedLabel(DASH)
        font = self.title.font()
        font.setPointSizeF(font.pointSizeF() + 3)
        font.setBold(True)
        self.title.setFont(font)
        row.addWidget(self.title, 1)
        self.pill = Pill()
        self.pill.setToolTip("What the engine is doing now")
        row.addWidget(self.pill)
        self.start_stop = QPushButton("Start serving")
        self.start_stop.clicked.connect(self.start_stop_clicked)
        self.model_button = QToolButton()
        self.model_button.setText("Model")
        self.model_button.setToolTip("Choose the model to serve (the local models found on disk)")
        self.model_button.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.model_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.copy_url = QPushButton("Copy API URL")
        self.copy_url.clicked.connect(self.copy_url_clicked)
        self.quit = QPushButton("Quit")
        self.quit.setToolTip("Stop the engine (after its stop receipt) and close moetray")
        self.quit.clicked.connect(self.quit_clicked)
        for w in (self.start_stop, self.model_button, self.copy_url, self.quit):
            row.addWidget(w)
        outer.addLayout(row)
        self.subtitle = mute(ElidedLabel(DASH))
        outer.addWidget(self.subtitle)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.detail.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        outer.addWidget(self.detail)
        self.crashes = mute(QLabel(), small=True)
        self.crashes.setWordWrap(True)
        self.crashes.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        outer.addWidget(self.crashes)
        self.progress = QProgressBar()
        self.progress.setMaximumHeight(14)
        self.progress.setTextVisible(True)
        outer.addWidget(self.progress)
        model.changed.connect(self._update)
        self._update()

    def _update(self) -> None:
        m = self.model
        self.title.setText(m.model_label or m.model_id or ("Loading the model…" if m.state in (
            EngineState.LOADING,) else "No model loaded"))
        self.pill.set_pill(m.state.value, STATE_COLORS[m.state])
        label, enabled, why = serving_action(m.state, m.attached)
        self.start_stop.setText(label)
        self.start_stop.setEnabled(enabled)
        self.start_stop.setToolTip(why or {"Start serving": "Start the engine with the chosen model",
                                           "Restart engine": "Start the engine again after it failed",
                                           "Stop serving": "Stop the engine and free its memory"}.get(
                                               label, label))
        self.copy_url.setEnabled(m.api_url is not None)
        self.copy_url.setToolTip(f"Copy {m.api_url} for an OpenAI client" if m.api_url
                                 else "No engine is serving, so there is no API URL")
        parts = []
        if m.api_url:
            parts.append(f"API {m.api_url}" + (" (attached)" if m.attached else ""))
        if m.architecture:
            parts.append(m.architecture)
        if m.geometry and None not in m.geometry:
            layers, experts, top_k = m.geometry
            parts.append(f"{layers} layers × {experts} experts, top-{top_k}")
        if m.context_length:
            parts.append(f"context {m.context_length}")
        if m.uptime_s is not None:
            parts.append(f"up {fmt_age(m.uptime_s)}")
        self.subtitle.setText(" · ".join(parts) or DASH)
        self.detail.setText(m.detail or "")
        self.detail.setVisible(bool(m.detail))
        failed = m.state == EngineState.FAILED
        style = "color: #da4453; font-weight: 600;" if failed else ""
        if self.detail.styleSheet() != style:
            self.detail.setStyleSheet(style)
        if m.crash_count:
            self.crashes.setText(f"Crashes in the last 10 minutes: {m.crash_count} (restarted up to 3 times)"
                                 + (f" — last: {m.last_crash}" if m.last_crash else ""))
        self.crashes.setVisible(bool(m.crash_count))
        load = m.load if m.state == EngineState.LOADING else None
        self.progress.setVisible(load is not None)
        if load is not None:
            fraction = load.fraction()
            if fraction is None:
                self.progress.setRange(0, 0)  # indeterminate: the total is unknown
            else:
                self.progress.setRange(0, 1000)
                self.progress.setValue(round(fraction * 1000))
            total = DASH if load.total is None else str(load.total)
            self.progress.setFormat(f"{load.stage}: {load.done} / {total}")


class SettingsView(QWidget):
    """The Settings tab: what is set now, the Settings… button, and where the files are."""

    settings_clicked = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        self.summary = QLabel(DASH)
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.summary)
        self.open_button = QPushButton("Settings…")
        self.open_button.setToolTip("Model, address, port, context, threads, start-up and theme")
        self.open_button.clicked.connect(self.settings_clicked)
        layout.addWidget(self.open_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.paths = mute(QLabel())
        self.paths.setWordWrap(True)
        self.paths.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.paths.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.paths)
        layout.addStretch(1)

    def set_values(self, summary: str, paths: str = "") -> None:
        self.summary.setText(summary)
        self.paths.setText(paths)


class DashboardWindow(QMainWindow):
    closed = Signal()

    def __init__(self, model: DashboardModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.setWindowTitle("moetray")
        self.setWindowIcon(app_icon())
        self.resize(MAX_MIN_WIDTH, 720)
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        self.header = Header(model.engine)
        layout.addWidget(self.header)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.memory = MemoryView(model.memory)
        self.experts = ExpertsView(model.experts)
        self.throughput = ThroughputView(model.throughput)
        self.pools = PoolsView(model.pools)
        self.requests = RequestsView(model.requests, model.history)
        self.logs = LogsView(model.logs)
        self.settings = SettingsView()
        for name, view in zip(TABS, (self.memory, self.experts, self.throughput, self.pools,
                                     self.requests, self.logs, self.settings), strict=True):
            index = self.tabs.addTab(view, name)
            self.tabs.setTabToolTip(index, TAB_TIPS[name])
        layout.addWidget(self.tabs, 1)
        self.setCentralWidget(central)

    def show_tab(self, name: str) -> None:
        self.tabs.setCurrentIndex(TABS.index(name))

    def set_model_menu(self, menu: QMenu) -> None:
        self.header.model_button.setMenu(menu)

    def raise_window(self) -> None:
        """Show, un-minimise and raise (a second launch's "show" lands here)."""
        self.show()
        self.setWindowState((self.windowState() & ~Qt.WindowState.WindowMinimized)
                            | Qt.WindowState.WindowActive)
        self.raise_()
        self.activateWindow()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt override
        event.accept()
        self.closed.emit()
