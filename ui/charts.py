"""Plot widgets on pyqtgraph (raster, no OpenGL: the tray must not take device memory).

- :class:`RollingChart`: lines over the last minutes, x in seconds before now, gaps where
  a value was unknown (NaN with ``connect="finite"``: unknown is a gap, never a dip to 0);
- :class:`ResidencyHeatmap`: layers × experts, empty where not resident, coloured by recency;
- :class:`LayerBars`: one bar per layer (hit rate), a missing bar where unknown;
- :class:`SegmentBar`: a stacked bar (engine / others / free of a total), painted directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from moetray.ui.format import DASH
from moetray.ui.viewmodels import HISTORY_POINTS

pg.setConfigOptions(antialias=True, useOpenGL=False, background="w", foreground="#31363b",
                    imageAxisOrder="row-major")

SERIES_COLORS = ("#3daee9", "#27ae60", "#f0a30a", "#da4453", "#8e44ad", "#16a085", "#7f8c8d")
EMPTY_CELL = (214, 219, 223, 255)
HISTORY_SPAN_S = float(HISTORY_POINTS)
"""Seconds a rolling chart shows: the histories' length at the engine's 1 Hz cadence."""
"""A non-resident expert: light grey, clearly not the colour of any resident shade."""


def _heat_lut() -> np.ndarray:
    """256 RGBA shades, pale yellow (resident, cold) to deep red (used this step)."""
    cmap = pg.ColorMap([0.0, 0.4, 0.75, 1.0],
                       [(255, 237, 160), (254, 178, 76), (240, 59, 32), (189, 0, 38)])
    return cmap.getLookupTable(0.0, 1.0, 256, alpha=True)


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


class RollingChart(pg.PlotWidget):
    """Named series over time; ``set_series`` redraws all of them from the model's histories.

    The x axis is fixed at the last ``span_s`` seconds and the y axis moves in 1-2-5 steps,
    so the axes (a large share of a redraw's cost) are laid out again only when a step is
    crossed; lines fill in from the right.
    """

    def __init__(self, title: str, unit: str, names: Sequence[str], *, y_range: tuple[float, float] |
                 None = None, widths: Sequence[float] | None = None, span_s: float = HISTORY_SPAN_S,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent=parent)
        self.setMinimumHeight(150)
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
        self._y_top: float | None = None
        self._fixed_y = y_range is not None
        if y_range is not None:
            self.setYRange(*y_range, padding=0.02)
        else:
            self.enableAutoRange(axis="y", enable=False)
        if len(names) > 1:
            item.addLegend(offset=(-8, 8), labelTextSize="8pt")
        widths = widths or [2.0] * len(names)
        self._curves = [
            item.plot([], [], name=name, pen=pg.mkPen(SERIES_COLORS[i % len(SERIES_COLORS)], width=w),
                      connect="finite")
            for i, (name, w) in enumerate(zip(names, widths, strict=True))]
        self._faint: list[pg.PlotDataItem] = []

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
        """Draw ``series`` (one per name) against ``times``; ``None`` values are gaps."""
        curves = self._curves + self._faint
        if not times:
            for curve in curves:
                curve.setData([], [])
            return
        now = times[-1]
        x = np.asarray([t - now for t in times], dtype=float)
        top = 0.0
        for curve, values in zip(curves, series, strict=False):
            values = list(values)[-len(x):]
            pad = [math.nan] * (len(x) - len(values))  # a series that began later starts as a gap
            y = np.asarray(pad + [math.nan if v is None else float(v) / scale for v in values], dtype=float)
            finite = np.isfinite(y)
            # A lone known point has no line to draw: mark it so it is seen.
            curve.setData(x, y, connect="finite", symbol="o" if finite.sum() == 1 else None,
                          symbolSize=5, symbolBrush=curve.opts["pen"].color(), symbolPen=None)
            if finite.any():
                top = max(top, float(np.nanmax(y)))
        if not self._fixed_y:
            y_top = nice_ceiling(top * 1.1)
            if y_top != self._y_top:  # from zero: no magnified noise; in steps: no per-second relayout
                self._y_top = y_top
                self.setYRange(0.0, y_top, padding=0)

    def curve_data(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = (self._curves + self._faint)[index].getData()
        return (np.asarray([] if x is None else x), np.asarray([] if y is None else y))


class ResidencyHeatmap(pg.GraphicsLayoutWidget):
    """One cell per (layer, expert): grey when not resident, else a recency shade."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent=parent)
        self.setMinimumHeight(180)
        self._plot = self.addPlot()
        self._plot.setMenuEnabled(False)
        self._plot.hideButtons()
        self._plot.setMouseEnabled(x=False, y=False)
        self._plot.setLabel("bottom", "expert")
        self._plot.setLabel("left", "layer")
        self._plot.invertY(True)
        self._image = pg.ImageItem()
        self._plot.addItem(self._image)
        self._lut = _heat_lut()
        self.rgba = np.zeros((0, 0, 4), dtype=np.uint8)

    def set_cells(self, heat: Sequence[Sequence[float | None]]) -> None:
        """Redraw from ``ExpertsModel.heat()``: rows are layers, columns experts."""
        layers = len(heat)
        experts = len(heat[0]) if layers else 0
        rgba = np.empty((layers, experts, 4), dtype=np.uint8)
        rgba[:, :] = EMPTY_CELL
        for layer, row in enumerate(heat):
            for expert, warmth in enumerate(row):
                if warmth is not None:
                    rgba[layer, expert] = self._lut[min(255, max(0, round(warmth * 255)))]
        self.rgba = rgba
        if layers and experts:
            self._image.setImage(rgba, autoLevels=False)
            self._image.setRect(QRectF(-0.5, -0.5, experts, layers))
            self._plot.setXRange(-0.5, experts - 0.5, padding=0)
            self._plot.setYRange(-0.5, layers - 0.5, padding=0)
            self._plot.getAxis("bottom").setTicks(_integer_ticks(experts))
            self._plot.getAxis("left").setTicks(_integer_ticks(layers))
        else:
            self._image.clear()


class LayerBars(pg.PlotWidget):
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
        self.heights: list[float] = []
        self._count = -1

    def set_values(self, values: Sequence[float | None]) -> None:
        known = [(i, v) for i, v in enumerate(values) if v is not None]
        self.heights = [v for _, v in known]
        self._bars.setOpts(x=[i for i, _ in known], height=self.heights)
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

    def set_segments(self, total: float | None, segments: Sequence[tuple[float | None, str]]) -> None:
        """Segments with an unknown size are left out; the rest keep their colour."""
        self._total = total
        self._segments = [(float(v), color) for v, color in segments if v is not None]
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        rect = self.rect().adjusted(0, 2, -1, -3)
        painter.setPen(QColor("#bdc3c7"))
        painter.setBrush(QColor("#f4f5f6"))
        painter.drawRoundedRect(rect, 3, 3)
        if not self._total:
            painter.setPen(QColor("#7f8c8d"))
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
