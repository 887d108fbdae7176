"""Tray and window icons from :mod:`moetray.resources`: one SVG per engine state and variant.

``light`` icons (a dark glyph) go with the light theme, ``dark`` icons (a light glyph) with
the dark one: the tray takes the variant of the theme (:mod:`moetray.ui.theme`).
"""

from __future__ import annotations

from importlib import resources

from PySide6.QtGui import QIcon

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
