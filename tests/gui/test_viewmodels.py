"""Rules of the dashboard's view models, driven by replayed engine snapshots; no widgets.

Each model must emit only on a real change, keep unknown values as ``None`` (drawn "—",
never 0), and read the engine's words verbatim.
"""

from __future__ import annotations

import copy

import pytest
from replay_data import snapshots

from moetray.ui.dashboard_model import DashboardModel
from moetray.ui.format import DASH, fmt_bytes, fmt_duration_ms, fmt_ms, fmt_pct, fmt_rate
from moetray.ui.outcome import rebuild_outcome
from moetray.ui.requests_model import RequestHistoryModel, RequestsModel
from moetray.ui.viewmodels import (
    EngineModel,
    ExpertsModel,
    FootprintView,
    MemoryModel,
    ThroughputModel,
    interval_hit_rate,
    layer_hit_rates,
)


class Counter:
    def __init__(self, signal):
        self.n = 0
        signal.connect(self._hit)

    def _hit(self, *args):
        self.n += 1


@pytest.fixture
def snaps():
    return snapshots()


# --- unknown is never 0 ---------------------------------------------------------------


def test_formatters_draw_unknown_as_a_dash_never_zero():
    # A CPU engine reports no device "engine bytes"; drawing 0 B would claim it uses none.
    for fmt in (fmt_bytes, fmt_ms, fmt_pct, fmt_rate, fmt_duration_ms):
        assert fmt(None) == DASH
    assert fmt_bytes(0) == "0 B"


def test_hit_rate_of_a_layer_that_routed_nothing_is_unknown():
    # 0 hits of 0 routes is not a 0 % hit rate.
    assert layer_hit_rates([3, 0], [1, 0]) == [0.75, None]


def test_hit_rate_over_an_interval_with_nothing_routed_is_unknown_not_100_percent():
    assert interval_hit_rate((10, 2), (10, 2)) is None  # idle: no tokens routed
    assert interval_hit_rate(None, (10, 2)) is None  # no earlier reading
    assert interval_hit_rate((10, 2), (1, 0)) is None  # a new engine: totals went back
    assert interval_hit_rate((10, 2), (13, 3)) == 0.75


def test_an_idle_engine_draws_a_gap_in_the_hit_rate_chart_not_its_last_window(snaps):
    experts = ExpertsModel()
    for t, snap in enumerate(snaps[1:5]):  # busy at snap 3, then idle (same totals)
        experts.apply_snapshot(snap, float(t))
    assert experts.hit_rate == pytest.approx(23 / 30)  # the window figure stays, as a stat
    assert experts.hit_rate_history.values() == [None, None, pytest.approx(23 / 30), None]
    assert experts.layer_histories[0].values()[-1] is None


def test_free_device_memory_is_unknown_when_any_term_is(snaps):
    memory = MemoryModel()
    memory.apply_snapshot(snaps[1], t=1.0)  # CPU tier: engine/others bytes are null
    assert memory.total_bytes is not None and memory.free_bytes is None
    assert memory.device_label == "CPU device tier: host RAM budget"


# --- emit only on change --------------------------------------------------------------


def test_an_identical_snapshot_emits_no_change(snaps):
    # Redrawing every panel every second for nothing is what the 2 %-CPU goal forbids.
    memory, throughput = MemoryModel(), ThroughputModel()
    mem_changes, tp_changes = Counter(memory.changed), Counter(throughput.changed)
    memory.apply_snapshot(snaps[1], 1.0)
    throughput.apply_snapshot(snaps[1], 1.0)
    memory.apply_snapshot(snaps[2], 2.0)  # idle repeat: only uptime differs
    throughput.apply_snapshot(snaps[2], 2.0)
    assert (mem_changes.n, tp_changes.n) == (1, 1)


def test_histories_still_roll_on_an_unchanged_snapshot(snaps):
    # A flat line is information; a chart that stops scrolling when idle looks frozen.
    throughput = ThroughputModel()
    history = Counter(throughput.history_changed)
    for t, snap in enumerate(snaps[1:3]):
        throughput.apply_snapshot(snap, float(t))
    assert history.n == 2 and throughput.tok_s_history.values() == [None, None]


def test_residency_signal_fires_only_when_the_map_changes(snaps):
    experts = ExpertsModel()
    fired = Counter(experts.residency_changed)
    experts.apply_snapshot(snaps[1], 1.0)
    experts.apply_snapshot(snaps[2], 2.0)  # same map
    assert fired.n == 1
    experts.apply_snapshot(snaps[3], 3.0)  # expert 9 moved, recency known
    assert fired.n == 2


