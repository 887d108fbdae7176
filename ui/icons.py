"""Tray and window icons from :mod:`moetray.resources`: one SVG per engine state and variant.

``light`` icons (a dark glyph) are for light panels, ``dark`` icons (a light glyph) for
dark ones; :func:`variant_for` picks by the palette's window colour.
"""

from __future__ import annotations

from importlib import resources

from PySide6.QtGui import QIcon, QPalette

from moetray.ui.viewmodels import EngineState

STATE_COLORS = {
    EngineState.STOPPED: "#8c8c8c",
    EngineState.LOADING: "#f0a30a",
    EngineState.SERVING: "#27ae60",
    EngineState.REBUILDING: "#3daee9",
    EngineState.STOPPING: "#e67e22",
    EngineState.FAILED: "#da4453",
}
"""One colour per state, shared by the tray badge and the dashboard's state pill."""

_cache: dict[tuple[str, str], QIcon] = {}


def icon_path(name: str) -> str:
    return str(resources.files("moetray.resources").joinpath("icons", name))


def variant_for(palette: QPalette) -> str:
    """``dark`` when the panel behind the icon is dark (low window lightness), else ``light``."""
    return "dark" if palette.color(QPalette.ColorRole.Window).lightness() < 128 else "light"


def state_icon(state: EngineState | str, variant: str = "light") -> QIcon:
    """The tray icon for ``state``; refuses an unknown state or variant with ``ValueError``."""
    state = EngineState(state)
    if variant not in ("light", "dark"):
        raise ValueError(f"unknown icon variant {variant!r}")
    key = (state.value, variant)
    if key not in _cache:
        _cache[key] = QIcon(icon_path(f"moetray-{state.value}-{variant}.svg"))
    return _cache[key]


def app_icon() -> QIcon:
    if ("app", "") not in _cache:
        _cache[("app", "")] = QIcon(icon_path("moetray.svg"))
    return _cache[("app", "")]
