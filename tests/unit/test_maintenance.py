"""Rules of the maintenance gate: who may enter, when a rebuild or stop may start, and what a seal means."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.maintenance import (
    AdmissionClosed,
    GateState,
    MaintenanceGate,
    RebuildRefused,
    SealedAccounting,
    StopRefused,
)

SNAP = SealedAccounting("tiny-moe", prompt_tokens_total=120, completion_tokens_total=250, uptime_seconds=10.0)


class Snapshot:
    """A snapshot callable that counts its calls and can return different totals each time."""

    def __init__(self, *values: SealedAccounting) -> None:
        self.values = list(values) or [SNAP]
        self.calls = 0

    def __call__(self) -> SealedAccounting:
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value


def stopping_gate() -> MaintenanceGate:
    gate = MaintenanceGate.serving()
    gate.begin_stop()
    return gate


# --- admission --------------------------------------------------------------------------


def test_new_gate_refuses_until_loading_finishes():
    """A gate that opened optimistically would admit requests into a model still loading."""
    gate = MaintenanceGate()
    assert gate.state is GateState.LOADING
    with pytest.raises(AdmissionClosed) as refused:
        gate.check_admission()
    assert refused.value.kind == "loading"
    gate.finish_loading(True)
    gate.check_admission()
    assert gate.state is GateState.SERVING


def test_failed_load_latches_failed():
    """A load failure that left the gate loading would make clients wait forever."""
    gate = MaintenanceGate()
    assert gate.finish_loading(False) is GateState.FAILED
    with pytest.raises(AdmissionClosed) as refused:
        gate.check_admission()
    assert refused.value.kind == "failed"


def test_late_ready_never_reopens_a_gate_stopped_during_load():
    """A "ready" arriving after a stop would admit requests into an engine being torn down."""
    gate = MaintenanceGate()
    gate.begin_stop()
    assert gate.finish_loading(True) is GateState.STOPPING
    assert not gate.admits()


def test_serving_constructor_admits_at_once():
    """Hosts that build the gate after the model is active would otherwise never open it."""
    gate = MaintenanceGate.serving()
    gate.check_admission()
    assert gate.admits()


def test_admission_refusal_names_the_state():
    """The HTTP layer maps the kind to a status; a generic message would lose retry-now vs never."""
    gate = MaintenanceGate.serving()
    gate.begin_rebuild()
    with pytest.raises(AdmissionClosed) as refused:
        gate.check_admission()
    assert refused.value.kind == "rebuilding"
    assert str(refused.value) == "server unavailable: engine is rebuilding"


def test_latch_failed_closes_admission_from_serving():
    """A dead worker behind an open gate would take requests it can never answer."""
    gate = MaintenanceGate.serving()
    gate.latch_failed()
    assert gate.state is GateState.FAILED
    assert not gate.admits()


# --- rebuild ----------------------------------------------------------------------------


def test_rebuild_timeout_does_not_reopen():
    """Reopening on timeout would send requests into pools the rebuild may still be freeing."""
    gate = MaintenanceGate.serving()
    gate.begin_rebuild()
    gate.rebuild_timed_out()
    assert gate.state is GateState.REBUILDING
    with pytest.raises(AdmissionClosed):
        gate.check_admission()
    gate.finish_rebuild(True)
    gate.check_admission()


def test_rebuild_never_dispatched_reopens():
    """A rebuild that never reached the engine left it untouched; staying closed would be an outage."""
    gate = MaintenanceGate.serving()
    gate.begin_rebuild()
    gate.rebuild_never_dispatched()
    assert gate.state is GateState.SERVING


def test_rebuild_never_dispatched_does_not_reopen_a_stop():
    """The reopen path must be exactly rebuilding → serving, or it could undo a stop or a latch."""
    gate = MaintenanceGate.serving()
    gate.begin_stop()
    gate.rebuild_never_dispatched()
    assert gate.state is GateState.STOPPING
    gate.latch_failed()
    gate.rebuild_never_dispatched()
    assert gate.state is GateState.FAILED


def test_failed_rebuild_latches():
    """A rebuild whose rollback failed left no pools; serving again would fail every request."""
    gate = MaintenanceGate.serving()
    gate.begin_rebuild()
    gate.finish_rebuild(False)
    assert gate.state is GateState.FAILED


def test_late_rebuild_outcome_cannot_resurrect_a_latch():
    """A worker that died mid-rebuild latched failed; a late "ok" must not reopen the gate."""
    gate = MaintenanceGate.serving()
    gate.begin_rebuild()
    gate.latch_failed()
    gate.finish_rebuild(True)
    assert gate.state is GateState.FAILED


@pytest.mark.parametrize(
    ("setup", "kind"),
    [
        (lambda g: None, "not_ready"),  # still loading
        (lambda g: g.latch_failed(), "latched"),
        (lambda g: (g.finish_loading(True), g.begin_rebuild()), "busy"),
        (lambda g: (g.finish_loading(True), g.begin_stop()), "engine_stopping"),  # never retried
    ],
    ids=["loading", "failed", "rebuilding", "stopping"],
)
def test_rebuild_refusal_kinds(setup, kind):
    """One kind for all would make a client retry a latched engine or give up on a busy one."""
    gate = MaintenanceGate()
    setup(gate)
    before = gate.state
    with pytest.raises(RebuildRefused) as refused:
        gate.begin_rebuild()
    assert refused.value.kind == kind
    assert gate.state is before  # refused before any state change


# --- stop and seal ----------------------------------------------------------------------


def test_stop_refused_during_rebuild():
    """Totals sealed over a geometry being replaced would be false; the gate must not move."""
    gate = MaintenanceGate.serving()
    gate.begin_rebuild()
    with pytest.raises(StopRefused) as refused:
        gate.begin_stop()
    assert refused.value.kind == "rebuild_in_progress"
    assert gate.state is GateState.REBUILDING


def test_begin_stop_is_idempotent():
    """A retried stop that raised would turn a successful first stop into a client error."""
    gate = stopping_gate()
    gate.begin_stop()
    assert gate.state is GateState.STOPPING


def test_stop_from_failed_keeps_the_latch():
    """Turning failed into stopping would let a later rebuild see "busy" instead of "latched"."""
    gate = MaintenanceGate.serving()
    gate.latch_failed()
    gate.begin_stop()
    assert gate.state is GateState.FAILED
    assert gate.seal(0, False, Snapshot()) == SNAP  # a failed engine can still report its totals


def test_drained_stop_seals_the_snapshot():
    """The seal is what the receipt reports; losing it loses the engine generation's totals."""
    gate = stopping_gate()
    assert gate.sealed is None
    assert gate.seal(0, False, Snapshot()) == SNAP
    assert gate.sealed == SNAP


