"""Plot widgets on pyqtgraph (raster, no OpenGL: the tray must not take device memory).

- :class:`RollingChart`: lines over the last minutes, x in seconds before now, gaps where
  a value was unknown or no sample came (NaN with ``connect="finite"``: unknown is a gap,
  never a dip to 0, and a line is never joined across an engine that was down);
- :class:`ResidencyHeatmap`: layers × experts, empty where not resident, coloured by how
  many steps ago the expert was used, with its colour scale;
- :class:`LayerBars`: one bar per layer (hit rate), a missing bar where unknown;
- :class:`SegmentBar`: a stacked bar (engine / others / free of a total), painted directly.

Every chart follows the theme (:mod:`moetray.ui.theme`) and says "no data yet" while it
has nothing to draw, instead of showing empty axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from moetray.ui import theme as themes
from moetray.ui.format import DASH
from moetray.ui.viewmodels import HISTORY_POINTS, warmth

pg.setConfigOptions(antialias=True, useOpenGL=False, imageAxisOrder="row-major")

SERIES_COLORS = ("#3daee9", "#27ae60", "#f0a30a", "#da4453", "#8e44ad", "#16a085", "#7f8c8d")
NO_DATA = "no data yet"
HISTORY_SPAN_S = float(HISTORY_POINTS)
"""Seconds a rolling chart shows: the histories' length at the engine's 1 Hz cadence."""
GAP_S = 2.5
"""Two samples further apart than this (seconds) had no sample between them: a gap, not a line."""
RECENCY_TICKS = ((0, "0"), (1, "1"), (3, "3"), (9, "9"), (None, "never"))
"""The heatmap scale's labels: steps since an expert was last used (``None``: never used yet)."""


def empty_cell() -> tuple[int, int, int, int]:
    """A non-resident expert: grey, clearly not the colour of any resident shade."""
    return themes.current().empty_cell


def _heat_map() -> pg.ColorMap:
    """Pale yellow (resident, cold) to deep red (used this step)."""
    return pg.ColorMap([0.0, 0.4, 0.75, 1.0],
                       [(255, 237, 160), (254, 178, 76), (240, 59, 32), (189, 0, 38)])


