"""The engine gate: whether a request, a rebuild or a stop may proceed right now.

Three operations change an engine under its requests: loading, the live re-split of the
memory pools, and stopping. Each has a window in which admitting work is wrong, and each
can fail in a way that leaves the engine in an unknown state, so the gate fails closed:
it starts ``loading`` (never open optimistically), a timeout never reopens it, and a
failure latches ``failed`` until a restart.

The gate holds no clock and does no waiting. The caller owns every timeout; the gate
only says what a timeout means (``rebuild_timed_out`` is a named no-op). Refusals are
exceptions with a snake_case ``.kind`` that ``policy.wire.REFUSALS`` maps to an HTTP
status, raised before any state changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from moetray.policy.refused import Refused

if TYPE_CHECKING:
    from moetray.policy.wire import GateStateName

__all__ = [
    "AdmissionClosed",
    "GateState",
    "MaintenanceGate",
    "RebuildRefused",
    "SealedAccounting",
    "StopRefused",
]


class GateState(StrEnum):
    """Where the engine is in its life; the value is the wire name."""

    LOADING = "loading"  # weights not ready yet
    SERVING = "serving"  # the only state that admits requests
    REBUILDING = "rebuilding"  # a live re-split of the pools is running
    STOPPING = "stopping"  # admission closed for good, draining
    FAILED = "failed"  # latched; only a restart clears it

    @property
    def wire_name(self) -> GateStateName:
        """The value as ``policy.wire.GateStateName`` (the members spell exactly its names)."""
        return self.value


ADMISSION_KINDS: dict[GateState, str] = {
    GateState.LOADING: "loading",
    GateState.REBUILDING: "rebuilding",
    GateState.STOPPING: "engine_stopping",  # nothing will ever be admitted again: never retry
    GateState.FAILED: "failed",
}


class AdmissionClosed(Refused):
    """A request arrived while the gate does not admit; ``.kind`` names why (``ADMISSION_KINDS``).

    ``loading``, ``rebuilding`` and ``failed`` are the state's wire name; a stopping (or
    stopped) engine refuses with ``engine_stopping``, which never succeeds on a retry.
    """

    KINDS = tuple(ADMISSION_KINDS.values())

    def __init__(self, state: GateState) -> None:
        super().__init__(ADMISSION_KINDS[state], f"server unavailable: engine is {state.value}", state=state)


class RebuildRefused(Refused):
    """The gate will not start a rebuild from its current state.

    ``.kind`` is ``not_ready`` (still loading: retry after load), ``latched`` (failed:
    never retry), ``busy`` (another rebuild holds the gate: retry soon) or
    ``engine_stopping`` (stopping or stopped: never retry). ``.state`` names the state that refused.
    """

    KINDS = ("not_ready", "latched", "busy", "engine_stopping")

    def __init__(self, kind: str, state: GateState) -> None:
        super().__init__(kind, f"rebuild refused ({kind}): engine is {state.value}", state=state)


class StopRefused(Refused):
    """A stop cannot proceed yet; the engine is preserved and admission stays closed.

    ``.kind`` is ``rebuild_in_progress`` (sealing totals for a geometry being replaced
    would be false), ``abort_barrier_timed_out`` (``.active`` requests with known ids have
    not acknowledged their abort) or ``unidentified_inflight`` (``.active`` units of work
    in flight that nobody can name). ``.active`` is ``None`` for the rebuild refusal.
    ``drain_complete`` is always false and ``engine_preserved`` always true: the caller
    retries the stop rather than killing a process that may still emit a sampled token.
    """

    KINDS = ("rebuild_in_progress", "abort_barrier_timed_out", "unidentified_inflight")

    drain_complete = False
    engine_preserved = True

    def __init__(self, kind: str, active: int | None = None) -> None:
        if kind == "rebuild_in_progress":
            message = "stop refused: a rebuild is in progress; stop again when it ends"
        else:
            message = f"stop refused ({kind}): {active} still in flight; engine preserved, stop again"
        super().__init__(kind, message, active=active)


@dataclass(frozen=True)
class SealedAccounting:
    """The totals a stop reports, fixed once the engine has drained.

    ``drain_complete`` is true in every value the gate seals; it is carried explicitly
    because a stop refusal reports ``drain_complete: false`` and a supervisor reads the
    same field from both. ``model_id`` is ``None`` when no model was loaded.
    """

    model_id: str | None
    prompt_tokens_total: int
    completion_tokens_total: int
    uptime_seconds: float
    drain_complete: bool = True

    def to_json(self) -> dict[str, object]:
        """The prepare-stop reply body's accounting fields (a new dict; mutates nothing)."""
        return {
            "model_id": self.model_id,
            "prompt_tokens_total": self.prompt_tokens_total,
            "completion_tokens_total": self.completion_tokens_total,
            "uptime_seconds": self.uptime_seconds,
            "drain_complete": self.drain_complete,
        }


