"""The tray icon and its menu, rebuilt from a state snapshot every time it opens.

vorta's pattern: the menu holds no state of its own. On ``aboutToShow`` it is cleared and
rebuilt from a :class:`TraySnapshot` the app produces, and its actions only call the
app's verbs (:class:`TrayActions`). One method, :meth:`TrayController.set_state`, picks
the icon (state × light/dark variant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QApplication, QMenu, QSystemTrayIcon

from moetray.app.settings import DEMO_MODEL
from moetray.ui.format import fmt_rate
from moetray.ui.icons import state_icon, variant_for
from moetray.ui.viewmodels import EngineState, serving_action

DEMO_LABEL = "Demo model (embedded default)"
OPEN_FOLDER = "Open folder…"
OPEN_DASHBOARD = "Open dashboard"
COPY_API_URL = "Copy API URL"
QUIT = "Quit"
MODEL_MENU = "Model"


@dataclass(frozen=True)
class TraySnapshot:
    """What the menu shows, taken from the app at the moment the menu opens."""

    state: EngineState
    detail: str | None
    model_label: str | None
    tok_s: float | None
    api_url: str | None
    attached: bool
    current_model: str | None  # a folder, DEMO_MODEL, or None when nothing was chosen
    recent: tuple[str, ...]


class TrayActions(Protocol):
    def open_dashboard(self) -> None: ...
    def toggle_serving(self) -> None: ...
    def choose_model(self, folder: str) -> None: ...
    def open_model_folder(self) -> None: ...
    def copy_api_url(self) -> object: ...  # what it returns (the URL copied) is not read here
    def quit(self) -> None: ...


def status_line(snap: TraySnapshot) -> str:
    """``<model> — <state> — <tok/s>``: the menu's first, disabled line."""
    model = snap.model_label or ("demo model" if snap.current_model == DEMO_MODEL else
                                 Path(snap.current_model).name if snap.current_model else "no model")
    parts = [model, snap.state.value]
    if snap.state == EngineState.SERVING:
        parts.append(fmt_rate(snap.tok_s))
    return " — ".join(parts)


def populate_model_menu(menu: QMenu, snap: TraySnapshot, actions: TrayActions) -> None:
    """Fill ``menu`` with the demo default, recent folders and "Open folder…"."""
    menu.clear()
    enabled = not snap.attached
    demo = menu.addAction(DEMO_LABEL)
    demo.setCheckable(True)
    demo.setChecked(snap.current_model == DEMO_MODEL)
    demo.setEnabled(enabled)
    demo.triggered.connect(lambda: actions.choose_model(DEMO_MODEL))
    if snap.recent:
        menu.addSeparator()
    for folder in snap.recent:
        action = menu.addAction(Path(folder).name or folder)
        action.setToolTip(folder)
        action.setStatusTip(folder)
        action.setCheckable(True)
        action.setChecked(folder == snap.current_model)
        action.setEnabled(enabled)
        action.triggered.connect(lambda _=False, f=folder: actions.choose_model(f))
    menu.addSeparator()
    open_folder = menu.addAction(OPEN_FOLDER)
    open_folder.setEnabled(enabled)
    open_folder.triggered.connect(actions.open_model_folder)


def populate_tray_menu(menu: QMenu, snap: TraySnapshot, actions: TrayActions) -> None:
    """Fill the tray menu: status, Open dashboard, Start/Stop, Model ▸, Copy API URL, Quit."""
    menu.clear()
    status = menu.addAction(status_line(snap))
    status.setEnabled(False)
    if snap.detail:
        detail = menu.addAction(snap.detail if len(snap.detail) <= 80 else snap.detail[:79] + "…")
        detail.setEnabled(False)
        detail.setToolTip(snap.detail)
    menu.addSeparator()
    menu.addAction(OPEN_DASHBOARD).triggered.connect(actions.open_dashboard)
    label, enabled, why = serving_action(snap.state, snap.attached)
    serving = menu.addAction(label)
    serving.setEnabled(enabled)
    if why:
        serving.setToolTip(why)
    serving.triggered.connect(actions.toggle_serving)
    models = menu.addMenu(MODEL_MENU)
    populate_model_menu(models, snap, actions)
    copy = menu.addAction(COPY_API_URL)
    copy.setEnabled(snap.api_url is not None)
    copy.triggered.connect(actions.copy_api_url)
    menu.addSeparator()
    menu.addAction(QUIT).triggered.connect(actions.quit)


def menu_texts(menu: QMenu) -> list[str | list[str]]:
    """The menu as text (a submenu as a nested list after its title); separators skipped."""
    out: list[str | list[str]] = []
    for action in menu.actions():
        if action.isSeparator():
            continue
        out.append(action.text())
        sub = action.menu()
        if isinstance(sub, QMenu):
            out.append([a.text() for a in sub.actions() if not a.isSeparator()])
    return out


class TrayController(QObject):
    """Owns the ``QSystemTrayIcon``; the menu is rebuilt on every ``aboutToShow``."""

    def __init__(self, actions: TrayActions, snapshot: Callable[[], TraySnapshot]) -> None:
        super().__init__()
        self._actions = actions
        self._snapshot = snapshot
        self.menu = QMenu()
        self.menu.aboutToShow.connect(self.rebuild_menu)
        self.icon = QSystemTrayIcon()
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._activated)
        self.state = EngineState.STOPPED
        self.variant = variant_for(QApplication.palette())
        self.set_state(EngineState.STOPPED, "moetray")
        self.rebuild_menu()
        hints = QApplication.styleHints()
        if hasattr(hints, "colorSchemeChanged"):  # a light/dark switch re-picks the variant
            hints.colorSchemeChanged.connect(self._restyle)

    def _restyle(self, *_args) -> None:
        self.set_state(self.state, self.icon.toolTip())

    @staticmethod
    def available() -> bool:
        return QSystemTrayIcon.isSystemTrayAvailable()

    def show(self) -> None:
        self.icon.show()

    def hide(self) -> None:
        self.icon.hide()

    def rebuild_menu(self) -> None:
        populate_tray_menu(self.menu, self._snapshot(), self._actions)

    def set_state(self, state: EngineState, tooltip: str) -> None:
        """Pick the icon for ``state`` in the variant that suits the panel; set the tooltip."""
        self.state = EngineState(state)
        self.variant = variant_for(QApplication.palette())
        self.icon.setIcon(state_icon(self.state, self.variant))
        self.icon.setToolTip(tooltip)

    def notify(self, title: str, message: str, *, error: bool = False) -> None:
        if self.icon.isVisible() and self.icon.supportsMessages():
            kind = QSystemTrayIcon.MessageIcon.Critical if error else QSystemTrayIcon.MessageIcon.Information
            self.icon.showMessage(title, message, kind, 8000)

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger,
                      QSystemTrayIcon.ActivationReason.DoubleClick):
            self._actions.open_dashboard()

