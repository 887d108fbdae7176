"""Rules of the re-split slider's model: limits, projection and Apply come from pool_budget.

No widgets. The budget numbers come from a replayed snapshot's ``pools`` object, which is
exactly what the dashboard receives from the engine.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st
from replay_data import snapshots

from moetray.policy.pool_budget import PoolBudget, PoolSizes, RebuildRequest
from moetray.ui.pools_model import ApplyRefused, PoolsModel
from moetray.ui.viewmodels import rebuild_outcome

SNAPS = snapshots()
SERVING = SNAPS[1]
REBUILDING = SNAPS[4]


def serving_model() -> PoolsModel:
    model = PoolsModel()
    model.apply_snapshot(SERVING)
    return model


def test_slider_range_is_pool_budgets_limits():
    # A hand-derived range could offer sizes the engine's validate_rebuild rejects.
    model = serving_model()
    assert model.limits == PoolBudget.from_wire(SERVING["pools"]).limits()
    assert (model.limits.moe_min, model.limits.moe_max) == (8, 16)


def test_slider_is_disabled_with_the_gate_reason_while_not_serving():
    model = PoolsModel()
    model.apply_snapshot(REBUILDING)
    assert not model.enabled
    assert "being re-split" in model.disabled_reason
    model.apply_snapshot(SERVING)
    assert model.enabled and model.disabled_reason is None


def test_no_engine_disables_the_slider_and_says_so():
    model = PoolsModel()
    assert model.disabled_reason == "No engine is running."


def test_selection_follows_the_engine_until_the_user_moves_it():
    model = serving_model()
    assert model.selection == PoolSizes(12, 120)
    model.select_slots(16)
    moved = model.selection
    later = copy.deepcopy(SERVING)
    later["uptime_s"] += 1
    model.apply_snapshot(later)  # the 1 Hz stream must not yank the slider back
    assert model.selection == moved and model.dirty


@given(st.integers(min_value=-5, max_value=40))
def test_every_slider_position_is_a_split_validate_rebuild_accepts(slots):
    model = serving_model()
    sizes = model.select_slots(slots)
    budget = model.budget
    state = sizes.state_slots if model.has_state_pool else None  # 0 = no such pool, not a size
    assert budget.validate(RebuildRequest(sizes.moe_slots, sizes.kv_pages, state), model.current,
                           idle=True) == sizes


def test_projection_states_slots_tokens_and_bytes():
    model = serving_model()
    model.select_slots(16)
    proj = model.projection()
    assert proj.moe_slots == 16
    assert proj.kv_tokens == proj.kv_pages * SERVING["pools"]["page_size"]
    assert proj.total_bytes <= model.budget.net_bytes


def test_presets_are_pool_budgets_presets():
    model = serving_model()
    assert [name for name, _ in model.presets] == ["minimum", "chat", "agent"]
    assert model.select_preset("minimum") == PoolSizes(8, 2)
    assert model.preset_matching() == "minimum"


def test_apply_names_only_the_pools_that_change():
    # Sending kv_tokens for a MoE-only change would drop the prefix cache for nothing.
    model = serving_model()
    budget = model.budget
    moe_only = PoolSizes(13, 120)
    assert budget.needed_bytes(moe_only) <= budget.net_bytes
    model.selection, model.user_moved = moe_only, True
    target = model.begin_apply()
    assert target.moe_slots == 13 and target.kv_tokens is None


def test_apply_sends_kv_as_tokens():
    model = serving_model()
    model.select_slots(16)
    target = model.begin_apply()
    assert target.kv_tokens == model.selection.kv_pages * SERVING["pools"]["page_size"]


def test_apply_refuses_when_nothing_changes_or_while_disabled():
    model = serving_model()
    with pytest.raises(ApplyRefused) as unchanged:
        model.begin_apply()
    assert unchanged.value.kind == "unchanged"
    model.select_slots(16)
    model.apply_snapshot(REBUILDING)
    with pytest.raises(ApplyRefused) as disabled:
        model.begin_apply()
    assert disabled.value.kind == "disabled"


def test_a_second_apply_is_refused_while_the_first_runs():
    model = serving_model()
    model.select_slots(16)
    model.begin_apply()
    with pytest.raises(ApplyRefused):
        model.begin_apply()


def test_finishing_apply_shows_the_outcome_and_the_new_sizes():
    model = serving_model()
    model.select_slots(16)
    model.begin_apply()
    outcome = rebuild_outcome(200, SNAPS[5]["last_rebuild"])
    model.finish_apply(outcome)
    assert not model.applying and model.outcome is outcome
    assert model.current == PoolSizes(16, 104) and model.selection == model.current


def test_a_resplit_made_by_another_client_is_shown_as_the_last_outcome():
    # Whatever the UI can do, curl can do: the dashboard must not miss a curl re-split.
    model = serving_model()
    model.apply_snapshot(SNAPS[5])  # carries last_rebuild: applied 12 → 16 slots
    assert model.outcome is not None and model.outcome.outcome == "applied"
    assert model.outcome.after.moe_slots == 16


def test_our_own_apply_keeps_the_engines_sentence_when_the_snapshot_echoes_it():
    model = serving_model()
    model.select_slots(16)
    model.begin_apply()
    body = dict(SNAPS[5]["last_rebuild"])
    mine = rebuild_outcome(200, body)
    mine = type(mine)(**{**mine.__dict__, "message": "applied, 4 slots moved"})
    model.finish_apply(mine)
    model.apply_snapshot(SNAPS[5])  # the same re-split, as the snapshot reports it
    assert model.outcome is mine


def test_a_timed_out_apply_is_pending_until_the_snapshot_reports_how_it_ended():
    """``rebuild_timed_out`` is neither success nor "nothing changed": the transaction still
    runs. The panel says so, then shows the outcome the engine records when it settles."""
    model = serving_model()
    model.select_slots(16)
    model.begin_apply()
    body = {"error": {"kind": "rebuild_timed_out", "message": "the re-split is still running after 60s",
                      "retry": "later", "outcome": None, "after": None,
                      "before": SNAPS[5]["last_rebuild"]["before"]}}
    pending = rebuild_outcome(503, body)
    model.finish_apply(pending)
    assert (pending.outcome, pending.severity, pending.after) == ("pending", "warning", None)
    assert pending.text().startswith("Still running (rebuild_timed_out) · the re-split is still running")
    model.apply_snapshot(SNAPS[5])  # the transaction settled: last_rebuild says applied
    assert model.outcome.outcome == "applied" and model.outcome.after.moe_slots == 16
