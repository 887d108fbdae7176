"""Pools panel: the live re-split slider between expert slots and KV tokens.

A hybrid model's third pool, recurrent-state slots, gets a field beside the slider (its
range, projection and GiB drawn like the others); the field exists only when the model has
the pool (``PoolsModel.has_state_pool``).

The view only draws :class:`~moetray.ui.pools_model.PoolsModel` and forwards intents:
moving the slider or a preset selects sizes in the model; Apply and Restart are emitted
(``apply_clicked``, ``restart_clicked``) for the app, which calls the engine and hands the
outcome back to the model.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from moetray.ui.charts import SegmentBar
from moetray.ui.format import DASH, fmt_bytes, fmt_int
from moetray.ui.pools_model import PRESET_LABELS, PoolsModel

MOE_COLOR, KV_COLOR, STATE_COLOR = "#3daee9", "#27ae60", "#8e44ad"
RESPLIT_TITLE = "Re-split device memory between the expert cache and the KV cache"
RESPLIT_TITLE_HYBRID = "Re-split device memory between the expert cache, the KV cache and the state pool"
SEVERITY_STYLE = {
    "ok": "color: #1e8449;",
    "warning": "color: #b9770e;",
    "error": "color: white; background: #c0392b; padding: 6px; border-radius: 4px; font-weight: 600;",
}


class PoolsView(QWidget):
    apply_clicked = Signal()
    restart_clicked = Signal()

    def __init__(self, model: PoolsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        layout = QVBoxLayout(self)

        current = QGroupBox("Current pools")
        clayout = QVBoxLayout(current)
        self.current_label = QLabel(DASH)
        self.current_label.setWordWrap(True)
        self.usage_label = QLabel(DASH)
        clayout.addWidget(self.current_label)
        clayout.addWidget(self.usage_label)
        layout.addWidget(current)

        resplit = QGroupBox(RESPLIT_TITLE)
        self.resplit_box = resplit
        rlayout = QVBoxLayout(resplit)
        presets = QHBoxLayout()
        presets.addWidget(QLabel("Presets:"))
        self.preset_group = QButtonGroup(self)
        self.preset_group.setExclusive(False)
        self.preset_buttons: dict[str, QPushButton] = {}
        for name, label in PRESET_LABELS.items():
            button = QPushButton(label)
            button.setCheckable(True)
            button.clicked.connect(lambda _=False, n=name: self._choose_preset(n))
            self.preset_group.addButton(button)
            self.preset_buttons[name] = button
            presets.addWidget(button)
        presets.addStretch(1)
        rlayout.addLayout(presets)

        slider_row = QHBoxLayout()
        slider_row.addWidget(QLabel("more KV tokens"))
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setTracking(True)
        self.slider.valueChanged.connect(self._slider_moved)
        slider_row.addWidget(self.slider, 1)
        slider_row.addWidget(QLabel("more expert slots"))
        rlayout.addLayout(slider_row)
        self.state_row = QWidget()
        state_layout = QHBoxLayout(self.state_row)
        state_layout.setContentsMargins(0, 0, 0, 0)
        state_layout.addWidget(QLabel("Recurrent-state slots:"))
        self.state_field = QSpinBox()
        self.state_field.setToolTip(
            "One slot holds one running request's recurrent state, or one snapshot a follow-up turn "
            "resumes from")
        self.state_field.valueChanged.connect(self._state_changed)
        state_layout.addWidget(self.state_field)
        self.state_hint = QLabel(DASH)
        state_layout.addWidget(self.state_hint, 1)
        self.state_row.setVisible(False)
        rlayout.addWidget(self.state_row)
        self.limits_label = QLabel(DASH)
        self.limits_label.setStyleSheet("color: #7f8c8d; font-size: 8pt;")
        rlayout.addWidget(self.limits_label)
        self.projection_label = QLabel(DASH)
        self.projection_label.setWordWrap(True)
        rlayout.addWidget(self.projection_label)
        self.split_bar = SegmentBar()
        self.split_bar.setToolTip(
            "Of the pools' budget: expert cache (blue), KV cache (green), state pool (purple), unused")
        rlayout.addWidget(self.split_bar)

        buttons = QHBoxLayout()
        self.apply_button = QPushButton("Apply")
        self.apply_button.clicked.connect(self.apply_clicked)
        self.reset_button = QPushButton("Reset")
        self.reset_button.clicked.connect(model.reset_selection)
        buttons.addWidget(self.apply_button)
        buttons.addWidget(self.reset_button)
        buttons.addStretch(1)
        rlayout.addLayout(buttons)
        self.reason_label = QLabel()
        self.reason_label.setStyleSheet("color: #b9770e;")
        self.reason_label.setWordWrap(True)
        rlayout.addWidget(self.reason_label)
        layout.addWidget(resplit)

        outcome = QGroupBox("Last Apply")
        olayout = QVBoxLayout(outcome)
        self.outcome_label = QLabel("Nothing applied yet.")
        self.outcome_label.setWordWrap(True)
        self.outcome_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.restart_button = QPushButton("Restart engine")
        self.restart_button.clicked.connect(self.restart_clicked)
        olayout.addWidget(self.outcome_label)
        olayout.addWidget(self.restart_button, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(outcome)
        layout.addStretch(1)

        model.changed.connect(self._update_pools)
        model.selection_changed.connect(self._update_selection)
        model.outcome_changed.connect(self._update_outcome)
        self._update_pools()
        self._update_selection()
        self._update_outcome()

    # -- intents ----------------------------------------------------------------------

    def _slider_moved(self, value: int) -> None:
        if self.model.limits is not None and self.model.selection is not None \
                and value != self.model.selection.moe_slots:
            self.model.select_slots(value)

    def _state_changed(self, value: int) -> None:
        if self.model.has_state_pool and self.model.selection is not None \
                and value != self.model.selection.state_slots:
            self.model.select_state_slots(value)

    def _choose_preset(self, name: str) -> None:
        if any(n == name for n, _ in self.model.presets):
            self.model.select_preset(name)
        self._update_selection()

    # -- redraw from state ------------------------------------------------------------

    def _update_pools(self) -> None:
        m = self.model
        current = m.projection(m.current) if m.current is not None else None
        if current is None:
            self.current_label.setText("No pool sizes reported.")
            self.usage_label.setText("")
        else:
            state = (f" &nbsp;&nbsp; State pool: <b>{fmt_int(current.state_slots)} slots</b>"
                     f" · {fmt_bytes(current.state_bytes)}") if m.has_state_pool else ""
            self.current_label.setText(
                f"Expert cache: <b>{fmt_int(current.moe_slots)} slots</b> · {fmt_bytes(current.moe_bytes)}"
                f" &nbsp;&nbsp; KV cache: <b>{fmt_int(current.kv_tokens)} tokens</b>"
                f" ({fmt_int(current.kv_pages)} pages) · {fmt_bytes(current.kv_bytes)}{state}")
            state_use = f" · state slots in use: {fmt_int(m.state_slots_used)}" if m.has_state_pool else ""
            self.usage_label.setText(
                f"KV pages in use: {fmt_int(m.kv_pages_used)} · evictable prefix pages: "
                f"{fmt_int(m.kv_pages_evictable)}{state_use}")
        self.state_row.setVisible(m.has_state_pool)
        self.resplit_box.setTitle(RESPLIT_TITLE_HYBRID if m.has_state_pool else RESPLIT_TITLE)
        if m.limits is not None:
            self.slider.blockSignals(True)
            self.slider.setRange(m.limits.moe_min, m.limits.moe_max)
            self.slider.blockSignals(False)
            self.state_field.blockSignals(True)
            self.state_field.setRange(m.limits.state_min, m.limits.state_max)
            self.state_field.blockSignals(False)
            state = f" · state slots {m.limits.state_min}–{m.limits.state_max}" if m.has_state_pool else ""
            pools = "three" if m.has_state_pool else "two"
            self.limits_label.setText(
                f"Expert slots {m.limits.moe_min}–{m.limits.moe_max} · KV pages "
                f"{m.limits.kv_min}–{m.limits.kv_max}{state} (limits from the engine's budget of "
                f"{fmt_bytes(m.budget.net_bytes if m.budget else None)} for the {pools} pools)")
        else:
            self.limits_label.setText(DASH)
        reason = m.disabled_reason
        self.slider.setEnabled(reason is None and m.has_moe_range)
        self.state_field.setEnabled(reason is None and m.has_state_pool)
        for name, button in self.preset_buttons.items():
            button.setEnabled(reason is None and any(n == name for n, _ in m.presets))
        self.reason_label.setText(reason or "")
        self.reason_label.setVisible(reason is not None)
        self._update_buttons()

    def _update_selection(self) -> None:
        m = self.model
        proj = m.projection()
        if proj is None:
            self.projection_label.setText(DASH)
            self.split_bar.set_segments(None, [])
            self.state_hint.setText(DASH)
        else:
            segments = [(proj.moe_bytes, MOE_COLOR), (proj.kv_bytes, KV_COLOR)]
            if m.has_state_pool:
                segments.append((proj.state_bytes, STATE_COLOR))
            self.split_bar.set_segments(m.budget.net_bytes if m.budget else None, segments)
            self.slider.blockSignals(True)
            self.slider.setValue(proj.moe_slots)
            self.slider.blockSignals(False)
            self.state_field.blockSignals(True)
            self.state_field.setValue(proj.state_slots)
            self.state_field.blockSignals(False)
            self.state_hint.setText(f"· {fmt_bytes(proj.state_bytes)}")
            budget = m.budget.net_bytes if m.budget else None
            state = (f"<b>{fmt_int(proj.state_slots)} state slots</b> · {fmt_bytes(proj.state_bytes)}"
                     " &nbsp;|&nbsp; ") if m.has_state_pool else ""
            self.projection_label.setText(
                f"{'Selected' if m.dirty else 'Now'}: <b>{fmt_int(proj.moe_slots)} expert slots</b>"
                f" · {fmt_bytes(proj.moe_bytes)} &nbsp;|&nbsp; <b>{fmt_int(proj.kv_tokens)} KV tokens</b>"
                f" ({fmt_int(proj.kv_pages)} pages) · {fmt_bytes(proj.kv_bytes)} &nbsp;|&nbsp; "
                f"{state}{fmt_bytes(proj.total_bytes)} of {fmt_bytes(budget)}")
        matching = m.preset_matching()
        for name, button in self.preset_buttons.items():
            button.setChecked(name == matching)
        self._update_buttons()

    def _update_buttons(self) -> None:
        m = self.model
        self.apply_button.setEnabled(m.enabled and m.dirty)
        self.apply_button.setText("Applying…" if m.applying else "Apply")
        self.reset_button.setEnabled(m.dirty and not m.applying)

    def _update_outcome(self) -> None:
        outcome = self.model.outcome
        if self.model.applying:
            self.outcome_label.setText("Applying… the engine is waiting for idle, then re-splitting.")
            self.outcome_label.setStyleSheet("")
        elif outcome is None:
            self.outcome_label.setText("Nothing applied yet.")
            self.outcome_label.setStyleSheet("")
        else:
            self.outcome_label.setText(outcome.text())
            self.outcome_label.setStyleSheet(SEVERITY_STYLE.get(outcome.severity, ""))
        self.restart_button.setVisible(outcome is not None and outcome.outcome == "latched")
        self._update_buttons()

    @property
    def outcome_text(self) -> str:
        return self.outcome_label.text()
