"""Throughput panel: tok/s, time to first token (p50/p95), queue, requests served."""

from __future__ import annotations

from PySide6.QtWidgets import QHBoxLayout, QVBoxLayout, QWidget

from moetray.ui.charts import RollingChart
from moetray.ui.common import LazyView, StatGrid
from moetray.ui.format import fmt_int, fmt_ms, fmt_rate
from moetray.ui.viewmodels import ThroughputModel


class ThroughputView(LazyView):
    def __init__(self, model: ThroughputModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        layout = QVBoxLayout(self)
        self.stats = StatGrid(["Tokens per second", "TTFT p50", "TTFT p95", "Queue", "Active",
                               "Requests served", "Prompt tokens", "Completion tokens"], columns=4)
        layout.addWidget(self.stats)
        row = QHBoxLayout()
        self.tok_chart = RollingChart("Generation speed", "tok/s", ["tok/s"])
        self.ttft_chart = RollingChart("Time to first token (p50)", "ms", ["TTFT p50"])
        row.addWidget(self.tok_chart)
        row.addWidget(self.ttft_chart)
        layout.addLayout(row, 1)
        self._subscribe(model, "changed", self._update_stats)
        self._subscribe(model, "history_changed", self._update_charts)
        self._update_stats()
        self._update_charts()

    def _update_stats(self) -> None:
        m = self.model
        self.stats.set("Tokens per second", fmt_rate(m.tok_s))
        self.stats.set("TTFT p50", fmt_ms(m.ttft_p50_ms))
        self.stats.set("TTFT p95", fmt_ms(m.ttft_p95_ms))
        self.stats.set("Queue", fmt_int(m.queue))
        self.stats.set("Active", fmt_int(m.active))
        self.stats.set("Requests served", fmt_int(m.requests_served))
        self.stats.set("Prompt tokens", fmt_int(m.prompt_tokens_total))
        self.stats.set("Completion tokens", fmt_int(m.completion_tokens_total))

    def _update_charts(self) -> None:
        m = self.model
        self.tok_chart.set_series(m.tok_s_history.times(), [m.tok_s_history.values()])
        self.ttft_chart.set_series(m.ttft_history.times(), [m.ttft_history.values()])
