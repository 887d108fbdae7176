"""Experts panel: residency heatmap, hit rates (total and per layer), transfer per token, q*."""

from __future__ import annotations

from PySide6.QtWidgets import QGroupBox, QHBoxLayout, QVBoxLayout, QWidget

from moetray.ui.charts import LayerBars, ResidencyHeatmap, RollingChart
from moetray.ui.common import LazyView, StatGrid
from moetray.ui.format import DASH, fmt_bytes, fmt_int, fmt_pct
from moetray.ui.viewmodels import ExpertsModel


class ExpertsView(LazyView):
    def __init__(self, model: ExpertsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        layout = QVBoxLayout(self)
        self.stats = StatGrid(["Hit rate (window)", "Resident experts", "Bytes per token",
                               "Misses: fetched / CPU", "Total hits", "Total misses", "Bytes moved",
                               "Backend"], columns=4)
        layout.addWidget(self.stats)

        heat_box = QGroupBox("Residency: layers × experts (grey: not in device memory)")
        hlayout = QVBoxLayout(heat_box)
        self.heatmap = ResidencyHeatmap()
        hlayout.addWidget(self.heatmap)
        layout.addWidget(heat_box, 2)

        row = QHBoxLayout()
        # Each point covers the second before it; a second with no tokens routed is a gap.
        self.rate_chart = RollingChart("Hit rate over time (thin: per layer)", "hit rate", ["total"],
                                       y_range=(0, 1), widths=[2.5])
        self.layer_bars = LayerBars("Hit rate per layer (window)")
        row.addWidget(self.rate_chart, 3)
        row.addWidget(self.layer_bars, 2)
        layout.addLayout(row, 1)

        self._subscribe(model, "residency_changed", self._update_heatmap)
        self._subscribe(model, "changed", self._update_stats)
        self._subscribe(model, "history_changed", self._update_charts)
        self._update_heatmap()
        self._update_stats()
        self._update_charts()

    def _update_heatmap(self) -> None:
        self.heatmap.set_cells(self.model.heat())

    def _update_stats(self) -> None:
        m = self.model
        layers, experts = m.shape
        split = m.qstar_split()
        self.stats.set("Hit rate (window)", fmt_pct(m.hit_rate))
        self.stats.set("Resident experts",
                       DASH if not layers else f"{m.resident_count} / {layers * experts}")
        self.stats.set("Bytes per token", fmt_bytes(m.bytes_per_token))
        self.stats.set("Misses: fetched / CPU",
                       "all fetched" if split is None and m.backend == "offload"
                       else DASH if split is None else f"{fmt_pct(split[0])} / {fmt_pct(split[1])}",
                       "q*: the share of this step's misses fetched over the link vs computed on the CPU")
        self.stats.set("Total hits", fmt_int(m.total_hits))
        self.stats.set("Total misses", fmt_int(m.total_misses))
        self.stats.set("Bytes moved", fmt_bytes(m.total_bytes))
        self.stats.set("Backend", m.backend or DASH)
        self.layer_bars.set_values(list(m.layer_rates))

    def _update_charts(self) -> None:
        m = self.model
        self.rate_chart.set_faint_count(len(m.layer_histories))
        self.rate_chart.set_series(m.hit_rate_history.times(),
                                   [m.hit_rate_history.values()] + [h.values() for h in m.layer_histories])
