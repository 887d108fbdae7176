"""The Pools panel's third pool (issue 14): the recurrent-state field exists only for a hybrid.

Offscreen widgets fed a snapshot whose ``pools`` object is written by the engine's own writer
(``PoolBudget.to_wire``), then the real dashboard attached to a live engine serving a tiny
Qwen3.5-MoE: the field is shown, a new state size is applied through the engine, and the
engine's own account changes.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
from live import start_engine
from PySide6.QtCore import Qt
from replay_data import snapshots

from moetray.app.application import AppOptions, MoetrayApp
from moetray.app.settings import Settings
from moetray.policy.pool_budget import MIN_STATE_SLOTS, PoolBudget, PoolFloors, PoolSizes
from moetray.ui.dashboard_model import DashboardModel
from moetray.ui.pools_view import PoolsView
from moetray.ui.viewmodels import EngineState, rebuild_outcome

SNAPS = snapshots()
SERVING = SNAPS[1]  # a model without a state pool (its pools object has no state fields at all)
WAIT_MS = 60000


def hybrid_snapshot() -> dict:
    """SERVING with the pools of a hybrid model, as the engine writes them."""
    pools = SERVING["pools"]
    budget = PoolBudget(
        budget_bytes=pools["budget_bytes"],
        bytes_per_slot=pools["bytes_per_slot"],
        bytes_per_page=pools["bytes_per_page"],
        page_size=pools["page_size"],
        floors=PoolFloors(moe_slots=8, kv_pages=2, state_slots=MIN_STATE_SLOTS),
        max_moe_slots=16,
        fixed_bytes=pools["fixed_bytes"],
        bytes_per_state_slot=40960,
    )
    snap = copy.deepcopy(SERVING)
    snap["pools"] = budget.to_wire(
        PoolSizes(12, 100, 8), kv_pages_used=0, kv_pages_evictable=0, state_slots_used=0
    )
    return snap


@pytest.fixture
def panel(qtbot):
    model = DashboardModel()
    view = PoolsView(model.pools)
    qtbot.addWidget(view)
    view.show()
    qtbot.waitExposed(view)
    return model, view


def test_the_state_field_is_absent_for_a_model_without_the_pool(panel):
    model, view = panel
    model.apply_snapshot(SERVING, 1.0)
    assert view.slider.isEnabled()
    assert not model.pools.has_state_pool and not view.state_row.isVisible()
    assert "state" not in view.projection_label.text() and "state" not in view.current_label.text()
    assert "two pools" in view.limits_label.text()


def test_a_hybrid_model_shows_the_state_field_with_its_range_projection_and_bytes(panel):
    model, view = panel
    snap = hybrid_snapshot()
    model.apply_snapshot(snap, 1.0)
    limits = model.pools.limits
    assert view.state_row.isVisible() and view.state_field.isEnabled()
    assert (view.state_field.minimum(), view.state_field.maximum()) == (limits.state_min, limits.state_max)
    assert view.state_field.value() == 8
    assert "8 state slots" in view.projection_label.text()
    assert "State pool: <b>8 slots</b> · 320.0 KiB" in view.current_label.text()
    assert "the three pools" in view.limits_label.text()
    view.state_field.setValue(12)  # what typing into the field does
    selection = model.pools.selection
    assert selection.state_slots == 12 and model.pools.dirty
    assert "12 state slots" in view.projection_label.text() and "Selected" in view.projection_label.text()
    assert model.pools.budget.needed_bytes(selection) <= model.pools.budget.net_bytes
    view.slider.setValue(limits.moe_min)  # moving the slider keeps the chosen state pool
    assert model.pools.selection.state_slots == 12
    target = model.pools.begin_apply()
    assert target.state_slots == 12 and target.moe_slots == limits.moe_min
    model.pools.finish_apply(rebuild_outcome(None, None))
    model.apply_snapshot(SERVING, 2.0)  # the engine now serves a model without the pool
    assert not view.state_row.isVisible()


def test_presets_set_all_three_pools_in_the_panel(panel):
    model, view = panel
    model.apply_snapshot(hybrid_snapshot(), 1.0)
    presets = dict(model.pools.presets)
    assert presets["agent"].state_slots > presets["minimum"].state_slots == MIN_STATE_SLOTS
    for name, sizes in presets.items():
        view.preset_buttons[name].click()
        assert model.pools.selection == sizes
        assert view.state_field.value() == sizes.state_slots and view.slider.value() == sizes.moe_slots
        assert view.preset_buttons[name].isChecked()


def _pump_until(qapp, task, timeout_s=60.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not task.done() and time.monotonic() < deadline:
        qapp.processEvents()
    assert task.done(), f"the app task did not finish within {timeout_s:g}s"
    return task.result()


@pytest.fixture(scope="module")
def hybrid_dashboard_engine(tiny_moe, tmp_path_factory):
    model_dir = tiny_moe("qwen3_5_moe", "per_expert", num_layers=4)
    engine = start_engine(model_dir, tmp_path_factory.mktemp("hybrid-dash"), "--state-slots", "4")
    yield engine
    engine.close()


def test_apply_a_new_state_pool_from_the_live_dashboard(qapp, qloop, qtbot, hybrid_dashboard_engine,
                                                        tmp_path):
    engine = hybrid_dashboard_engine
    settings = Settings.at(tmp_path / "moetray.conf")
    app = MoetrayApp(qapp, settings, AppOptions(attach=engine.url, admin_token=engine.token, no_tray=True))
    app.initialize()
    _pump_until(qapp, asyncio.ensure_future(app.start()))
    try:
        qtbot.waitUntil(lambda: app.model.engine.state == EngineState.SERVING, timeout=WAIT_MS)
        window = app.window
        window.show_tab("Pools")
        view = window.pools
        qtbot.waitUntil(lambda: app.model.pools.enabled and view.state_field.isEnabled(), timeout=WAIT_MS)
        before = engine.status()["pools"]
        assert before["state_slots"] == 4 and view.state_row.isVisible()
        target = 6
        view.state_field.setValue(target)
        selection = app.model.pools.selection
        assert selection.state_slots == target and view.apply_button.isEnabled()
        qtbot.mouseClick(view.apply_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: app.model.pools.outcome is not None and not app.model.pools.applying,
                        timeout=WAIT_MS)
        outcome = app.model.pools.outcome
        assert outcome.outcome == "applied", outcome.text()
        assert outcome.before.state_slots == 4 and outcome.after.state_slots == target
        assert f"{target} state slots" in view.outcome_text
        after = engine.status()["pools"]
        assert (after["moe_slots"], after["kv_pages"], after["state_slots"]) == tuple(selection)
        qtbot.waitUntil(lambda: app.model.pools.current == selection, timeout=WAIT_MS)
        assert view.state_field.value() == target
    finally:
        _pump_until(qapp, asyncio.ensure_future(app.shutdown()))
        app.window.close()
