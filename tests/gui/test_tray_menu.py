"""The tray menu as data: rebuilt from a snapshot, its items and their enabled states.

Offscreen Qt has no system tray, so the menu is checked as a ``QMenu`` without being shown
(the real-X test shows it); the icon is checked per state and theme.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from moetray.app.catalog import CatalogRow
from moetray.app.settings import DEMO_MODEL
from moetray.app.tray import (
    COPY_API_URL,
    DEMO_LABEL,
    NO_API,
    OPEN_DASHBOARD,
    OPEN_FOLDER,
    QUIT,
    SETTINGS,
    TrayController,
    TraySnapshot,
    menu_texts,
    populate_tray_menu,
    status_line,
)
from moetray.ui.icons import state_icon
from moetray.ui.theme import themes
from moetray.ui.viewmodels import EngineState


class Recorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def open_dashboard(self):
        self.calls.append(("open_dashboard",))

    def toggle_serving(self):
        self.calls.append(("toggle_serving",))

    def choose_model(self, folder):
        self.calls.append(("choose_model", folder))

    def open_model_folder(self):
        self.calls.append(("open_model_folder",))

    def copy_api_url(self):
        self.calls.append(("copy_api_url",))

    def open_settings(self):
        self.calls.append(("open_settings",))

    def quit(self):
        self.calls.append(("quit",))


SERVING = TraySnapshot(state=EngineState.SERVING, detail=None, model_label="Tiny MoE", tok_s=41.5,
                       api_url="http://127.0.0.1:8080/v1", attached=False, current_model="/m/tiny",
                       recent=("/m/tiny", "/m/other"))


def build(snap: TraySnapshot, qtbot):
    from PySide6.QtWidgets import QMenu

    menu = QMenu()
    actions = Recorder()
    populate_tray_menu(menu, snap, actions)
    return menu, actions


def action(menu, text):
    return next(a for a in menu.actions() if a.text() == text)


def test_menu_has_every_item_in_order(qtbot):
    menu, _ = build(SERVING, qtbot)
    assert menu_texts(menu) == [
        "Tiny MoE — serving — 41.5 tok/s", OPEN_DASHBOARD, "Stop serving", "Model",
        [DEMO_LABEL, "tiny", "other", OPEN_FOLDER], "API: http://127.0.0.1:8080/v1", COPY_API_URL,
        SETTINGS, QUIT]
    assert not menu.actions()[0].isEnabled()  # the status line is information, not an action
    assert not action(menu, "API: http://127.0.0.1:8080/v1").isEnabled()
    action(menu, SETTINGS).trigger()


@pytest.mark.parametrize(("state", "label", "enabled"), [
    (EngineState.STOPPED, "Start serving", True),
    (EngineState.FAILED, "Restart engine", True),
    (EngineState.LOADING, "Stop serving", True),
    (EngineState.STOPPING, "Stopping…", False),
])
def test_start_stop_follows_the_state(qtbot, state, label, enabled):
    menu, actions = build(replace(SERVING, state=state), qtbot)
    item = action(menu, label)
    assert item.isEnabled() is enabled
    item.trigger()
    assert actions.calls == ([("toggle_serving",)] if enabled else [])


def test_an_attached_engine_is_neither_started_nor_stopped_nor_switched(qtbot):
    menu, _ = build(replace(SERVING, attached=True), qtbot)
    assert not action(menu, "Stop serving").isEnabled()
    models = action(menu, "Model").menu()
    assert not any(a.isEnabled() for a in models.actions() if not a.isSeparator())


def test_the_current_model_is_checked_and_choosing_one_calls_the_app(qtbot):
    menu, actions = build(SERVING, qtbot)
    models = action(menu, "Model").menu()
    checked = [a.text() for a in models.actions() if a.isChecked()]
    assert checked == ["tiny"]
    action(models, "other").trigger()
    action(models, DEMO_LABEL).trigger()
    action(models, OPEN_FOLDER).trigger()
    assert actions.calls == [("choose_model", "/m/other"), ("choose_model", DEMO_MODEL),
                             ("open_model_folder",)]


def test_copy_api_url_needs_a_url(qtbot):
    menu, _ = build(replace(SERVING, api_url=None, state=EngineState.STOPPED), qtbot)
    assert not action(menu, COPY_API_URL).isEnabled()
    assert NO_API in menu_texts(menu)


ROWS = (
    CatalogRow("hf:acme/dense-7b", "huggingface", "/hub/dense", "safetensors", "llama", False, 14 * 2**30,
               False, "not_moe"),
    CatalogRow("demo", "demo", "/data/demo", "safetensors", "qwen2_moe", True, 2**28, True, None),
    CatalogRow("ollama:qwen3:30b-a3b", "ollama", "/ollama/blobs/sha256-1", "gguf", "qwen3moe", True,
               18 * 2**30, True, None),
)


def test_local_models_are_listed_servable_first_and_refused_ones_greyed_with_the_reason(qtbot):
    from moetray.app.catalog import parse_rows

    rows = parse_rows(__import__("json").dumps([r.__dict__ for r in ROWS]))
    assert [r.name for r in rows] == ["demo", "ollama:qwen3:30b-a3b", "hf:acme/dense-7b"]
    menu, actions = build(replace(SERVING, catalog=rows, recent=("/m/tiny",)), qtbot)
    models = action(menu, "Model").menu()
    texts = [a.text() for a in models.actions() if not a.isSeparator()]
    assert texts == [DEMO_LABEL, "ollama:qwen3:30b-a3b (18.00 GiB)",
                     "hf:acme/dense-7b (14.00 GiB) — not a mixture-of-experts model", "tiny", OPEN_FOLDER]
    refused = action(models, texts[2])
    assert not refused.isEnabled() and "not a mixture-of-experts model" in refused.toolTip()
    action(models, texts[1]).trigger()  # a GGUF blob is served by its name, read in place
    assert actions.calls == [("choose_model", "ollama:qwen3:30b-a3b")]


def test_a_listing_failure_is_said_in_the_menu(qtbot):
    menu, _ = build(replace(SERVING, catalog_note="could not list the local models: exit code 2"), qtbot)
    models = action(menu, "Model").menu()
    note = action(models, "Local models: not listed")
    assert not note.isEnabled() and "exit code 2" in note.toolTip()


def test_crashes_and_a_moved_port_are_said_under_the_status(qtbot):
    snap = replace(SERVING, crashes=2, last_crash="The engine exited with code -9.",
                   port_note="Port 8765 is taken: serving on 8766")
    menu, _ = build(snap, qtbot)
    texts = menu_texts(menu)
    assert texts[1:3] == ["Crashes in the last 10 min: 2 — last: The engine exited with code -9.",
                          "Port 8765 is taken: serving on 8766"]


def test_status_line_names_the_model_and_says_unknown_speed_as_a_dash():
    assert status_line(replace(SERVING, tok_s=None)) == "Tiny MoE — serving — —"
    assert status_line(replace(SERVING, state=EngineState.STOPPED, model_label=None,
                               current_model=DEMO_MODEL)) == "demo model — stopped"


def test_failure_detail_is_a_disabled_line_under_the_status(qtbot):
    menu, _ = build(replace(SERVING, state=EngineState.FAILED, detail="The engine exited with code -9."),
                    qtbot)
    assert menu.actions()[1].text() == "The engine exited with code -9." and not menu.actions()[1].isEnabled()


def test_menu_is_rebuilt_from_a_fresh_snapshot_each_time_it_opens(qtbot):
    snaps = [SERVING]
    tray = TrayController(Recorder(), lambda: snaps[-1])
    snaps.append(replace(SERVING, state=EngineState.STOPPED))
    tray.menu.aboutToShow.emit()
    assert action(tray.menu, "Start serving").isEnabled()


def test_tray_icon_follows_the_state_in_the_themes_variant(qtbot):
    tray = TrayController(Recorder(), lambda: SERVING)
    try:
        for theme in ("dark", "light"):
            themes().apply(theme)
            assert tray.variant == theme
            for state in EngineState:
                tray.set_state(state, f"moetray — {state.value}")
                assert tray.icon.icon().cacheKey() == state_icon(state, theme).cacheKey()
                assert tray.icon.toolTip() == f"moetray — {state.value}"
    finally:
        themes().apply("light")
    assert not state_icon(EngineState.SERVING, "dark").isNull()
    with pytest.raises(ValueError):
        state_icon(EngineState.SERVING, "sepia")
