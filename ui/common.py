"""Small widgets the panels share: a titled figure and a coloured pill."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from moetray.ui.format import DASH


class Stat(QWidget):
    """A caption over a large value; ``value_text`` is what tests and screen readers see."""

    def __init__(self, caption: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(0)
        self._caption = QLabel(caption)
        self._caption.setStyleSheet("color: #7f8c8d; font-size: 8pt;")
        self._value = QLabel(DASH)
        self._value.setStyleSheet("font-size: 14pt; font-weight: 600;")
        self._value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self._caption)
        layout.addWidget(self._value)
        self.setAccessibleName(caption)

    @property
    def value_text(self) -> str:
        return self._value.text()

    def set_value(self, text: str, tooltip: str | None = None) -> None:
        self._value.setText(text)
        self._value.setToolTip(tooltip or "")


class StatGrid(QWidget):
    """Stats laid out in rows of ``columns``; ``stat(caption)`` finds one by caption."""

    def __init__(self, captions: list[str], columns: int = 4, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        self._stats: dict[str, Stat] = {}
        for i, caption in enumerate(captions):
            stat = Stat(caption)
            self._stats[caption] = stat
            grid.addWidget(stat, i // columns, i % columns)

    def stat(self, caption: str) -> Stat:
        return self._stats[caption]

    def set(self, caption: str, text: str, tooltip: str | None = None) -> None:
        self._stats[caption].set_value(text, tooltip)


class Pill(QLabel):
    """A rounded coloured label (the engine state in the header)."""

    def set_pill(self, text: str, color: str) -> None:
        if (text, color) == getattr(self, "_shown", None):
            return  # a style sheet re-polishes the widget: only on a real change
        self._shown = (text, color)
        self.setText(text)
        self.setStyleSheet(
            f"QLabel {{ background: {color}; color: white; border-radius: 9px; padding: 2px 10px;"
            " font-weight: 600; }")


class LazyView(QWidget):
    """A panel that redraws only while visible and catches up when shown.

    Snapshots arrive every second whether or not anyone looks; a hidden tab (or the whole
    window hidden in the tray) then costs a flag, not a redraw. ``_subscribe(model, name,
    method)`` connects a model signal to ``method`` through one bound slot (so Qt drops the
    connection with the panel); ``method`` runs now if the panel is visible, else once when
    it is next shown.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._stale: dict[str, Callable[[], None]] = {}
        self._routes: dict[tuple[int, str], list[Callable[[], None]]] = {}

    def _subscribe(self, model, signal_name: str, method: Callable[[], None]) -> None:
        key = (id(model), signal_name)
        if key not in self._routes:
            getattr(model, signal_name).connect(self._on_model_signal)
        self._routes.setdefault(key, []).append(method)

    def _on_model_signal(self, *args) -> None:
        sender = self.sender()
        if sender is None:
            return
        name = bytes(sender.metaObject().method(self.senderSignalIndex()).name().data()).decode()
        for method in self._routes.get((id(sender), name), ()):
            self._redraw(method)

    def _redraw(self, method: Callable[[], None]) -> None:
        if self.isVisible():
            method()
        else:
            self._stale[method.__name__] = method

    def showEvent(self, event) -> None:  # noqa: N802 - Qt override
        stale, self._stale = self._stale, {}
        for method in stale.values():
            method()
        super().showEvent(event)
