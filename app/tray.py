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
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from moetray.app.catalog import CatalogRow, refusal_words
from moetray.app.settings import DEMO_MODEL
from moetray.ui.format import fmt_bytes, fmt_rate
from moetray.ui.icons import state_icon
from moetray.ui.theme import themes
from moetray.ui.viewmodels import EngineState, serving_action

DEMO_LABEL = "Demo model (embedded default)"
OPEN_FOLDER = "Open folder…"
OPEN_DASHBOARD = "Open dashboard"
COPY_API_URL = "Copy API URL"
SETTINGS = "Settings…"
QUIT = "Quit"
MODEL_MENU = "Model"
NO_API = "API: not serving"


@dataclass(frozen=True)
class TraySnapshot:
    """What the menu shows, taken from the app at the moment the menu opens."""

    state: EngineState
    detail: str | None
    model_label: str | None
    tok_s: float | None
    api_url: str | None
    attached: bool
    current_model: str | None  # a folder or name, DEMO_MODEL, or None when nothing was chosen
    recent: tuple[str, ...]
    crashes: int = 0  # counted against the restart budget (the last 10 minutes)
    last_crash: str | None = None
    port_note: str | None = None  # "Port 8765 is taken: serving on 8766"
    catalog: tuple[CatalogRow, ...] = ()
    catalog_note: str | None = None  # why the local models could not be listed


class TrayActions(Protocol):
    def open_dashboard(self) -> None: ...
    def toggle_serving(self) -> None: ...
    def choose_model(self, folder: str) -> None: ...
    def open_model_folder(self) -> None: ...
    def copy_api_url(self) -> object: ...  # what it returns (the URL copied) is not read here
    def open_settings(self) -> object: ...  # the dialog it opens is not read here
    def quit(self) -> None: ...


def model_title(value: str) -> str:
    """How a chosen model reads in the menu: a name as is, a folder by its last part."""
    if value == DEMO_MODEL:
        return "demo model"
    return value if ":" in value else (Path(value).name or value)


def status_line(snap: TraySnapshot) -> str:
    """``<model> — <state> — <tok/s>``: the menu's first, disabled line."""
    model = snap.model_label or (model_title(snap.current_model) if snap.current_model is not None
                                 else "no model")
    parts = [model, snap.state.value]
    if snap.state == EngineState.SERVING:
        parts.append(fmt_rate(snap.tok_s))
    return " — ".join(parts)


def _info(menu: QMenu, text: str, tooltip: str | None = None, limit: int = 80) -> None:
    """A disabled line of information (long text cut, whole in the tooltip)."""
    line = menu.addAction(text if len(text) <= limit else text[:limit - 1] + "…")
    line.setEnabled(False)
    line.setToolTip(tooltip or text)


def catalog_label(row: CatalogRow) -> str:
    """``hf:org/name (2.1 GiB)``; a refused model adds why, greyed in the menu."""
    size = f" ({fmt_bytes(row.bytes)})" if row.bytes else ""
    return row.name + size + ("" if row.servable else f" — {refusal_words(row.refusal)}")


def populate_model_menu(menu: QMenu, snap: TraySnapshot, actions: TrayActions) -> None:
    """Fill ``menu``: the demo default, the local models (servable first, refused greyed with
    the reason), recent folders not listed among them, and "Open folder…"."""
    menu.clear()
    menu.setToolTipsVisible(True)
    enabled = not snap.attached
    demo = menu.addAction(DEMO_LABEL)
    demo.setCheckable(True)
    demo.setChecked(snap.current_model == DEMO_MODEL)
    demo.setEnabled(enabled)
    demo.triggered.connect(lambda: actions.choose_model(DEMO_MODEL))
    rows = [r for r in snap.catalog if not r.is_demo]
    listed = {r.launch_value for r in rows} | {r.path for r in rows} | {r.name for r in rows}
    if rows:
        menu.addSeparator()
    for row in rows:
        action = menu.addAction(catalog_label(row))
        tip = f"{row.name}\n{row.path}"
        if not row.servable:
            tip += f"\nNot servable: {refusal_words(row.refusal)}"
        action.setToolTip(tip)
        action.setStatusTip(row.path)
        action.setCheckable(row.servable)
        action.setChecked(row.servable and snap.current_model in (row.launch_value, row.name, row.path))
        action.setEnabled(enabled and row.servable)
        action.triggered.connect(lambda _=False, v=row.launch_value: actions.choose_model(v))
    if snap.catalog_note:
        _info(menu, "Local models: not listed", snap.catalog_note)
    recent = [f for f in snap.recent if f not in listed]
    if recent:
        menu.addSeparator()
    for folder in recent:
        action = menu.addAction(model_title(folder))
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
    """Fill the tray menu: status (and why, crashes, a moved port), Open dashboard,
    Start/Stop (Restart engine after a failure), Model ▸, the API URL with Copy API URL,
    Settings…, Quit."""
    menu.clear()
    menu.setToolTipsVisible(True)
    _info(menu, status_line(snap))
    if snap.detail:
        _info(menu, snap.detail)
    if snap.crashes:
        last = f" — last: {snap.last_crash}" if snap.last_crash else ""
        _info(menu, f"Crashes in the last 10 min: {snap.crashes}{last}")
    if snap.port_note:
        _info(menu, snap.port_note)
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
    menu.addSeparator()
    _info(menu, f"API: {snap.api_url}" if snap.api_url else NO_API)
    copy = menu.addAction(COPY_API_URL)
    copy.setEnabled(snap.api_url is not None)
    copy.triggered.connect(actions.copy_api_url)
    menu.addAction(SETTINGS).triggered.connect(actions.open_settings)
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
        self.variant = themes().theme.name
        self.set_state(EngineState.STOPPED, "moetray")
        self.rebuild_menu()
        themes().changed.connect(self._restyle)  # the icon follows the theme, light or dark

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
        """Pick the icon for ``state`` in the theme's variant (light or dark); set the tooltip."""
        self.state = EngineState(state)
        self.variant = themes().theme.name
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