def test_engine_model_keeps_load_progress_until_serving(snaps):
    engine = EngineModel()
    engine.apply_snapshot(snaps[0])
    assert engine.load.stage == "loading weights" and engine.load.fraction() == pytest.approx(1 / 3)
    engine.apply_snapshot(snaps[1])
    assert engine.load is None and engine.model_label.startswith("tiny random")


def test_engine_state_set_twice_emits_once():
    engine = EngineModel()
    changes = Counter(engine.changed)
    engine.set_state("serving")
    engine.set_state("serving")
    assert changes.n == 1


# --- experts --------------------------------------------------------------------------


def test_heat_marks_non_resident_cells_empty_and_the_latest_used_hottest(snaps):
    experts = ExpertsModel()
    experts.apply_snapshot(snaps[3], 1.0)
    heat = experts.heat()
    assert experts.shape == (2, 8)
    assert heat[1][1] is None  # not resident
    assert heat[0][0] == 1.0  # used this step
    assert heat[0][1] == pytest.approx(1 / 4)  # three steps ago
    assert 0 < heat[0][2] < heat[0][1]  # resident, never used: coldest shade, still resident
    assert experts.resident_count == 12


def test_qstar_split_exists_only_for_the_hybrid_backend(snaps):
    experts = ExpertsModel()
    experts.apply_snapshot(snaps[3], 1.0)
    assert experts.qstar_split() is None
    hybrid = copy.deepcopy(snaps[3])
    hybrid["experts"].update(backend="hybrid", fetch_fraction=0.25)
    experts.apply_snapshot(hybrid, 2.0)
    assert experts.qstar_split() == (0.25, 0.75)


def test_per_layer_hit_rate_histories_follow_the_layers(snaps):
    experts = ExpertsModel()
    for t, snap in enumerate(snaps[1:4]):
        experts.apply_snapshot(snap, float(t))
    assert len(experts.layer_histories) == 2
    assert experts.layer_histories[0].values() == [None, None, pytest.approx(14 / 16)]


# --- requests -------------------------------------------------------------------------


def test_a_stopped_row_shows_stopping_until_the_engine_drops_it(snaps):
    # Hiding the row on the tray's say-so would hide a cancel the engine never performed.
    requests = RequestsModel()
    requests.apply_snapshot(snaps[3])
    requests.mark_stopping(["req-a1"])
    row = requests.rows[0]
    assert requests.display_state(row) == "stopping"
    requests.apply_snapshot(snaps[3])  # still listed: still there
    assert [r.id for r in requests.rows] == ["req-a1", "req-b2"]
    requests.apply_snapshot(snaps[5])  # the engine no longer lists it
    assert requests.rows == () and requests.stopping == frozenset()


def test_stopping_a_row_the_engine_no_longer_lists_is_ignored(snaps):
    requests = RequestsModel()
    requests.apply_snapshot(snaps[3])
    assert not requests.mark_stopping(["gone"])


# --- rebuild outcome ------------------------------------------------------------------


BEFORE = {"moe_slots": 12, "kv_pages": 120, "kv_tokens": 1920}
AFTER = {"moe_slots": 16, "kv_pages": 104, "kv_tokens": 1664}


def test_applied_outcome_shows_before_after_and_the_engines_durations_in_plain_words():
    outcome = rebuild_outcome(200, {"outcome": "applied", "before": BEFORE, "after": AFTER,
                                    "prefix_cache_invalidated": True, "elapsed_ms": 2184.0,
                                    "waited_ms": 2100.0, "applied_ms": 84.0})
    assert outcome.severity == "ok" and (outcome.waited_ms, outcome.applied_ms) == (2100.0, 84.0)
    assert outcome.text() == ("Applied: 12 → 16 expert slots, 1\u2009920 → 1\u2009664 KV tokens "
                              "(took 84 ms, after waiting 2.1 s for running requests). "
                              "Cached prompt prefixes were dropped.")


def test_requests_still_running_is_said_in_plain_words_with_no_jargon():
    body = {"error": {"message": "2 requests were still running after 30 s; nothing changed.",
                      "kind": "idle_timeout", "retry": "now", "outcome": "rejected_intact", "before": BEFORE,
                      "after": BEFORE, "elapsed_ms": 30004.2, "waited_ms": 30004.0, "applied_ms": None}}
    outcome = rebuild_outcome(503, body)
    assert outcome.text() == "2 requests were still running after 30 s; nothing changed."
    assert "idle_timeout" not in outcome.text() and outcome.applied_ms is None


