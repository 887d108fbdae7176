"""The maintenance gate behind the engine's one lock.

``Gate`` wraps ``policy.maintenance.MaintenanceGate`` so that every transition happens under
the lock the request registry shares: a request is either refused or registered before a
rebuild or a stop looks for idleness. The control operations (``rebuild.py``, ``stop.py``)
drive the gate only through these verbs; the decisions and refusals are the policy's.

May import ``moetray.policy`` only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from moetray.policy.maintenance import GateState, MaintenanceGate, SealedAccounting


class Gate:
    """``MaintenanceGate``'s verbs, each atomic with the registry (see the module docstring)."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._gate = MaintenanceGate()
        self.stop_counts: dict[str, int] | None = None  # drained / aborted, fixed by the first seal

    @property
    def state(self) -> GateState:
        return self._gate.state

    def check_admission(self) -> None:
        """Refuses with ``AdmissionClosed`` unless serving; the caller holds the lock while it registers."""
        with self.lock:
            self._gate.check_admission()

    def finish_loading(self, ok: bool) -> GateState:
        with self.lock:
            return self._gate.finish_loading(ok)

    def latch_failed(self) -> None:
        with self.lock:
            self._gate.latch_failed()

    def begin_rebuild(self) -> None:
        """Closes admission for a re-split; refuses with ``RebuildRefused`` (nothing changed)."""
        with self.lock:
            self._gate.begin_rebuild()

    def rebuild_never_dispatched(self) -> None:
        with self.lock:
            self._gate.rebuild_never_dispatched()

    def rebuild_timed_out(self) -> None:
        with self.lock:
            self._gate.rebuild_timed_out()

    def finish_rebuild(self, ok: bool) -> None:
        with self.lock:
            self._gate.finish_rebuild(ok)

    def begin_stop(self, in_flight: Callable[[], int]) -> int:
        """Closes admission for good and returns how many requests were ``in_flight`` then (counted
        under the same lock); refuses with ``StopRefused`` during a rebuild (nothing changed)."""
        with self.lock:
            self._gate.begin_stop()
            return in_flight()

    def seal(
        self, active: Callable[[], int], snapshot: Callable[[], SealedAccounting], counts: dict[str, int]
    ) -> tuple[SealedAccounting, dict[str, int]]:
        """Fixes the stop's totals once, counting what is still ``active`` under the same lock.

        The stop's ``counts`` (drained / aborted) are fixed with the first seal that succeeds;
        a retried stop gets those first totals and counts back. Refuses like
        ``MaintenanceGate.seal`` (``StopRefused``), fixing nothing.
        """
        with self.lock:
            sealed = self._gate.seal(active(), had_identities=True, snapshot=snapshot)
            if self.stop_counts is None:
                self.stop_counts = dict(counts)
            return sealed, self.stop_counts
