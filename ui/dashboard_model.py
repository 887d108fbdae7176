"""Everything the dashboard shows, fed one status snapshot at a time.

The app owns one :class:`DashboardModel`; the tray menu and every panel read from it.
``apply_snapshot`` hands each part its share of a snapshot; each part decides on its own
whether anything changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from PySide6.QtCore import QObject

from moetray.ui.pools_model import PoolsModel
from moetray.ui.requests_model import RequestHistoryModel, RequestsModel
from moetray.ui.viewmodels import (
    EngineModel,
    ExpertsModel,
    History,
    LogsModel,
    MemoryModel,
    ThroughputModel,
)


class DashboardModel(QObject):
    def __init__(self) -> None:
        super().__init__()
        self.engine = EngineModel()
        self.memory = MemoryModel()
        self.experts = ExpertsModel()
        self.throughput = ThroughputModel()
        self.pools = PoolsModel()
        self.requests = RequestsModel()
        self.history = RequestHistoryModel()
        self.logs = LogsModel()
        self.snapshots = 0
        self.last_snapshot: Mapping[str, Any] | None = None
        self.last_t: float | None = None

    def apply_snapshot(self, snap: Mapping[str, Any], t: float) -> None:
        """Distribute one ``StatusSnapshot`` taken at time ``t`` (seconds, any epoch)."""
        self.snapshots += 1
        self.last_snapshot = snap
        self.last_t = t
        self.engine.apply_snapshot(snap)
        self.memory.apply_snapshot(snap, t)
        self.experts.apply_snapshot(snap, t)
        self.throughput.apply_snapshot(snap, t)
        self.pools.apply_snapshot(snap)
        self.requests.apply_snapshot(snap)

    def histories(self) -> list[History]:
        """Every rolling chart's history."""
        m, e, tp = self.memory, self.experts, self.throughput
        return [m.engine_device_history, m.engine_footprint_history, m.tray_footprint_history,
                e.hit_rate_history, *e.layer_histories, tp.tok_s_history, tp.ttft_history]

    def forget_engine(self, t: float | None = None) -> None:
        """The engine is gone (at ``t``): clear what it reported and end every line there.

        Histories and logs stay, so the charts show where it died; no line is joined
        across the time it was down.
        """
        if t is not None:
            for history in self.histories():
                history.break_at(t)
        self.last_snapshot = None
        self.engine.forget_engine()
        self.memory.clear()
        self.pools.clear()
        self.requests.clear()
