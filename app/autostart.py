"""The optional XDG autostart entry: ``$XDG_CONFIG_HOME/autostart/<app id>.desktop``.

The file is the only truth about whether moetray starts at login (no second copy in the
settings). It is written from the template in :mod:`moetray.resources` with ``Exec`` set
to the command that started this tray plus ``--hidden``, so login brings up the tray
icon and no window.
"""

from __future__ import annotations

import os
import shlex
import sys
from importlib import resources
from pathlib import Path

APP_ID = "io.github.moetray.Moetray"
TEMPLATE = "desktop/autostart.desktop"


def autostart_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "autostart"


def autostart_path() -> Path:
    return autostart_dir() / f"{APP_ID}.desktop"


def launch_command() -> list[str]:
    """How to start this tray again: the ``moetray`` script beside this Python, else ``-m``."""
    script = Path(sys.executable).with_name("moetray")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "moetray.app.cli"]


def render_entry(command: list[str]) -> str:
    """The autostart entry's text for ``command`` (``--hidden`` appended)."""
    template = resources.files("moetray.resources").joinpath(TEMPLATE).read_text()
    return template.replace("@EXEC@", shlex.join([*command, "--hidden"]))


def is_enabled() -> bool:
    """Whether an entry exists and is not disabled with ``Hidden=true``."""
    path = autostart_path()
    if not path.is_file():
        return False
    lines = {line.strip().lower() for line in path.read_text(errors="replace").splitlines()}
    return "hidden=true" not in lines


def set_enabled(enabled: bool, command: list[str] | None = None) -> Path:
    """Write (atomically) or remove the entry; returns its path. Removing a missing one is fine."""
    path = autostart_path()
    if not enabled:
        path.unlink(missing_ok=True)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".desktop.partial")
    tmp.write_text(render_entry(command or launch_command()))
    os.replace(tmp, path)
    return path