def test_a_rejection_is_shown_with_the_engines_own_reason():
    # Paraphrasing would lose the numbers the engine put in its sentence.
    message = "needs 9000000 bytes but the budget leaves 4128768; old pools kept, still serving"
    body = {"error": {"message": message, "kind": "too_large", "code": "too_large", "retry": "never",
                      "outcome": "rejected_intact", "before": BEFORE, "after": BEFORE,
                      "prefix_cache_invalidated": False, "elapsed_ms": 0.4}}
    outcome = rebuild_outcome(400, body)
    assert outcome.outcome == "rejected_intact" and outcome.kind == "too_large"
    assert outcome.text() == message + ". Nothing changed."


def test_refusal_without_outcome_fields_is_read_by_its_kind():
    rolled = rebuild_outcome(409, {"error": {"message": "slot allocation failed", "kind": "rolled_back"}})
    latched = rebuild_outcome(500, {"error": {"message": "restore failed", "kind": "rebuild_latched"}})
    gate = rebuild_outcome(503, {"error": {"message": "", "kind": "not_ready"}})
    assert rolled.outcome == "rolled_back" and rolled.severity == "warning"
    assert latched.outcome == "latched" and latched.severity == "error"
    assert gate.outcome == "rejected_intact" and gate.message == "The engine is not serving yet."


def test_latched_outcome_names_the_way_out():
    latched = rebuild_outcome(500, {"error": {"message": "restore failed", "kind": "rebuild_latched"}})
    assert latched.way_out and "Restart engine" in latched.text()


def test_no_reply_is_its_own_outcome_not_a_rejection():
    assert rebuild_outcome(None, None).outcome == "unreachable"


# --- the aggregate --------------------------------------------------------------------


def test_dashboard_model_distributes_a_whole_replay(snaps):
    model = DashboardModel()
    for t, snap in enumerate(snaps):
        model.apply_snapshot(snap, float(t))
    assert model.snapshots == len(snaps)
    assert model.pools.current.moe_slots == 16
    assert model.throughput.tok_s == 41.5
    assert len(model.memory.engine_footprint_history) == len(snaps)
    model.memory.set_tray_footprint(FootprintView(90 * 2**20, "pss"))
    model.engine.set_endpoint("http://127.0.0.1:8765/v1", attached=False)
    model.forget_engine(t=float(len(snaps)))
    assert model.pools.current is None and model.requests.rows == ()
    assert model.memory.tray_footprint is not None  # the tray still exists
    assert model.engine.api_url is None  # no URL to copy for an engine that is gone
    # Every line ends where the engine died: the next engine's points are never joined to it.
    assert all(h.values()[-1] is None for h in model.histories())


def test_the_history_is_the_engines_feed_newest_first():
    history = RequestHistoryModel()
    rows = [{"id": f"req-{i}", "finished_at": 1000.0 + i, "model": "tiny", "prompt_tokens": 5,
             "completion_tokens": 7, "ttft_ms": None, "tok_s": None, "finish_reason": "length",
             "stopped_by": None} for i in range(3)]
    fired = Counter(history.changed)
    history.apply_history({"requests": rows, "capacity": 200})
    history.apply_history({"requests": rows, "capacity": 200})
    assert fired.n == 1 and [r.id for r in history.rows] == ["req-2", "req-1", "req-0"]
    assert history.rows[0].ttft_ms is None  # unknown stays unknown


def test_a_stale_snapshot_cannot_resurrect_a_row_the_engine_confirmed_gone(snaps):
    # The 1 Hz stream may deliver a snapshot taken just before the cancel landed.
    now = [100.0]
    requests = RequestsModel(stale_s=3.0, clock=lambda: now[0])
    requests.apply_snapshot(snaps[3])
    requests.mark_stopping(["req-a1"])
    remaining = [r for r in snaps[3]["requests"] if r["id"] != "req-a1"]
    requests.apply_requests(remaining, fresh=True)  # /admin/requests after the cancel
    requests.apply_snapshot(snaps[3])  # the stale snapshot still lists it
    assert [r.id for r in requests.rows] == ["req-b2"]
    now[0] += 5.0  # long after: the engine's list is the truth again
    requests.apply_snapshot(snaps[3])
    assert [r.id for r in requests.rows] == ["req-a1", "req-b2"]