def test_a_stop_during_load_seals_without_reopening():
    """A tray quitting while the model loads still needs a receipt, and the gate must stay shut."""
    gate = MaintenanceGate()
    gate.begin_stop()
    zeros = SealedAccounting(None, 0, 0, 1.5)
    assert gate.seal(0, False, lambda: zeros) == zeros
    gate.finish_loading(True)
    assert gate.state is GateState.STOPPING


def test_abort_barrier_timeout_keeps_gate_closed_and_unsealed():
    """Sealing with work in flight would miss a late sampled token; reopening would admit more."""
    gate = stopping_gate()
    snapshot = Snapshot()
    with pytest.raises(StopRefused) as refused:
        gate.seal(2, True, snapshot)
    assert (refused.value.kind, refused.value.active) == ("abort_barrier_timed_out", 2)
    assert refused.value.engine_preserved and not refused.value.drain_complete
    assert gate.state is GateState.STOPPING
    assert gate.sealed is None
    assert snapshot.calls == 0
    with pytest.raises(AdmissionClosed):
        gate.check_admission()
    assert gate.seal(0, True, snapshot) == SNAP  # a later retry, once drained, seals


def test_unidentified_inflight_is_its_own_kind():
    """Work nobody can name cannot be aborted by id; the operator needs to know which case it is."""
    gate = stopping_gate()
    with pytest.raises(StopRefused) as refused:
        gate.seal(1, False, Snapshot())
    assert (refused.value.kind, refused.value.active) == ("unidentified_inflight", 1)


