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

    def begin_stop(self) -> None:
        """Closes admission for good; refuses with ``StopRefused`` during a rebuild (nothing changed)."""
        with self.lock:
            self._gate.begin_stop()

    def seal(
        self, in_flight: Callable[[], int], snapshot: Callable[[], SealedAccounting]
    ) -> SealedAccounting:
        """Fixes the stop's totals once, counting what is ``in_flight`` under the same lock."""
        with self.lock:
            return self._gate.seal(in_flight(), had_identities=True, snapshot=snapshot)
