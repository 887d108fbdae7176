"""The Settings dialog: model, address and port, context, threads, start-up and theme.

It edits a :class:`SettingsValues` and nothing else: the app reads the values back, stores
them and applies them. Settings the running engine was started with (model, address, port,
context, threads) take effect at its next start; the dialog says which ones changed and
offers to restart the engine now (:attr:`SettingsDialog.restart_now`).
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from moetray.ui.theme import mute

LOOPBACK, LAN = "127.0.0.1", "0.0.0.0"
ADDRESSES = ((LOOPBACK, "This computer only (127.0.0.1)"),
             (LAN, "Local network (all addresses; clients need the API key)"))
THEME_LABELS = (("system", "Follow the system"), ("light", "Light"), ("dark", "Dark"))
ENGINE_FIELDS = {"model": "model", "host": "address", "port": "port", "kv_tokens": "context",
                 "threads": "threads"}
"""Fields the running engine was started with, and how the dialog names them."""


@dataclass(frozen=True)
class SettingsValues:
    """Everything the dialog edits. ``None`` sizes mean "let the engine decide"."""

    model: str  # "" is the embedded demo model
    host: str
    port: int  # 0: any free port
    kv_tokens: int | None
    threads: int | None
    autostart: bool
    serve_on_start: bool
    theme: str

    def engine_changes(self, other: SettingsValues) -> list[str]:
        """Names of the engine settings that differ from ``other`` (they need an engine restart)."""
        return [label for name, label in ENGINE_FIELDS.items()
                if getattr(self, name) != getattr(other, name)]


class SettingsDialog(QDialog):
    """``values()`` after ``exec()``; ``restart_now`` says whether to restart the engine to apply.

    ``models`` is a list of ``(value, label)`` the model box offers (the demo first);
    ``api_key_path`` is where a LAN API key is kept (shown when the LAN address is chosen).
    ``browse_requested`` asks the app for a folder; it answers with :meth:`add_model`.
    """

    browse_requested = Signal()

    def __init__(self, values: SettingsValues, *, models: list[tuple[str, str]], engine_running: bool,
                 api_key_path: str, paths: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("moetray settings")
        self._initial = values
        self._engine_running = engine_running
        layout = QVBoxLayout(self)
        form = QFormLayout()

        self.model = QComboBox()
        self.model.setToolTip("The model served at start and by Restart engine")
        for value, label in models:
            self.model.addItem(label, value)
        if self.model.findData(values.model) < 0:
            self.model.addItem(values.model, values.model)
        self.model.setCurrentIndex(self.model.findData(values.model))
        browse = QPushButton("Browse…")
        browse.setToolTip("Pick a Hugging Face checkpoint folder")
        browse.clicked.connect(self.browse_requested)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(browse)
        form.addRow("&Model:", model_row)

        self.host = QComboBox()
        self.host.setToolTip("Where the OpenAI-compatible API listens")
        for value, label in ADDRESSES:
            self.host.addItem(label, value)
        self.host.setCurrentIndex(max(0, self.host.findData(values.host)))
        form.addRow("&Address:", self.host)
        self.api_key_note = mute(QLabel(f"The API key is kept in {api_key_path} (readable by you only); "
                                        "clients send it as 'Authorization: Bearer <key>'."), small=True)
        self.api_key_note.setWordWrap(True)
        form.addRow("", self.api_key_note)

        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("any free port")
        self.port.setValue(values.port)
        self.port.setToolTip("The API's TCP port; if it is taken, the next free one is used and the tray "
                             "says so")
        form.addRow("&Port:", self.port)

        self.kv_tokens = QSpinBox()
        self.kv_tokens.setRange(0, 10_000_000)
        self.kv_tokens.setSingleStep(1024)
        self.kv_tokens.setSpecialValueText("planned by the engine")
        self.kv_tokens.setSuffix(" tokens")
        self.kv_tokens.setValue(values.kv_tokens or 0)
        self.kv_tokens.setToolTip("Size of the KV cache (context for all requests together) at start; "
                                  "the Pools tab re-splits it live")
        form.addRow("&Context (KV):", self.kv_tokens)

        self.threads = QSpinBox()
        self.threads.setRange(0, 1024)
        self.threads.setSpecialValueText("automatic")
        self.threads.setValue(values.threads or 0)
        self.threads.setToolTip("CPU threads the engine computes with")
        form.addRow("&Threads:", self.threads)

        self.autostart = QCheckBox("Start moetray at login (hidden in the tray)")
        self.autostart.setToolTip("Writes or removes the XDG autostart entry")
        self.autostart.setChecked(values.autostart)
        self.serve_on_start = QCheckBox("Start serving when moetray starts")
        self.serve_on_start.setToolTip("Serve the model at once, with no click")
        self.serve_on_start.setChecked(values.serve_on_start)
        form.addRow("Start-up:", self.autostart)
        form.addRow("", self.serve_on_start)

        self.theme = QComboBox()
        self.theme.setToolTip("Colours of the dashboard, its charts and the tray icon")
        for value, label in THEME_LABELS:
            self.theme.addItem(label, value)
        self.theme.setCurrentIndex(max(0, self.theme.findData(values.theme)))
        form.addRow("T&heme:", self.theme)
        layout.addLayout(form)

        self.restart_note = QLabel()
        self.restart_note.setWordWrap(True)
        self.restart_box = QCheckBox("Restart the engine now to apply them")
        self.restart_box.setToolTip("Running requests are stopped; otherwise they apply at the next start")
        self.restart_box.setChecked(True)
        layout.addWidget(self.restart_note)
        layout.addWidget(self.restart_box)
        if paths:
            note = mute(QLabel(paths), small=True)
            note.setWordWrap(True)
            note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            layout.addWidget(note)
        ok_cancel = QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        buttons = QDialogButtonBox(ok_cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        for box in (self.model, self.host, self.theme):
            box.currentIndexChanged.connect(self._update)
        for spin in (self.port, self.kv_tokens, self.threads):
            spin.valueChanged.connect(self._update)
        self._update()

    def add_model(self, value: str, label: str | None = None) -> None:
        """Offer ``value`` (a folder the user picked) and select it."""
        if self.model.findData(value) < 0:
            self.model.addItem(label or value, value)
        self.model.setCurrentIndex(self.model.findData(value))

    def values(self) -> SettingsValues:
        return SettingsValues(
            model=str(self.model.currentData()), host=str(self.host.currentData()), port=self.port.value(),
            kv_tokens=self.kv_tokens.value() or None, threads=self.threads.value() or None,
            autostart=self.autostart.isChecked(), serve_on_start=self.serve_on_start.isChecked(),
            theme=str(self.theme.currentData()))

    def engine_changes(self) -> list[str]:
        return self.values().engine_changes(self._initial)

    @property
    def restart_now(self) -> bool:
        """Whether the user asked to restart the running engine so the changes apply now."""
        return self._engine_running and bool(self.engine_changes()) and self.restart_box.isChecked()

    def _update(self) -> None:
        self.api_key_note.setVisible(self.host.currentData() == LAN)
        changed = self.engine_changes()
        if changed and self._engine_running:
            self.restart_note.setText(f"Changing the {', '.join(changed)} needs an engine restart.")
        elif changed:
            self.restart_note.setText(f"The {', '.join(changed)} take effect when the engine starts.")
        self.restart_note.setVisible(bool(changed))
        self.restart_box.setVisible(bool(changed) and self._engine_running)