def test_seal_is_cached_forever():
    """A retried stop with fresher totals would produce a second, different receipt."""
    gate = stopping_gate()
    first = gate.seal(0, False, Snapshot(SNAP))
    later = Snapshot(SealedAccounting("other", 999, 999, 99.0))
    assert gate.seal(0, False, later) is first
    assert gate.seal(5, True, later) is first  # even with work reported in flight
    assert later.calls == 0


def test_seal_before_begin_stop_is_a_programming_error():
    """Totals sealed while admission is open could grow after the seal and be reported wrong."""
    gate = MaintenanceGate.serving()
    with pytest.raises(RuntimeError):
        gate.seal(0, False, Snapshot())
    assert gate.sealed is None and gate.state is GateState.SERVING


def test_seal_refused_during_rebuild():
    """A seal taken mid-rebuild would describe pools that are being replaced."""
    gate = MaintenanceGate.serving()
    gate.begin_rebuild()
    with pytest.raises(StopRefused) as refused:
        gate.seal(0, False, Snapshot())
    assert refused.value.kind == "rebuild_in_progress"


def test_sealed_value_is_drained_by_definition():
    """A seal claiming drain_complete=False would make a degraded stop look complete downstream."""
    gate = stopping_gate()
    with pytest.raises(ValueError):
        gate.seal(0, False, Snapshot(SealedAccounting(None, 0, 0, 0.0, drain_complete=False)))
    assert gate.sealed is None


def test_sealed_accounting_json_carries_drain_complete():
    """Supervisors read drain_complete from both the refusal and the seal; it must be present."""
    assert SNAP.to_json() == {
        "model_id": "tiny-moe",
        "prompt_tokens_total": 120,
        "completion_tokens_total": 250,
        "uptime_seconds": 10.0,
        "drain_complete": True,
    }


# --- properties -------------------------------------------------------------------------

totals = st.builds(
    SealedAccounting,
    model_id=st.one_of(st.none(), st.text(max_size=8)),
    prompt_tokens_total=st.integers(0, 10**9),
    completion_tokens_total=st.integers(0, 10**9),
    uptime_seconds=st.floats(0, 1e7, allow_nan=False),
)


@given(first=totals, retries=st.lists(st.tuples(st.integers(0, 5), st.booleans(), totals), max_size=8))
def test_seal_is_identical_however_often_retried(first, retries):
    """Property: after one successful seal, every retry returns the same object, whatever it is told."""
    gate = stopping_gate()
    sealed = gate.seal(0, False, lambda: first)
    for active, had_ids, other in retries:
        assert gate.seal(active, had_ids, lambda other=other: other) is sealed
    assert gate.sealed == first


OPS = {
    "check_admission": lambda g: g.check_admission(),
    "finish_loading_ok": lambda g: g.finish_loading(True),
    "finish_loading_fail": lambda g: g.finish_loading(False),
    "latch_failed": lambda g: g.latch_failed(),
    "begin_rebuild": lambda g: g.begin_rebuild(),
    "rebuild_never_dispatched": lambda g: g.rebuild_never_dispatched(),
    "finish_rebuild_ok": lambda g: g.finish_rebuild(True),
    "finish_rebuild_fail": lambda g: g.finish_rebuild(False),
    "rebuild_timed_out": lambda g: g.rebuild_timed_out(),
    "begin_stop": lambda g: g.begin_stop(),
    "seal_busy": lambda g: g.seal(1, True, lambda: SNAP),
    "seal": lambda g: g.seal(0, False, lambda: SNAP),
}
REFUSALS = (AdmissionClosed, RebuildRefused, StopRefused, RuntimeError)


@given(st.lists(st.sampled_from(sorted(OPS)), max_size=30))
def test_gate_invariants_over_any_sequence(ops):
    """Property: refusals change nothing; failed is a latch; a stopped or sealed gate never admits again."""
    gate = MaintenanceGate()
    was_failed = was_stopping = False
    for op in ops:
        before = (gate.state, gate.sealed)
        try:
            OPS[op](gate)
        except REFUSALS:
            assert (gate.state, gate.sealed) == before, op
        was_failed |= gate.state is GateState.FAILED
        was_stopping |= gate.state is GateState.STOPPING
        if was_failed:
            assert gate.state is GateState.FAILED, op
        if was_stopping:
            assert gate.state in (GateState.STOPPING, GateState.FAILED), op
        if gate.sealed is not None:
            assert not gate.admits()
