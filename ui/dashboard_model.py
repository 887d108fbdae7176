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
from moetray.ui.viewmodels import (
    EngineModel,
    ExpertsModel,
    LogsModel,
    MemoryModel,
    RequestsModel,
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
        self.logs = LogsModel()
        self.snapshots = 0
        self.last_snapshot: Mapping[str, Any] | None = None

    def apply_snapshot(self, snap: Mapping[str, Any], t: float) -> None:
        """Distribute one ``StatusSnapshot`` taken at time ``t`` (seconds, any epoch)."""
        self.snapshots += 1
        self.last_snapshot = snap
        self.engine.apply_snapshot(snap)
        self.memory.apply_snapshot(snap, t)
        self.experts.apply_snapshot(snap, t)
        self.throughput.apply_snapshot(snap, t)
        self.pools.apply_snapshot(snap)
        self.requests.apply_snapshot(snap)

    def forget_engine(self) -> None:
        """The engine is gone: clear what it reported (histories and logs stay)."""
        self.last_snapshot = None
        self.engine.forget_engine()
        self.memory.clear()
        self.pools.clear()
        self.requests.clear()
