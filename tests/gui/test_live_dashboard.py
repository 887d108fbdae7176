"""The dashboard against a live engine on loopback (a tiny MoE, `moetray serve` as a child).

The app is attached to the engine exactly as ``moetray --attach URL`` does; the tests
click the real widgets and check the engine's own account over HTTP.
"""

from __future__ import annotations

import asyncio

import pytest
from bounded import wait_qt
from live import StreamingChat, run_async
from PySide6.QtCore import Qt

from moetray.app.application import AppOptions, MoetrayApp
from moetray.app.settings import SETTINGS_FILE, Settings
from moetray.ui.charts import empty_cell
from moetray.ui.viewmodels import EngineState

WAIT_MS = 30000
LONG_CHAT = 900
"""Tokens of a chat a test stops: with the engine's held steps (conftest.STEP_DELAY_MS) it cannot
end by itself within the waits before its Stop lands (it fits the tiny model's 1024 positions)."""


def _pump_until(qapp, task, what: str, timeout_s=60.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not task.done():
        if time.monotonic() >= deadline:
            task.cancel()
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        qapp.processEvents()
    return task.result()


@pytest.fixture(scope="module")
def app(qapp, qloop, dashboard_engine, tmp_path_factory):
    settings = Settings.at(tmp_path_factory.mktemp("dash-settings") / SETTINGS_FILE)
    app = MoetrayApp(qapp, settings, AppOptions(attach=dashboard_engine.url,
                                                admin_token=dashboard_engine.token, no_tray=True))
    app.initialize()
    _pump_until(qapp, asyncio.ensure_future(app.start()), "the attached app to start")
    yield app
    _pump_until(qapp, asyncio.ensure_future(app.shutdown()), "the app to shut down")
    app.window.close()


@pytest.fixture
def window(app, qtbot):
    wait_qt(qtbot, lambda: app.model.engine.state == EngineState.SERVING, WAIT_MS, "the app to see serving")
    return app.window


@pytest.fixture
def idle(dashboard_engine, app, qtbot):
    """Each test starts and ends with no request running on the shared engine."""
    wait_qt(qtbot, lambda: not dashboard_engine.request_ids(), WAIT_MS, "an idle engine before the test")
    yield
    for rid in dashboard_engine.request_ids():
        run_async(qtbot, app.cancel_request(rid))
    wait_qt(qtbot, lambda: not dashboard_engine.request_ids(), WAIT_MS, "an idle engine after the test")


def test_the_window_opens_attached_with_the_engines_model(window, dashboard_engine):
    # Without a system tray (offscreen), the dashboard is the app and opens at start.
    assert window.isVisible()
    assert window.header.title.text() == dashboard_engine.status()["model"]["label"]
    assert "(attached)" in window.header.subtitle.text()


def test_heatmap_reflects_the_engines_residency_map(app, window, dashboard_engine, idle, qtbot):
    chat = StreamingChat(dashboard_engine, max_tokens=6, content="route some tokens")
    chat.start()
    chat.wait_ended(qtbot, WAIT_MS)
    assert chat.error is None and chat.chunks > 0, (chat.error, dashboard_engine.log()[-2000:])
    wait_qt(qtbot, lambda: not dashboard_engine.request_ids(), WAIT_MS, "the engine to be idle")
    residency = dashboard_engine.status()["experts"]["residency"]  # stable while idle
    expected = tuple(tuple(row) for row in residency)
    window.show_tab("Experts")
    wait_qt(qtbot, lambda: app.model.experts.residency == expected, WAIT_MS,
            "the heatmap to show the engine's map")
    rgba = window.experts.heatmap.rgba
    assert rgba.shape[:2] == (len(residency), len(residency[0]))
    resident = [(li, e) for li, row in enumerate(residency) for e, slot in enumerate(row) if slot is not None]
    empty = [(li, e) for li, row in enumerate(residency) for e, slot in enumerate(row) if slot is None]
    assert resident and empty, "a partly resident map is needed for this test to mean anything"
    assert all(tuple(rgba[li, e]) == empty_cell() for li, e in empty)
    assert all(tuple(rgba[li, e]) != empty_cell() for li, e in resident)
    stat = window.experts.stats.stat("Resident experts").value_text
    assert stat == f"{len(resident)} / {len(resident) + len(empty)}"


def test_stop_on_a_row_cancels_that_request(app, window, dashboard_engine, idle, qtbot):
    chat = StreamingChat(dashboard_engine, max_tokens=LONG_CHAT)
    chat.start()
    window.show_tab("Requests")
    wait_qt(qtbot, lambda: len(window.requests.row_ids()) == 1, WAIT_MS, "the request's row")
    rid = window.requests.row_ids()[0]
    read_at_click = chat.chunks
    qtbot.mouseClick(window.requests.stop_buttons[rid], Qt.MouseButton.LeftButton)
    # The row goes once the engine stops listing it (the cancel's reply, not a later event).
    wait_qt(qtbot, lambda: rid not in window.requests.row_ids(), WAIT_MS, "the stopped request's row to go")
    assert rid not in dashboard_engine.request_ids()
    chat.wait_ended(qtbot, 3 * WAIT_MS, "the stopped chat to end")  # a loaded machine
    assert (chat.finish_reason, chat.stop_reason) == ("stop", "cancelled"), (
        f"{chat.chunks} chunks read ({read_at_click} when Stop was clicked), "
        f"finish_reason {chat.finish_reason!r}; app log: {app.model.logs.lines[-5:]!r}")


def test_stop_all_cancels_every_request(app, window, dashboard_engine, idle, qtbot):
    chats = [StreamingChat(dashboard_engine, max_tokens=LONG_CHAT, content=f"story {i}") for i in range(2)]
    for chat in chats:
        chat.start()
    window.show_tab("Requests")
    wait_qt(qtbot, lambda: len(window.requests.row_ids()) == 2, WAIT_MS, "both requests' rows")
    qtbot.mouseClick(window.requests.stop_all_button, Qt.MouseButton.LeftButton)
    wait_qt(qtbot, lambda: window.requests.row_ids() == [], WAIT_MS, "every row to go")
    assert dashboard_engine.request_ids() == []
    for chat in chats:
        chat.wait_ended(qtbot, 3 * WAIT_MS, "a stopped chat to end")
        assert chat.chunks < LONG_CHAT


def _other_end(pools) -> int:
    limits = pools["limits"]["moe_slots"]
    return limits["min"] if pools["moe_slots"] != limits["min"] else limits["max"]


def test_apply_changes_the_engines_pool_sizes_and_shows_the_outcome(app, window, dashboard_engine,
                                                                    idle, qtbot):
    window.show_tab("Pools")
    view = window.pools
    wait_qt(qtbot, lambda: app.model.pools.enabled and view.slider.isEnabled(), WAIT_MS, "the pools slider")
    before = dashboard_engine.status()["pools"]
    target = _other_end(before)
    view.slider.setValue(target)  # what dragging the handle does
    selection = app.model.pools.selection
    assert selection.moe_slots == target and view.apply_button.isEnabled()
    qtbot.mouseClick(view.apply_button, Qt.MouseButton.LeftButton)
    wait_qt(qtbot, lambda: app.model.pools.outcome is not None and not app.model.pools.applying,
            WAIT_MS, "the re-split's outcome")
    outcome = app.model.pools.outcome
    assert outcome.outcome == "applied", outcome.text()
    assert view.outcome_text.startswith("Applied") and f"→ {target} expert slots" in view.outcome_text
    after = dashboard_engine.status()["pools"]
    assert (after["moe_slots"], after["kv_pages"]) == (selection.moe_slots, selection.kv_pages)
    assert outcome.before.moe_slots == before["moe_slots"]


def _apply_while_busy(app, window, dashboard_engine, qtbot):
    """A long chat runs; Apply is clicked; returns once the panel says what the re-split waits for."""
    window.show_tab("Pools")
    view = window.pools
    wait_qt(qtbot, lambda: app.model.pools.enabled, WAIT_MS, "the pools view")
    before = dashboard_engine.status()["pools"]
    chat = StreamingChat(dashboard_engine, max_tokens=LONG_CHAT)
    chat.start()
    wait_qt(qtbot, lambda: len(dashboard_engine.request_ids()) == 1, WAIT_MS, "the chat to be admitted")
    view.slider.setValue(_other_end(before))
    qtbot.mouseClick(view.apply_button, Qt.MouseButton.LeftButton)
    wait_qt(qtbot, view.stop_running_button.isVisible, WAIT_MS, "the panel to offer Stop them and apply")
    assert view.outcome_text.startswith("Waiting for 1 running request… (")
    assert view.outcome_text.endswith(" of 60 s)")
    assert view.cancel_button.isVisible()
    return view, before, chat


def test_stop_them_and_apply_stops_the_running_request_and_applies(app, window, dashboard_engine, idle,
                                                                   qtbot):
    view, before, chat = _apply_while_busy(app, window, dashboard_engine, qtbot)
    qtbot.mouseClick(view.stop_running_button, Qt.MouseButton.LeftButton)
    wait_qt(qtbot, lambda: not app.model.pools.applying, WAIT_MS, "the re-split's outcome")
    outcome = app.model.pools.outcome
    assert outcome.outcome == "applied", outcome.text()
    assert view.outcome_text.startswith("Applied: ") and "waiting" in view.outcome_text
    assert outcome.waited_ms is not None and outcome.applied_ms is not None
    chat.wait_ended(qtbot, WAIT_MS)
    assert (chat.finish_reason, chat.stop_reason) == ("stop", "cancelled") and chat.chunks < LONG_CHAT
    after = dashboard_engine.status()["pools"]
    assert (after["moe_slots"], after["kv_pages"]) != (before["moe_slots"], before["kv_pages"])
    assert not view.stop_running_button.isVisible()


def test_cancel_a_waiting_apply_changes_nothing_and_the_request_goes_on(app, window, dashboard_engine,
                                                                        idle, qtbot):
    view, before, chat = _apply_while_busy(app, window, dashboard_engine, qtbot)
    qtbot.mouseClick(view.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not app.model.pools.applying, timeout=WAIT_MS)
    outcome = app.model.pools.outcome
    assert (outcome.outcome, outcome.kind) == ("rejected_intact", "rebuild_cancelled")
    assert view.outcome_text == outcome.message and "nothing changed" in view.outcome_text
    after = dashboard_engine.status()["pools"]
    assert (after["moe_slots"], after["kv_pages"]) == (before["moe_slots"], before["kv_pages"])
    assert dashboard_engine.request_ids()  # still generating: Cancel stopped the re-split, not it
    assert chat.error is None


def test_the_history_table_shows_the_engines_finished_requests(app, window, dashboard_engine, idle, qtbot):
    chat = StreamingChat(dashboard_engine, max_tokens=5, content="for the history")
    chat.start()
    chat.wait_ended(qtbot, WAIT_MS)
    feed = dashboard_engine.get("request_history")["requests"]
    window.show_tab("Requests")
    table = window.requests.history_table
    qtbot.waitUntil(lambda: table.rowCount() == len(feed) and table.rowCount() > 0, timeout=WAIT_MS)
    newest = feed[0]
    assert table.item(0, 0).toolTip() == newest["id"]
    assert table.item(0, 3).text() == str(newest["completion_tokens"])
    assert table.item(0, 6).text() == newest["finish_reason"]
