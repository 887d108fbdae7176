"""The dashboard explains itself, offscreen and fed by replayed snapshots: it stays narrow with a
long title, every control has a tooltip and is reached with Tab, empty charts say so, the
heatmap has a scale with units, one theme colours widgets and charts, the Pools panel says
what a waiting re-split waits for, and the Settings dialog says what needs an engine restart.
"""

from __future__ import annotations

import copy

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QAbstractButton, QAbstractSlider, QAbstractSpinBox, QApplication, QComboBox
from replay_data import snapshots

from moetray.ui.charts import NO_DATA, RECENCY_TICKS, LayerBars, ResidencyHeatmap, RollingChart, warmth
from moetray.ui.dashboard import MAX_MIN_WIDTH, TABS, DashboardWindow
from moetray.ui.dashboard_model import DashboardModel
from moetray.ui.pools_view import CANCEL, STOP_AND_APPLY, PoolsView
from moetray.ui.settings_dialog import SettingsDialog, SettingsValues
from moetray.ui.theme import DARK, LIGHT, themes

SNAPS = snapshots()
LONG_TITLE = "SmolLM2-135M MoEfied demo: a converted dense model, not a trained MoE, " * 4


@pytest.fixture
def window(qtbot):
    model = DashboardModel()
    window = DashboardWindow(model)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    for t, snap in enumerate(SNAPS[:4]):
        model.apply_snapshot(snap, float(t))
    return window


@pytest.fixture
def light_theme():
    yield
    themes().apply("light")


def test_a_long_title_is_elided_and_the_window_stays_narrow_and_its_size(window, qtbot):
    width = window.width()
    window.model.engine.model_label = LONG_TITLE
    window.model.engine.changed.emit()
    for name in TABS:  # the narrowest the window may be, on every tab
        window.show_tab(name)
        QApplication.processEvents()
        assert window.minimumSizeHint().width() <= MAX_MIN_WIDTH, name
    assert window.width() == width  # it does not resize itself
    title = window.header.title
    assert title.toolTip() == LONG_TITLE and title.shown_text.endswith("…")
    assert len(title.shown_text) < len(LONG_TITLE)


def test_every_control_has_a_tooltip(window):
    controls = [w for kind in (QAbstractButton, QAbstractSlider, QAbstractSpinBox, QComboBox)
                for w in window.findChildren(kind)]
    controls = [w for w in controls if w.parent() is not None and w.objectName() != "qt_tabwidget_tabbar"
                and type(w).__name__ not in ("QTabBar", "QScrollBar", "QToolButton") or
                w is window.header.model_button]
    assert controls
    missing = [f"{type(w).__name__} {getattr(w, 'text', lambda: '')()!r}" for w in controls
               if not w.toolTip() and w.isVisibleTo(window)]
    assert missing == []
    assert all(window.tabs.tabToolTip(i) for i in range(window.tabs.count()))


def test_presets_and_apply_are_reached_with_tab(window, qtbot):
    window.show_tab("Pools")
    pools = window.pools
    assert pools.slider.isEnabled()
    pools.slider.setFocus()
    qtbot.waitUntil(pools.slider.hasFocus, timeout=2000)
    reached = []
    for _ in range(40):
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        reached.append(QApplication.focusWidget())
    for button in pools.preset_buttons.values():
        assert button in reached, button.text()
    pools.preset_buttons["minimum"].setFocus()
    qtbot.keyClick(pools.preset_buttons["minimum"], Qt.Key.Key_Space)  # keyboard all the way
    assert window.model.pools.preset_matching() == "minimum"
    assert pools.change_label.isVisible() and "Context shrinks" in pools.change_label.text()


def test_every_enabled_control_on_every_tab_is_reached_with_tab(window, qtbot):
    """Walks the real focus chain with Tab presses from the tab bar, on each tab in turn (the
    live table's per-row Stop buttons included), and switches tabs from the keyboard."""
    bar = window.tabs.tabBar()
    for index, name in enumerate(TABS):
        window.show_tab(name)
        QApplication.processEvents()
        controls = {w for kind in (QAbstractButton, QAbstractSlider, QAbstractSpinBox, QComboBox)
                    for w in window.findChildren(kind)
                    if w.isVisibleTo(window) and w.isEnabled() and type(w).__name__ not in ("QScrollBar",)
                    and w.parent() is not bar}
        assert controls, name
        bar.setFocus()
        qtbot.waitUntil(bar.hasFocus, timeout=2000)
        reached = set()
        for _ in range(3 * len(controls) + 20):
            qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
            reached.add(QApplication.focusWidget())
        missing = sorted(f"{type(w).__name__} {getattr(w, 'text', str)()!r}" for w in controls - reached)
        assert missing == [], name
        assert bar in reached, "the tab bar is in the focus chain"
        if name == "Requests":
            assert window.requests.stop_buttons and set(window.requests.stop_buttons.values()) <= reached
        if index + 1 < len(TABS):
            bar.setFocus()
            qtbot.keyClick(bar, Qt.Key.Key_Right)
            assert window.tabs.currentIndex() == index + 1, "arrow keys move between tabs"


def test_preset_buttons_preview_their_change_in_the_tooltip(window):
    window.show_tab("Pools")
    tip = window.pools.preset_buttons["minimum"].toolTip()
    assert "Context: 1\u2009920 → 32 KV tokens" in tip and "changes nothing until Apply" in tip


