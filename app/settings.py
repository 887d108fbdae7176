"""The tray's persistent settings, in QSettings (``~/.config/moetray/moetray.conf`` on Linux).

Holds user choices only (recent model folders, the port, whether to serve at start),
never live engine state. Values are read back typed: INI stores strings, and a one-item
list comes back as a bare string.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from PySide6.QtCore import QSettings

ORGANIZATION = "moetray"
APPLICATION = "moetray"
SCHEMA_VERSION = 1
RECENT_MAX = 8
DEMO_MODEL = ""
"""The "model" value meaning the embedded default (``moetray serve`` with no ``--model``)."""


class Settings:
    """Typed access to one QSettings store; pass a store for tests, else the user's own."""

    def __init__(self, store: QSettings | None = None) -> None:
        self._s = store if store is not None else QSettings(
            QSettings.Format.IniFormat, QSettings.Scope.UserScope, ORGANIZATION, APPLICATION)
        if self._s.value("schema_version", 0, type=int) != SCHEMA_VERSION:
            self._s.setValue("schema_version", SCHEMA_VERSION)

    @classmethod
    def at(cls, path: Path) -> Settings:
        return cls(QSettings(str(path), QSettings.Format.IniFormat))

    @property
    def path(self) -> str:
        """The backing file; also names this store's single-instance socket."""
        return self._s.fileName()

    def sync(self) -> None:
        self._s.sync()

    # -- models --------------------------------------------------------------------

    @property
    def recent_models(self) -> list[str]:
        value = self._s.value("models/recent", [])
        if value is None or value == "":
            return []
        if isinstance(value, str):
            return [value]
        return [str(v) for v in cast(Iterable[object], value) if v]

    def remember_model(self, folder: str) -> list[str]:
        """Put ``folder`` first in the recent list (deduplicated, at most :data:`RECENT_MAX`).

        The demo default is not a folder and is never listed.
        """
        recent = self.recent_models
        if folder != DEMO_MODEL:
            recent = [folder] + [f for f in recent if f != folder]
            recent = recent[:RECENT_MAX]
            self._s.setValue("models/recent", recent)
        self._s.setValue("models/last", folder)
        return recent

    @property
    def last_model(self) -> str:
        """The folder served last, or :data:`DEMO_MODEL` for the embedded default."""
        return str(self._s.value("models/last", DEMO_MODEL) or DEMO_MODEL)

    # -- engine --------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The engine's port; 0 picks a free loopback port at each start."""
        return cast(int, self._s.value("engine/port", 0, type=int))

    @port.setter
    def port(self, value: int) -> None:
        self._s.setValue("engine/port", int(value))

    @property
    def device(self) -> str:
        return str(self._s.value("engine/device", "auto") or "auto")

    @device.setter
    def device(self, value: str) -> None:
        self._s.setValue("engine/device", value)

    @property
    def serve_on_start(self) -> bool:
        """Start serving the last model as soon as the tray starts."""
        return cast(bool, self._s.value("engine/serve_on_start", False, type=bool))

    @serve_on_start.setter
    def serve_on_start(self, value: bool) -> None:
        self._s.setValue("engine/serve_on_start", bool(value))

    @property
    def engine_args(self) -> list[str]:
        """Extra ``moetray serve`` flags for every start (e.g. ``--budget-bytes``), as argv words."""
        value = self._s.value("engine/extra_args", [])
        if value is None or value == "":
            return []
        if isinstance(value, str):
            return shlex.split(value)
        return [str(v) for v in cast(Iterable[object], value)]

    @engine_args.setter
    def engine_args(self, args: list[str]) -> None:
        self._s.setValue("engine/extra_args", shlex.join(args))

