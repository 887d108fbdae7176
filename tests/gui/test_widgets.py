"""Widget rules, offscreen, fed by replayed snapshots: unknown is drawn as a gap or "—",
hidden panels skip redraws and catch up when shown, the Pools panel states why it is off.
"""

from __future__ import annotations

import math

import pytest
from replay_data import snapshots

from moetray.ui.charts import ResidencyHeatmap, RollingChart, empty_cell
from moetray.ui.dashboard import DashboardWindow, Header
from moetray.ui.dashboard_model import DashboardModel
from moetray.ui.format import DASH
from moetray.ui.memory_view import MemoryView
from moetray.ui.outcome import rebuild_outcome
from moetray.ui.pools_view import PoolsView
from moetray.ui.viewmodels import EngineModel, EngineState, MemoryModel

SNAPS = snapshots()


def test_an_unknown_value_is_a_gap_in_the_chart_not_a_zero(qtbot):
    chart = RollingChart("t", "u", ["a"])
    qtbot.addWidget(chart)
    chart.set_series([0.0, 1.0, 2.0], [[5.0, None, 7.0]])
    x, y = chart.curve_data(0)
    assert list(x) == [-2.0, -1.0, 0.0] and y[0] == 5.0 and math.isnan(y[1]) and y[2] == 7.0


def test_a_series_that_starts_later_is_padded_with_gaps(qtbot):
    chart = RollingChart("t", "u", ["total"])
    chart.set_faint_count(1)
    qtbot.addWidget(chart)
    chart.set_series([0.0, 1.0, 2.0], [[0.5, 0.6, 0.7], [0.9]])
    _, layer = chart.curve_data(1)
    assert math.isnan(layer[0]) and math.isnan(layer[1]) and layer[2] == 0.9


def test_non_resident_cells_are_the_empty_colour(qtbot):
    heat = ResidencyHeatmap()
    qtbot.addWidget(heat)
    heat.set_cells([[None, 1.0], [0.05, None]])
    assert tuple(heat.rgba[0, 0]) == empty_cell() == tuple(heat.rgba[1, 1])
    assert tuple(heat.rgba[0, 1]) != empty_cell() and tuple(heat.rgba[1, 0]) != empty_cell()
    assert tuple(heat.rgba[0, 1]) != tuple(heat.rgba[1, 0])  # recency changes the shade


def test_a_hidden_panel_skips_redraws_and_catches_up_when_shown(qtbot):
    model = MemoryModel()
    view = MemoryView(model)
    qtbot.addWidget(view)
    view.hide()
    model.apply_snapshot(SNAPS[1], 1.0)
    assert view.device_stats.stat("Total").value_text == DASH  # not redrawn while hidden
    view.show()
    qtbot.waitExposed(view)
    assert view.device_stats.stat("Total").value_text == "24.00 GiB"
    assert view.device_stats.stat("Engine").value_text == DASH  # the CPU tier has no engine bytes
    assert view.process_stats.stat("Engine process").value_text == "420.0 MiB (PSS)"


def test_header_shows_load_progress_and_an_indeterminate_bar_without_a_total(qtbot):
    engine = EngineModel()
    header = Header(engine)
    qtbot.addWidget(header)
    header.show()
    engine.set_state(EngineState.LOADING)
    engine.apply_snapshot(SNAPS[0])
    assert header.progress.isVisible() and header.progress.maximum() == 1000
    assert header.progress.format() == "loading weights: 1 / 3"
    engine.apply_health({"state": "loading", "load_progress": {"stage": "reading config", "done": 0,
                                                               "total": None}})
    assert header.progress.maximum() == 0  # indeterminate
    engine.set_state(EngineState.SERVING)
    assert not header.progress.isVisible()


def test_pools_panel_says_why_it_is_disabled(qtbot):
    model = DashboardModel()
    view = PoolsView(model.pools)
    qtbot.addWidget(view)
    view.show()
    model.apply_snapshot(SNAPS[4], 1.0)  # rebuilding
    assert not view.slider.isEnabled() and not view.apply_button.isEnabled()
    assert view.reason_label.isVisible() and "being re-split" in view.reason_label.text()
    model.apply_snapshot(SNAPS[1], 2.0)
    assert view.slider.isEnabled() and not view.reason_label.isVisible()


@pytest.mark.parametrize(("status", "body", "restart_visible"), [
    (200, SNAPS[5]["last_rebuild"], False),
    (500, {"error": {"message": "restore failed", "kind": "rebuild_latched"}}, True),
])
def test_outcome_is_shown_verbatim_and_latched_offers_restart(qtbot, status, body, restart_visible):
    model = DashboardModel()
    view = PoolsView(model.pools)
    qtbot.addWidget(view)
    view.show()
    model.apply_snapshot(SNAPS[1], 1.0)
    model.pools.select_slots(16)
    model.pools.begin_apply()
    assert view.apply_button.text() == "Applying…" and not view.apply_button.isEnabled()
    outcome = rebuild_outcome(status, body)
    model.pools.finish_apply(outcome)
    assert view.outcome_text == outcome.text()
    assert view.restart_button.isVisible() is restart_visible


def test_dashboard_has_every_panel(qtbot):
    window = DashboardWindow(DashboardModel())
    qtbot.addWidget(window)
    names = [window.tabs.tabText(i) for i in range(window.tabs.count())]
    assert names == ["Memory", "Experts", "Throughput", "Pools", "Requests", "Logs", "Settings"]
