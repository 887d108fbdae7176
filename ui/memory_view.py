"""Memory panel: the device (engine vs others, or the CPU tier's budget) and both processes."""

from __future__ import annotations

from PySide6.QtWidgets import QGroupBox, QLabel, QVBoxLayout, QWidget

from moetray.ui.charts import RollingChart, SegmentBar
from moetray.ui.common import LazyView, StatGrid
from moetray.ui.format import DASH, MIB, fmt_bytes
from moetray.ui.viewmodels import FootprintView, MemoryModel

ENGINE_COLOR, OTHERS_COLOR = "#3daee9", "#95a5a6"


def footprint_text(fp: FootprintView | None) -> str:
    """``412.0 MiB (PSS)``: the kind is always named; unknown is "—"."""
    return DASH if fp is None else f"{fmt_bytes(fp.bytes)} ({fp.kind.upper()})"


class MemoryView(LazyView):
    def __init__(self, model: MemoryModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        layout = QVBoxLayout(self)

        device = QGroupBox("Device memory")
        dlayout = QVBoxLayout(device)
        self.device_title = QLabel(DASH)
        self.device_title.setWordWrap(True)
        self.bar = SegmentBar()
        self.device_stats = StatGrid(["Total", "Engine", "Others", "Free", "Pool budget"], columns=5)
        dlayout.addWidget(self.device_title)
        dlayout.addWidget(self.bar)
        dlayout.addWidget(self.device_stats)
        layout.addWidget(device)

        procs = QGroupBox("Host memory of the processes")
        playout = QVBoxLayout(procs)
        self.process_stats = StatGrid(["Engine process", "Tray process"], columns=2)
        playout.addWidget(self.process_stats)
        layout.addWidget(procs)

        self.chart = RollingChart("Memory over time", "MiB",
                                  ["engine on device", "engine process", "tray process"])
        layout.addWidget(self.chart, 1)

        self._subscribe(model, "changed", self._update_numbers)
        self._subscribe(model, "history_changed", self._update_chart)
        self._update_numbers()
        self._update_chart()

    def _update_numbers(self) -> None:
        m = self.model
        if m.device_kind is None:
            self.device_title.setText("No device information yet.")
        else:
            name = m.device_name or DASH
            self.device_title.setText(f"<b>{name}</b> · {m.device_label or m.device_kind}")
        self.bar.set_segments(m.total_bytes, [(m.engine_bytes, ENGINE_COLOR), (m.others_bytes, OTHERS_COLOR)])
        self.device_stats.set("Total", fmt_bytes(m.total_bytes))
        self.device_stats.set("Engine", fmt_bytes(m.engine_bytes))
        self.device_stats.set("Others", fmt_bytes(m.others_bytes))
        self.device_stats.set("Free", fmt_bytes(m.free_bytes))
        self.device_stats.set("Pool budget", fmt_bytes(m.budget_bytes))
        self.process_stats.set("Engine process", footprint_text(m.engine_footprint),
                               "PSS counts shared pages once per sharer; RSS counts them fully.")
        self.process_stats.set("Tray process", footprint_text(m.tray_footprint))

    def _update_chart(self) -> None:
        m = self.model
        self.chart.set_series(m.engine_footprint_history.times(), [
            m.engine_device_history.values(), m.engine_footprint_history.values(),
            m.tray_footprint_history.values()], scale=MIB)