class MaintenanceGate:
    """The one admission point of the engine and the state machine behind it.

    ``loading → serving → {rebuilding ⇄ serving, stopping, failed}``; ``failed`` is a
    latch. Every method is synchronous and cheap; callers serialise on one event loop
    (or one lock) so that admission is atomic with state changes.
    """

    def __init__(self) -> None:
        self._state = GateState.LOADING
        self._sealed: SealedAccounting | None = None

    @classmethod
    def serving(cls) -> MaintenanceGate:
        """A gate that starts serving: only for hosts that build it after the model is active.

        Anywhere else use ``MaintenanceGate()`` and call ``finish_loading``, or nothing
        would ever have opened the gate on the strength of a real load.
        """
        gate = cls()
        gate._state = GateState.SERVING
        return gate

    @property
    def state(self) -> GateState:
        """The current state (reading it mutates nothing)."""
        return self._state

    @property
    def sealed(self) -> SealedAccounting | None:
        """The sealed stop totals, or ``None`` until a stop has sealed."""
        return self._sealed

    def admits(self) -> bool:
        """Whether a request would be admitted now (mutates nothing)."""
        return self._state is GateState.SERVING

    def check_admission(self) -> None:
        """Decides whether a new request may enter; mutates nothing.

        Refuses with ``AdmissionClosed`` (``.kind`` = the state's wire name) in every
        state but ``serving``.
        """
        if self._state is not GateState.SERVING:
            raise AdmissionClosed(self._state)

    def finish_loading(self, ok: bool) -> GateState:
        """Ends loading: ``serving`` if ``ok``, else the ``failed`` latch. Returns the state.

        Acts only while ``loading``: a late "ready" must never reopen a gate that a stop
        (or a failure) closed during the load, so from any other state this changes nothing.
        """
        if self._state is GateState.LOADING:
            self._state = GateState.SERVING if ok else GateState.FAILED
        return self._state

    def latch_failed(self) -> None:
        """Latches ``failed`` from any state (a worker died, a rollback failed). Mutates."""
        self._state = GateState.FAILED

    def begin_rebuild(self) -> None:
        """Decides whether a rebuild may start and, if so, closes admission (→ ``rebuilding``).

        Only from ``serving``. Refuses, changing nothing, with ``RebuildRefused``:
        ``not_ready`` while loading, ``latched`` when failed, ``busy`` while another
        rebuild holds the gate, ``engine_stopping`` once a stop began.
        """
        state = self._state
        if state is GateState.SERVING:
            self._state = GateState.REBUILDING
            return
        if state is GateState.LOADING:
            raise RebuildRefused("not_ready", state)
        if state is GateState.FAILED:
            raise RebuildRefused("latched", state)
        if state is GateState.STOPPING:
            raise RebuildRefused("engine_stopping", state)
        raise RebuildRefused("busy", state)

    def rebuild_never_dispatched(self) -> None:
        """Reopens a rebuilding gate whose request never reached the engine (→ ``serving``).

        The only path that reopens ``rebuilding`` from outside a real rebuild outcome: the
        engine is untouched, so serving is safe. From any other state it changes nothing.
        """
        if self._state is GateState.REBUILDING:
            self._state = GateState.SERVING

    def finish_rebuild(self, ok: bool) -> None:
        """Ends a rebuild with its outcome: ``serving`` if ``ok`` (engine preserved), else ``failed``.

        Acts only while ``rebuilding``; a late outcome cannot resurrect a ``failed`` latch
        or reopen a stopping gate.
        """
        if self._state is GateState.REBUILDING:
            self._state = GateState.SERVING if ok else GateState.FAILED

    def rebuild_timed_out(self) -> None:
        """A named no-op: waiting for a rebuild timed out, and the gate stays ``rebuilding``.

        Nothing cancelled the rebuild; it may still be tearing pools down. Reopening
        admission now would send requests into half-built pools, so only the rebuild's own
        outcome (``finish_rebuild``) reopens the gate.
        """

    def begin_stop(self) -> None:
        """Closes admission for good (→ ``stopping``); idempotent.

        Refuses with ``StopRefused("rebuild_in_progress")``, changing nothing, while a
        rebuild runs (totals sealed over a geometry being replaced would be false).
        A ``failed`` gate stays ``failed`` (the latch outranks stopping) but may still seal.
        """
        if self._state is GateState.REBUILDING:
            raise StopRefused("rebuild_in_progress")
        if self._state is not GateState.FAILED:
            self._state = GateState.STOPPING

    def seal(
        self,
        active: int,
        had_identities: bool,
        snapshot: Callable[[], SealedAccounting],
    ) -> SealedAccounting:
        """Decides whether the stop's totals may be fixed now, and fixes them once.

        A gate already sealed returns the cached value and does not call ``snapshot``: a
        retried stop gets identical numbers for the life of the process. Otherwise, with
        ``active > 0`` work still in flight it refuses with ``StopRefused`` (kind
        ``abort_barrier_timed_out`` when the work has ids, ``unidentified_inflight`` when
        not), leaving the gate closed and unsealed. Else it calls ``snapshot`` once and
        caches the result.

        Requires ``begin_stop`` first (a programming error otherwise: totals sealed while
        admission is open could grow after the seal); refuses with
        ``rebuild_in_progress`` during a rebuild.
        """
        if self._sealed is not None:
            return self._sealed
        if self._state is GateState.REBUILDING:
            raise StopRefused("rebuild_in_progress")
        if self._state not in (GateState.STOPPING, GateState.FAILED):
            raise RuntimeError(f"seal() before begin_stop(): engine is {self._state.value}")
        if active > 0:
            kind = "abort_barrier_timed_out" if had_identities else "unidentified_inflight"
            raise StopRefused(kind, active)
        sealed = snapshot()
        if not sealed.drain_complete:
            raise ValueError("a sealed stop is drained by definition; snapshot said drain_complete=False")
        self._sealed = sealed
        return sealed