def _integer_ticks(count: int, max_labels: int = 24) -> list[list[tuple[float, str]]]:
    step = max(1, -(-count // max_labels))
    return [[(float(i), str(i)) for i in range(0, count, step)]]


def nice_ceiling(value: float) -> float:
    """The smallest 1-2-5 × 10^k not below ``value``: axes rescale in steps, not every second."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1.0, 2.0, 5.0, 10.0):
        if step * 10**exponent >= value:
            return step * 10**exponent
    return 10.0 ** (exponent + 1)


def with_gaps(times: Sequence[float], values: Sequence[float], gap_s: float = GAP_S
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` with a NaN point inserted wherever two samples lie more than ``gap_s`` apart."""
    t = np.asarray(times, dtype=float)
    y = np.asarray(values, dtype=float)
    if len(t) < 2:
        return t, y
    breaks = np.nonzero(np.diff(t) > gap_s)[0] + 1
    if not len(breaks):
        return t, y
    return (np.insert(t, breaks, (t[breaks - 1] + t[breaks]) / 2.0), np.insert(y, breaks, math.nan))


class _Themed:
    """Mixin: call ``_restyle`` now and whenever the theme changes."""

    def _follow_theme(self) -> None:
        themes.themes().changed.connect(self._restyle)
        self._restyle()

    def _restyle(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def _style_plot(item: pg.PlotItem, theme: themes.Theme) -> None:
    for name in ("left", "bottom"):
        axis = item.getAxis(name)
        axis.setPen(theme.foreground)
        axis.setTextPen(theme.foreground)
    if item.titleLabel is not None and item.titleLabel.text:
        item.setTitle(item.titleLabel.text, size="9pt", color=theme.foreground)


class RollingChart(_Themed, pg.PlotWidget):
    """Named series over time; ``set_series`` redraws all of them from the model's histories.

    The x axis is fixed at the last ``span_s`` seconds and the y axis moves in 1-2-5 steps,
    so the axes (a large share of a redraw's cost) are laid out again only when a step is
    crossed; lines fill in from the right. With no known value it says "no data yet".
    """

    def __init__(self, title: str, unit: str, names: Sequence[str], *, y_range: tuple[float, float] |
                 None = None, widths: Sequence[float] | None = None, span_s: float = HISTORY_SPAN_S,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent=parent)
        self.setMinimumHeight(150)
        self.setToolTip(f"{title}: the last {span_s:.0f} s, newest at the right; gaps where the value "
                        "was unknown or the engine was not running")
        item = self.getPlotItem()
        item.setTitle(title, size="9pt")
        item.setLabel("left", unit)
        item.setLabel("bottom", "seconds ago")
        item.showGrid(x=False, y=False)
        item.setMenuEnabled(False)
        item.hideButtons()
        self.setMouseEnabled(x=False, y=False)
        self.setXRange(-span_s, 0.0, padding=0)
        self.enableAutoRange(axis="x", enable=False)
        self._span_s = span_s
        self._y_top: float | None = None
        self._fixed_y = y_range
        self.setYRange(*(y_range or (0.0, 1.0)), padding=0.02 if y_range else 0)
        self.enableAutoRange(axis="y", enable=False)
        self._legend = item.addLegend(offset=(-8, 8), labelTextSize="8pt") if len(names) > 1 else None
        widths = widths or [2.0] * len(names)
        self._curves = [
            item.plot([], [], name=name, pen=pg.mkPen(SERIES_COLORS[i % len(SERIES_COLORS)], width=w),
                      connect="finite")
            for i, (name, w) in enumerate(zip(names, widths, strict=True))]
        self._faint: list[pg.PlotDataItem] = []
        self._empty = pg.TextItem(NO_DATA, anchor=(0.5, 0.5))
        self._empty.setPos(-span_s / 2.0, 0.5 * sum(y_range or (0.0, 1.0)))
        item.addItem(self._empty, ignoreBounds=True)
        self.has_data = False
        self._follow_theme()
        self._show_empty(True)

    def _restyle(self) -> None:
        theme = themes.current()
        self.setBackground(theme.background)
        _style_plot(self.getPlotItem(), theme)
        self._empty.setColor(theme.muted)
        if self._legend is not None:
            self._legend.setLabelTextColor(theme.foreground)

    def _show_empty(self, empty: bool) -> None:
        self.has_data = not empty
        self._empty.setVisible(empty)
        self.getPlotItem().getAxis("left").setStyle(showValues=not empty)

    def set_faint_count(self, count: int) -> None:
        """Keep ``count`` thin unnamed curves after the named ones (e.g. one per layer)."""
        item = self.getPlotItem()
        while len(self._faint) > count:
            item.removeItem(self._faint.pop())
        while len(self._faint) < count:
            color = QColor(SERIES_COLORS[(len(self._faint) + 1) % len(SERIES_COLORS)])
            color.setAlpha(110)
            self._faint.append(item.plot([], [], pen=pg.mkPen(color, width=1), connect="finite"))

    def set_series(self, times: Sequence[float], series: Sequence[Sequence[float | None]],
                   *, scale: float = 1.0) -> None:
        """Draw ``series`` (one per name) against ``times``; ``None`` values and pauses are gaps."""
        curves = self._curves + self._faint
        if not times:
            for curve in curves:
                curve.setData([], [])
            self._show_empty(True)
            return
        now = times[-1]
        rel = [t - now for t in times]
        top, known = 0.0, False
        for curve, values in zip(curves, series, strict=False):
            values = list(values)[-len(rel):]
            pad = [math.nan] * (len(rel) - len(values))  # a series that began later starts as a gap
            x, y = with_gaps(rel, pad + [math.nan if v is None else float(v) / scale for v in values])
            finite = np.isfinite(y)
            # A lone known point has no line to draw: mark it so it is seen.
            curve.setData(x, y, connect="finite", symbol="o" if finite.sum() == 1 else None,
                          symbolSize=5, symbolBrush=curve.opts["pen"].color(), symbolPen=None)
            if finite.any():
                known = True
                top = max(top, float(np.nanmax(y)))
        self._show_empty(not known)
        if self._fixed_y is None and known:
            y_top = nice_ceiling(top * 1.1)
            if y_top != self._y_top:  # from zero: no magnified noise; in steps: no per-second relayout
                self._y_top = y_top
                self.setYRange(0.0, y_top, padding=0)
                self._empty.setPos(-self._span_s / 2.0, y_top / 2.0)

    def curve_data(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = (self._curves + self._faint)[index].getData()
        return (np.asarray([] if x is None else x), np.asarray([] if y is None else y))


class ResidencyHeatmap(_Themed, pg.GraphicsLayoutWidget):
    """One cell per (layer, expert): grey when not resident, else a shade of how recently it was used.

    A colour scale beside the map reads in steps since last use (0 = this step).
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent=parent)
        self.setMinimumHeight(180)
        self.setToolTip("Each cell is one expert of one layer. Grey: not in device memory. "
                        "Coloured: resident; red was used this step, pale yellow not for many steps.")
        self._plot = self.addPlot()
        self._plot.setMenuEnabled(False)
        self._plot.hideButtons()
        self._plot.setMouseEnabled(x=False, y=False)
        self._plot.setLabel("bottom", "expert")
        self._plot.setLabel("left", "layer")
        self._plot.invertY(True)
        self._image = pg.ImageItem()
        self._plot.addItem(self._image)
        self._map = _heat_map()
        self._lut = self._map.getLookupTable(0.0, 1.0, 256, alpha=True)
        self.scale = pg.ColorBarItem(values=(0.0, 1.0), colorMap=self._map, interactive=False,
                                     width=14, colorMapMenu=False)
        self.scale.axis.setTicks([[(warmth(age), text) for age, text in RECENCY_TICKS]])
        self.addItem(self.scale)
        self._empty = pg.TextItem(NO_DATA, anchor=(0.5, 0.5))
        self._plot.addItem(self._empty, ignoreBounds=True)
        self._empty.setPos(0.5, 0.5)
        self._plot.setXRange(0, 1, padding=0)
        self._plot.setYRange(0, 1, padding=0)
        self.rgba = np.zeros((0, 0, 4), dtype=np.uint8)
        self._heat: Sequence[Sequence[float | None]] = ()
        self._follow_theme()

    def _restyle(self) -> None:
        theme = themes.current()
        self.setBackground(theme.background)
        _style_plot(self._plot, theme)
        self.scale.axis.setPen(theme.foreground)
        self.scale.axis.setTextPen(theme.foreground)
        self.scale.axis.setLabel("steps since last use", color=theme.foreground)
        self._empty.setColor(theme.muted)
        if self._heat:
            self.set_cells(self._heat)

    def set_cells(self, heat: Sequence[Sequence[float | None]]) -> None:
        """Redraw from ``ExpertsModel.heat()``: rows are layers, columns experts."""
        self._heat = heat
        layers = len(heat)
        experts = len(heat[0]) if layers else 0
        rgba = np.empty((layers, experts, 4), dtype=np.uint8)
        rgba[:, :] = empty_cell()
        for layer, row in enumerate(heat):
            for expert, value in enumerate(row):
                if value is not None:
                    rgba[layer, expert] = self._lut[min(255, max(0, round(value * 255)))]
        self.rgba = rgba
        self._empty.setVisible(not (layers and experts))
        for axis in ("left", "bottom"):
            self._plot.getAxis(axis).setStyle(showValues=bool(layers and experts))
        if layers and experts:
            self._image.setImage(rgba, autoLevels=False)
            self._image.setRect(QRectF(-0.5, -0.5, experts, layers))
            self._plot.setXRange(-0.5, experts - 0.5, padding=0)
            self._plot.setYRange(-0.5, layers - 0.5, padding=0)
            self._plot.getAxis("bottom").setTicks(_integer_ticks(experts))
            self._plot.getAxis("left").setTicks(_integer_ticks(layers))
        else:
            self._image.clear()


class LayerBars(_Themed, pg.PlotWidget):
    """One bar per layer in [0, 1]; a layer with an unknown value gets no bar.

    One bar item is updated in place: replacing it every second would leave pyqtgraph
    items for the garbage collector, which may then free them in the middle of a paint.
    """

    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent=parent)
        self.setMinimumHeight(130)
        item = self.getPlotItem()
        item.setTitle(title, size="9pt")
        item.setMenuEnabled(False)
        item.hideButtons()
        item.setLabel("bottom", "layer")
        self.setMouseEnabled(x=False, y=False)
        self.setYRange(0, 1, padding=0.02)
        self._bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=SERIES_COLORS[0], pen=None)
        self.addItem(self._bars)
        self._empty = pg.TextItem(NO_DATA, anchor=(0.5, 0.5))
        item.addItem(self._empty, ignoreBounds=True)
        self._empty.setPos(0.5, 0.5)
        self.heights: list[float] = []
        self._count = -1
        self._follow_theme()
        self.set_values([])

    def _restyle(self) -> None:
        theme = themes.current()
        self.setBackground(theme.background)
        _style_plot(self.getPlotItem(), theme)
        self._empty.setColor(theme.muted)

    def set_values(self, values: Sequence[float | None]) -> None:
        known = [(i, v) for i, v in enumerate(values) if v is not None]
        self.heights = [v for _, v in known]
        self._bars.setOpts(x=[i for i, _ in known], height=self.heights)
        self._empty.setVisible(not known)
        self._empty.setPos((max(len(values), 1) - 1) / 2.0, 0.5)
        self.getPlotItem().getAxis("left").setStyle(showValues=bool(known))
        if len(values) != self._count:
            self._count = len(values)
            self.setXRange(-0.6, max(len(values), 1) - 0.4, padding=0)
            self.getPlotItem().getAxis("bottom").setTicks(_integer_ticks(len(values)))


class SegmentBar(QWidget):
    """A horizontal stacked bar of named segments over a total; unknown totals draw "—"."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setMinimumHeight(22)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self._total: float | None = None
        self._segments: list[tuple[float, str]] = []
        themes.themes().changed.connect(self.update)

    def set_segments(self, total: float | None, segments: Sequence[tuple[float | None, str]]) -> None:
        """Segments with an unknown size are left out; the rest keep their colour."""
        self._total = total
        self._segments = [(float(v), color) for v, color in segments if v is not None]
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        theme = themes.current()
        painter = QPainter(self)
        rect = self.rect().adjusted(0, 2, -1, -3)
        painter.setPen(QColor(theme.bar_frame))
        painter.setBrush(QColor(theme.bar_fill))
        painter.drawRoundedRect(rect, 3, 3)
        if not self._total:
            painter.setPen(QColor(theme.muted))
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, DASH)
            painter.end()
            return
        x = float(rect.left())
        painter.setPen(Qt.PenStyle.NoPen)
        for value, color in self._segments:
            width = rect.width() * max(0.0, min(1.0, value / self._total))
            painter.setBrush(QColor(color))
            painter.drawRect(QRectF(x, rect.top() + 1, width, rect.height() - 1))
            x += width
        painter.end()
