"""The tray's persistent settings, in QSettings: ``~/.config/moetray/moetray.ini`` on Linux.

Holds user choices only (the model, the engine's address and sizes, start-up behaviour,
the theme), never live engine state. Values are read back typed: INI stores strings, and
a one-item list comes back as a bare string.

Defaults make the first launch serve: ``serve_on_start`` is on, the model is the embedded
demo, and the API listens on 127.0.0.1:8765 (the same port as headless ``moetray serve``),
so a client configured once keeps working. The LAN API key lives beside the settings in a
0600 file (:meth:`Settings.api_key`), never in the settings file itself.
"""

from __future__ import annotations

import os
import secrets
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from PySide6.QtCore import QSettings

ORGANIZATION = "moetray"
APPLICATION = "moetray"
SETTINGS_FILE = "moetray.ini"
"""The settings file's name (QSettings' INI format in the user's config directory)."""
API_KEY_FILE = "api-key"
"""The LAN API key's file, beside the settings file, mode 0600."""
SCHEMA_VERSION = 1
RECENT_MAX = 8
DEMO_MODEL = ""
"""The "model" value meaning the embedded default (``moetray serve`` with no ``--model``)."""
DEFAULT_PORT = 8765
"""The tray's engine port, as headless ``moetray serve``'s (a taken port moves to the next free one)."""
LOOPBACK = "127.0.0.1"
LAN = "0.0.0.0"
THEMES = ("system", "light", "dark")
RESTART_KEYS = frozenset({"port", "host", "kv_tokens", "threads", "device", "engine_args"})
"""Settings the running engine was started with: changing one takes effect at its next start."""


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

        Call it only for a model the engine served: a refused one is never remembered.
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
        """The model served last, or :data:`DEMO_MODEL` for the embedded default."""
        return str(self._s.value("models/last", DEMO_MODEL) or DEMO_MODEL)

    # -- engine --------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The engine's port (:data:`DEFAULT_PORT`); 0 picks any free loopback port at each start."""
        return cast(int, self._s.value("engine/port", DEFAULT_PORT, type=int))

    @port.setter
    def port(self, value: int) -> None:
        self._s.setValue("engine/port", int(value))

    @property
    def host(self) -> str:
        """Where the API listens: :data:`LOOPBACK` (this machine) or :data:`LAN` (needs the API key)."""
        return str(self._s.value("engine/host", LOOPBACK) or LOOPBACK)

    @host.setter
    def host(self, value: str) -> None:
        self._s.setValue("engine/host", value)

    @property
    def device(self) -> str:
        return str(self._s.value("engine/device", "auto") or "auto")

    @device.setter
    def device(self, value: str) -> None:
        self._s.setValue("engine/device", value)

    @property
    def kv_tokens(self) -> int | None:
        """The KV pool (context) size in tokens; ``None``: the engine plans it from its budget."""
        value = cast(int, self._s.value("engine/kv_tokens", 0, type=int))
        return value or None

    @kv_tokens.setter
    def kv_tokens(self, value: int | None) -> None:
        self._s.setValue("engine/kv_tokens", int(value or 0))

    @property
    def threads(self) -> int | None:
        """The engine's CPU threads; ``None``: torch's default."""
        value = cast(int, self._s.value("engine/threads", 0, type=int))
        return value or None

    @threads.setter
    def threads(self, value: int | None) -> None:
        self._s.setValue("engine/threads", int(value or 0))

    @property
    def serve_on_start(self) -> bool:
        """Start serving the last model as soon as the tray starts (on by default)."""
        return cast(bool, self._s.value("engine/serve_on_start", True, type=bool))

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

    # -- LAN API key ---------------------------------------------------------------

    @property
    def api_key_path(self) -> Path:
        return Path(self.path).with_name(API_KEY_FILE)

    def api_key(self, *, create: bool = False) -> str | None:
        """The API key ``/v1/*`` needs on a LAN address, from its 0600 file.

        With ``create``, a missing key is generated and written (mode 0600, atomically).
        A file readable by others is refused (``PermissionError``) rather than used.
        """
        path = self.api_key_path
        try:
            if path.stat().st_mode & 0o077:
                raise PermissionError(f"{path} is readable by other users; make it mode 0600")
            key = path.read_text().strip()
        except FileNotFoundError:
            key = ""
        if key or not create:
            return key or None
        key = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
        return key

    # -- appearance ----------------------------------------------------------------

    @property
    def theme(self) -> str:
        """``system`` (follow the desktop's light/dark scheme), ``light`` or ``dark``."""
        value = str(self._s.value("ui/theme", "system") or "system")
        return value if value in THEMES else "system"

    @theme.setter
    def theme(self, value: str) -> None:
        if value not in THEMES:
            raise ValueError(f"unknown theme {value!r}; one of {', '.join(THEMES)}")
        self._s.setValue("ui/theme", value)
