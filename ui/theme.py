"""One theme, light or dark, for the widgets, the charts and the tray icon.

The setting is ``system`` (follow the desktop: Qt's colour-scheme hint, else the lightness
of the palette the platform gave us), ``light`` or ``dark``. :class:`ThemeManager` resolves
it to a :class:`Theme`, installs the matching Qt palette (Fusion's light palette, or a dark
one built here) and emits ``changed``; charts and the tray restyle themselves on it. Muted
text uses the palette's placeholder colour (:func:`mute`), so it follows the theme with no
style sheet to rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QFont, QPalette
from PySide6.QtWidgets import QApplication, QWidget

THEME_SETTINGS = ("system", "light", "dark")


@dataclass(frozen=True)
class Theme:
    """Colours every themed part reads; ``name`` is ``light`` or ``dark`` (the icon variant)."""

    name: str
    background: str  # charts' canvas
    foreground: str  # axes and titles
    muted: str  # captions, secondary text
    empty_cell: tuple[int, int, int, int]  # a non-resident expert in the heatmap
    bar_frame: str
    bar_fill: str


LIGHT = Theme("light", background="#ffffff", foreground="#31363b", muted="#5d6d7e",
              empty_cell=(214, 219, 223, 255), bar_frame="#bdc3c7", bar_fill="#f4f5f6")
DARK = Theme("dark", background="#1f2326", foreground="#dfe3e6", muted="#9aa5b1",
             empty_cell=(62, 68, 74, 255), bar_frame="#4d565e", bar_fill="#2a2f33")
THEMES = {"light": LIGHT, "dark": DARK}


def dark_palette() -> QPalette:
    """A dark palette for the Fusion style (Qt draws no dark theme by itself on every platform)."""
    p = QPalette()
    window, base, text = QColor("#2b3035"), QColor("#1f2326"), QColor("#e6e9eb")
    disabled = QColor("#7b848c")
    for role, color in ((QPalette.ColorRole.Window, window), (QPalette.ColorRole.WindowText, text),
                        (QPalette.ColorRole.Base, base), (QPalette.ColorRole.AlternateBase, window),
                        (QPalette.ColorRole.ToolTipBase, QColor("#3a4046")),
                        (QPalette.ColorRole.ToolTipText, text), (QPalette.ColorRole.Text, text),
                        (QPalette.ColorRole.Button, QColor("#353b41")),
                        (QPalette.ColorRole.ButtonText, text),
                        (QPalette.ColorRole.BrightText, QColor("#ff6b6b")),
                        (QPalette.ColorRole.Link, QColor("#5dade2")),
                        (QPalette.ColorRole.Highlight, QColor("#3daee9")),
                        (QPalette.ColorRole.HighlightedText, QColor("#101214")),
                        (QPalette.ColorRole.PlaceholderText, QColor(DARK.muted)),
                        (QPalette.ColorRole.Light, QColor("#4a5157")),
                        (QPalette.ColorRole.Midlight, QColor("#40464c")),
                        (QPalette.ColorRole.Mid, QColor("#33393e")),
                        (QPalette.ColorRole.Dark, QColor("#181b1e")),
                        (QPalette.ColorRole.Shadow, QColor("#0d0f10"))):
        p.setColor(role, color)
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    return p


def light_palette(app: QApplication) -> QPalette:
    """The style's own light palette, with the theme's muted colour for captions."""
    p = app.style().standardPalette()
    p.setColor(QPalette.ColorRole.PlaceholderText, QColor(LIGHT.muted))
    return p


W = TypeVar("W", bound=QWidget)


def mute(widget: W, *, small: bool = False) -> W:
    """Draw ``widget``'s text in the theme's muted colour (and smaller); returns it."""
    widget.setForegroundRole(QPalette.ColorRole.PlaceholderText)
    if small:
        font = QFont(widget.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() - 1.0))
        widget.setFont(font)
    return widget


class ThemeManager(QObject):
    """Resolves the theme setting, installs its palette, and says when it changed."""

    changed = Signal()

    def __init__(self, app: QApplication) -> None:
        super().__init__()
        self.app = app
        self.setting = "system"
        self._platform = QPalette(app.palette())
        self._platform_dark = self._platform.color(QPalette.ColorRole.Window).lightness() < 128
        self.theme = LIGHT
        hints = app.styleHints()
        if hasattr(hints, "colorSchemeChanged"):
            hints.colorSchemeChanged.connect(self._system_changed)

    def system_is_dark(self) -> bool:
        """The desktop's scheme: Qt's hint where the platform gives one, else the starting palette."""
        hints = self.app.styleHints()
        scheme = hints.colorScheme() if hasattr(hints, "colorScheme") else Qt.ColorScheme.Unknown
        if scheme == Qt.ColorScheme.Dark:
            return True
        if scheme == Qt.ColorScheme.Light:
            return False
        return self._platform_dark

    def resolve(self, setting: str) -> Theme:
        if setting == "system":
            return DARK if self.system_is_dark() else LIGHT
        if setting not in THEMES:
            raise ValueError(f"unknown theme {setting!r}; one of {', '.join(THEME_SETTINGS)}")
        return THEMES[setting]

    def apply(self, setting: str) -> Theme:
        """Install the palette for ``setting``; emits ``changed`` when the theme differs."""
        theme = self.resolve(setting)
        self.setting = setting
        if (theme is DARK) == self._platform_dark:
            palette = QPalette(self._platform)  # the desktop's own palette already fits
            palette.setColor(QPalette.ColorRole.PlaceholderText, QColor(theme.muted))
        else:
            palette = dark_palette() if theme is DARK else light_palette(self.app)
        self.app.setPalette(palette)
        if theme != self.theme:
            self.theme = theme
            self.changed.emit()
        return theme

    def _system_changed(self, *_args) -> None:
        if self.setting == "system":
            self.apply("system")


_manager: ThemeManager | None = None


def themes() -> ThemeManager:
    """The application's theme manager (made on first use, with the running ``QApplication``)."""
    global _manager
    app = QApplication.instance()
    assert isinstance(app, QApplication), "themes() needs the running QApplication"
    if _manager is None or _manager.app is not app:
        _manager = ThemeManager(app)
    return _manager


def current() -> Theme:
    return themes().theme