def test_empty_charts_say_no_data_yet(qtbot):
    chart, bars, heat = RollingChart("t", "u", ["a"]), LayerBars("b"), ResidencyHeatmap()
    for w in (chart, bars, heat):
        qtbot.addWidget(w)
    assert chart._empty.isVisible() and chart._empty.textItem.toPlainText() == NO_DATA
    assert bars._empty.isVisible() and heat._empty.isVisible()
    chart.set_series([0.0, 1.0], [[None, None]])  # only unknowns: still no data
    assert not chart.has_data
    chart.set_series([0.0, 1.0], [[None, 3.0]])
    assert chart.has_data and not chart._empty.isVisible()
    heat.set_cells([[None, 1.0]])
    assert not heat._empty.isVisible()


def test_heatmap_has_a_colour_scale_in_steps_since_last_use(qtbot):
    heat = ResidencyHeatmap()
    qtbot.addWidget(heat)
    assert heat.scale.axis.labelText == "steps since last use"
    ticks = heat.scale.axis._tickLevels[0]
    assert [text for _, text in ticks] == [text for _, text in RECENCY_TICKS]
    assert [value for value, _ in ticks] == [warmth(age) for age, _ in RECENCY_TICKS]


def test_a_line_is_not_joined_across_a_pause_in_samples(qtbot):
    chart = RollingChart("t", "u", ["a"])
    qtbot.addWidget(chart)
    chart.set_series([0.0, 1.0, 2.0, 30.0, 31.0], [[1.0, 2.0, 3.0, 4.0, 5.0]])
    x, y = chart.curve_data(0)
    gap = [i for i, v in enumerate(y) if v != v]
    assert len(gap) == 1 and x[gap[0] - 1] == -29.0 and x[gap[0] + 1] == -1.0


def test_one_theme_colours_widgets_charts_and_heatmap(window, light_theme):
    chart = window.memory.chart
    themes().apply("dark")
    assert QApplication.palette().color(QPalette.ColorRole.Window).lightness() < 128
    assert chart.backgroundBrush().color().name() == DARK.background
    assert window.experts.heatmap.backgroundBrush().color().name() == DARK.background
    themes().apply("light")
    assert QApplication.palette().color(QPalette.ColorRole.Window).lightness() >= 128
    assert chart.backgroundBrush().color().name() == LIGHT.background


def test_the_system_theme_follows_the_desktops_palette(qapp, light_theme):
    """With no colour-scheme hint from the platform (offscreen gives none), ``system`` follows
    the palette the desktop started the application with."""
    from moetray.ui.theme import ThemeManager, dark_palette

    start = QPalette(qapp.palette())
    try:
        qapp.setPalette(dark_palette())
        assert ThemeManager(qapp).apply("system") is DARK
        qapp.setPalette(QPalette(QColor("#eeeeee")))  # a light desktop
        assert ThemeManager(qapp).apply("system") is LIGHT
    finally:
        qapp.setPalette(start)


def test_the_pools_panel_offers_stop_them_and_apply_and_cancel_while_waiting(qtbot):
    model = DashboardModel()
    view = PoolsView(model.pools)
    qtbot.addWidget(view)
    view.show()
    snap = copy.deepcopy(SNAPS[4])
    snap["rebuild_progress"] = {"stage": "waiting", "running": 2, "waited_s": 12.0, "timeout_s": 30.0,
                                "held": 0}
    model.apply_snapshot(snap, 1.0)
    assert view.outcome_text == "Waiting for 2 running requests… (12 s of 30 s)"
    assert view.stop_running_button.text() == STOP_AND_APPLY and view.stop_running_button.isVisible()
    assert view.cancel_button.text() == CANCEL and view.cancel_button.isVisible()
    with qtbot.waitSignal(view.stop_running_clicked, timeout=1000):
        view.stop_running_button.click()
    with qtbot.waitSignal(view.cancel_clicked, timeout=1000):
        view.cancel_button.click()
    model.apply_snapshot(SNAPS[5], 2.0)
    assert not view.stop_running_button.isVisible() and not view.cancel_button.isVisible()


VALUES = SettingsValues(model="", host="127.0.0.1", port=8765, kv_tokens=None, threads=None,
                        autostart=False, serve_on_start=True, theme="system")


def test_settings_dialog_says_which_changes_need_an_engine_restart_and_offers_it(qtbot):
    dialog = SettingsDialog(VALUES, models=[("", "Demo")], engine_running=True, api_key_path="/c/api-key")
    qtbot.addWidget(dialog)
    dialog.show()
    assert not dialog.restart_note.isVisible() and not dialog.restart_box.isVisible()
    dialog.theme.setCurrentIndex(dialog.theme.findData("dark"))  # no restart needed
    assert not dialog.restart_note.isVisible() and not dialog.restart_now
    dialog.port.setValue(9000)
    dialog.kv_tokens.setValue(4096)
    assert dialog.engine_changes() == ["port", "context"]
    assert dialog.restart_note.isVisible()
    assert "port, context needs an engine restart" in dialog.restart_note.text()
    assert dialog.restart_box.isVisible() and dialog.restart_now
    assert not dialog.api_key_note.isVisible()
    dialog.host.setCurrentIndex(dialog.host.findData("0.0.0.0"))
    assert dialog.api_key_note.isVisible() and "/c/api-key" in dialog.api_key_note.text()
    values = dialog.values()
    assert (values.port, values.kv_tokens, values.theme, values.host) == (9000, 4096, "dark", "0.0.0.0")


def test_settings_dialog_with_no_engine_says_when_changes_apply(qtbot):
    dialog = SettingsDialog(VALUES, models=[("", "Demo")], engine_running=False, api_key_path="/k")
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.threads.setValue(2)
    assert "take effect when the engine starts" in dialog.restart_note.text()
    assert not dialog.restart_box.isVisible() and not dialog.restart_now
