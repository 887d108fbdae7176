"""The Pools panel's model: the re-split slider, its presets, projection and Apply outcome.

All arithmetic is :mod:`moetray.policy.pool_budget`'s, rebuilt from the snapshot's
``pools`` object with ``PoolBudget.from_wire``: the slider's range is
``slider_limits``, a slot count becomes its slider position through ``fraction_of`` and
sizes through ``split_at``, presets are ``presets``, and the projection in slots, tokens
and GiB is ``project``. So the slider never offers a size the engine's ``validate_rebuild``
would reject for want of memory.

The slider's integer value is the number of expert slots; KV takes what the budget
leaves. A hybrid model (linear-attention layers) has a third pool, recurrent-state slots,
chosen in a field beside the slider within ``slider_limits``' state range; its bytes come
off the top before experts and KV share the rest (``split_at``). A model without it has
no such field (``has_state_pool``).

The selection follows the engine's sizes until the user moves it; after that it stays put
(1 Hz snapshots do not yank the slider) until Apply finishes or Reset.

While a re-split waits for running requests (the snapshot's ``rebuild_progress``), the
model says so in words (:meth:`PoolsModel.waiting_text`) and the panel offers **Stop them
and apply** and **Cancel**.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Signal

from moetray.policy import wire
from moetray.policy.pool_budget import PoolBudget
from moetray.policy.pool_sizes import BudgetTooSmall, PoolLimits, PoolSizes, Projection
from moetray.policy.refused import Refused
from moetray.ui.format import fmt_bytes, fmt_int
from moetray.ui.outcome import ApplyOutcome, rebuild_outcome

PRESET_LABELS = {"minimum": "Minimum", "chat": "Chat", "agent": "Agent"}
PRESET_PURPOSE = {
    "minimum": "the smallest pools that serve: frees memory for other programs",
    "chat": "a balanced split for conversations",
    "agent": "the most context for long agent sessions",
}


@dataclass(frozen=True)
class RebuildWait:
    """A re-split waiting for running requests (``wire.RebuildProgress``), as the snapshot said."""

    stage: str  # "waiting" or "applying"
    running: int
    waited_s: float
    timeout_s: float | None
    held: int

    @classmethod
    def from_wire(cls, body: Mapping[str, Any] | None) -> RebuildWait | None:
        if not body:
            return None
        timeout = body.get("timeout_s")
        return cls(str(body.get("stage", "waiting")), int(body.get("running") or 0),
                   float(body.get("waited_s") or 0.0), None if timeout is None else float(timeout),
                   int(body.get("held") or 0))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class ApplyRefused(Refused):
    """Apply is not possible now; ``kind`` is ``disabled`` (see ``reason``) or ``unchanged``."""

    KINDS = ("disabled", "unchanged")
    reason: str

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(kind, reason, reason=reason)


@dataclass(frozen=True)
class RebuildTarget:
    """The body of one Apply: only the pools whose size changes (``None`` = leave alone)."""

    moe_slots: int | None
    kv_tokens: int | None
    state_slots: int | None = None


class PoolsModel(QObject):
    """Slider state between the expert cache and the KV pool (and a hybrid's state pool beside them).

    Signals: ``changed`` (engine sizes, limits, presets, enabled state), ``selection_changed``
    (the slider's choice and its projection), ``outcome_changed`` (Apply started/finished).
    """

    changed = Signal()
    selection_changed = Signal()
    outcome_changed = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.budget: PoolBudget | None = None
        self.limits: PoolLimits | None = None
        self.presets: tuple[tuple[str, PoolSizes], ...] = ()
        self.current: PoolSizes | None = None
        self.kv_pages_used: int | None = None
        self.kv_pages_evictable: int | None = None
        self.state_slots_used: int | None = None
        self.gate_state: str | None = None
        self.budget_error: str | None = None
        self.selection: PoolSizes | None = None
        self.user_moved = False
        self.applying = False
        self.outcome: ApplyOutcome | None = None
        self.waiting: RebuildWait | None = None
        self.stopping_running = False  # "Stop them and apply" was pressed for this wait
        self._last_seen: Mapping[str, Any] | None = None

    # -- derived ----------------------------------------------------------------------

    @property
    def disabled_reason(self) -> str | None:
        """Why the slider is disabled now, or ``None`` when it may be used."""
        if self.applying:
            return "Applying the re-split…"
        if self.gate_state is None:
            return "No engine is running."
        if self.gate_state != "serving":
            summary = wire.refusal_for(self.gate_state).summary if self.gate_state in wire.REFUSALS \
                else f"The engine is {self.gate_state}."
            return f"Re-split unavailable: {summary}"
        if self.budget is None:
            return "This engine reports no resizable pools."
        if self.budget_error is not None:
            return self.budget_error
        return None

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    @property
    def dirty(self) -> bool:
        """The selection differs from the engine's sizes (Apply has something to do)."""
        return self.selection is not None and self.selection != self.current

    @property
    def has_state_pool(self) -> bool:
        """Whether the engine's model has a recurrent-state pool (a hybrid): only then is it shown."""
        return self.budget is not None and self.budget.has_state_pool

    @property
    def has_moe_range(self) -> bool:
        return self.limits is not None and self.limits.moe_max > self.limits.moe_min

    def projection(self, sizes: PoolSizes | None = None) -> Projection | None:
        """Slots, KV pages/tokens and bytes of ``sizes`` (the selection by default)."""
        sizes = sizes if sizes is not None else self.selection
        if sizes is None or self.budget is None:
            return None
        return self.budget.project(sizes)

    def waiting_text(self) -> str | None:
        """"Waiting for 2 running requests… (12 s of 30 s)" while a re-split waits; else ``None``."""
        wait = self.waiting
        if wait is None or wait.stage != "waiting":
            return None
        of = "" if wait.timeout_s is None else f" of {wait.timeout_s:.0f} s"
        text = f"Waiting for {_plural(wait.running, 'running request')}… ({wait.waited_s:.0f} s{of})"
        if wait.held:
            text += f"; {_plural(wait.held, 'new request')} will go on when it is done"
        return text

    def preset_preview(self, name: str) -> str | None:
        """What choosing preset ``name`` changes, from the engine's sizes now (before Apply)."""
        sizes = dict(self.presets).get(name)
        now = self.projection(self.current) if self.current is not None else None
        new = self.projection(sizes) if sizes is not None else None
        if new is None:
            return None
        label = PRESET_LABELS.get(name, name)
        lines = [f"{label}: {PRESET_PURPOSE.get(name, '')}".rstrip(": ")]
        if now is None:
            lines.append(f"Context: {fmt_int(new.kv_tokens)} KV tokens · "
                         f"expert slots: {fmt_int(new.moe_slots)}")
        else:
            lines.append(f"Context: {fmt_int(now.kv_tokens)} → {fmt_int(new.kv_tokens)} KV tokens"
                         f" ({fmt_bytes(now.kv_bytes)} → {fmt_bytes(new.kv_bytes)})")
            lines.append(f"Expert slots: {fmt_int(now.moe_slots)} → {fmt_int(new.moe_slots)}"
                         f" ({fmt_bytes(now.moe_bytes)} → {fmt_bytes(new.moe_bytes)})")
        lines.append("Selecting it changes nothing until Apply.")
        return "\n".join(lines)

    def preset_matching(self) -> str | None:
        """The preset the selection equals, if any."""
        for name, sizes in self.presets:
            if sizes == self.selection:
                return name
        return None

    # -- inputs from the engine ----------------------------------------------------------

    def apply_snapshot(self, snap: Mapping[str, Any]) -> bool:
        """Take the gate state and the ``pools`` object; emits only on a real change."""
        pools = snap.get("pools")
        changed = self._set("gate_state", snap.get("state"))
        if pools:
            budget = PoolBudget.from_wire(dict(pools))
            current = PoolSizes(
                int(pools["moe_slots"]), int(pools["kv_pages"]), int(pools.get("state_slots") or 0)
            )
            changed |= self._set("kv_pages_used", pools.get("kv_pages_used"))
            changed |= self._set("kv_pages_evictable", pools.get("kv_pages_evictable"))
            changed |= self._set("state_slots_used", pools.get("state_slots_used"))
        else:
            budget, current = None, None
            changed |= self._set("kv_pages_used", None)
            changed |= self._set("kv_pages_evictable", None)
            changed |= self._set("state_slots_used", None)
        if budget != self.budget:
            self.budget = budget
            self._derive_limits()
            changed = True
        changed |= self._set("current", current)
        waiting = RebuildWait.from_wire(snap.get("rebuild_progress"))
        if waiting != self.waiting:
            self.waiting = waiting
            if waiting is None:
                self.stopping_running = False
            self.outcome_changed.emit()
        self._take_last_rebuild(snap.get("last_rebuild"))
        if changed:
            self.changed.emit()
        if not self.user_moved and not self.applying:
            self._select(self.current)
        elif self.selection is not None and self.limits is not None:
            # Keep the user's choice, but never one the new limits would reject.
            self._select(self._clamp(self.selection))
        return changed

    def clear(self) -> None:
        """No engine: forget everything but the last outcome."""
        self.apply_snapshot({"state": None, "pools": None})

    # -- user verbs ---------------------------------------------------------------------

    def select_slots(self, moe_slots: int) -> PoolSizes | None:
        """Move the slider to ``moe_slots`` expert slots; KV takes the rest (``split_at``)."""
        if self.budget is None or self.limits is None:
            return None
        sizes = self._split_for(moe_slots, self._selected_state())
        self.user_moved = True
        self._select(sizes)
        return sizes

    def select_state_slots(self, state_slots: int) -> PoolSizes | None:
        """Set the state pool to ``state_slots`` (clamped to its limits), experts kept where the
        budget allows, KV taking the rest (``split_at``); ``None`` without a state pool."""
        if self.budget is None or self.limits is None or not self.has_state_pool:
            return None
        moe = self.selection.moe_slots if self.selection is not None else self.limits.moe_min
        sizes = self._split_for(moe, state_slots)
        self.user_moved = True
        self._select(sizes)
        return sizes

    def select_preset(self, name: str) -> PoolSizes:
        """Select a named preset's sizes; refuses an unknown name with ``KeyError``."""
        sizes = dict(self.presets)[name]
        self.user_moved = True
        self._select(sizes)
        return sizes

    def reset_selection(self) -> None:
        """Show the engine's sizes again."""
        self.user_moved = False
        self._select(self.current)

    def mark_stopping_running(self) -> None:
        """"Stop them and apply" was sent: the panel says so until the wait ends."""
        self.stopping_running = True
        self.outcome_changed.emit()

    def begin_apply(self) -> RebuildTarget:
        """Start an Apply of the selection; returns the request body to send.

        Names only the pools that change, so a MoE-only change keeps the prefix cache.
        Refuses with :class:`ApplyRefused` while disabled (``disabled``) or when the
        selection equals the engine's sizes (``unchanged``). Marks the model applying.
        """
        reason = self.disabled_reason
        if reason is not None:
            raise ApplyRefused("disabled", reason)
        if not self.dirty or self.selection is None or self.current is None or self.budget is None:
            raise ApplyRefused("unchanged", "The selection equals the engine's sizes.")
        moe = self.selection.moe_slots if self.selection.moe_slots != self.current.moe_slots else None
        kv = (self.selection.kv_pages * self.budget.page_size
              if self.selection.kv_pages != self.current.kv_pages else None)
        state = self.selection.state_slots if self.selection.state_slots != self.current.state_slots else None
        self.applying = True
        self.outcome_changed.emit()
        self.changed.emit()
        return RebuildTarget(moe, kv, state)

    def finish_apply(self, outcome: ApplyOutcome) -> None:
        """Record the engine's verdict; the slider returns to following the engine."""
        self.applying = False
        self.waiting = None
        self.stopping_running = False
        self.outcome = outcome
        if outcome.after is not None:
            after = outcome.after
            self.current = PoolSizes(after.moe_slots, after.kv_pages, after.state_slots)
        self.user_moved = False
        self._select(self.current)
        self.outcome_changed.emit()
        self.changed.emit()

    # -- internals ---------------------------------------------------------------------

    def _take_last_rebuild(self, last: Mapping[str, Any] | None) -> None:
        """Show a re-split made by any client (curl included) as the last outcome.

        Skipped while our own Apply runs, and when it is the one this model already
        shows (our own Apply's reply carries the engine's sentence, which the snapshot's
        copy does not).
        """
        if not last or last == self._last_seen or self.applying:
            return
        self._last_seen = last
        outcome = rebuild_outcome(200, last)
        mine = self.outcome
        if mine is not None and (mine.outcome, mine.before, mine.after, mine.elapsed_ms) == (
                outcome.outcome, outcome.before, outcome.after, outcome.elapsed_ms):
            return
        self.outcome = outcome
        self.outcome_changed.emit()

    def _set(self, name: str, value: Any) -> bool:
        if getattr(self, name) == value:
            return False
        setattr(self, name, value)
        return True

    def _derive_limits(self) -> None:
        self.limits, self.presets, self.budget_error = None, (), None
        if self.budget is None:
            return
        try:
            self.limits = self.budget.limits()
            self.presets = tuple((p.name, p.sizes) for p in self.budget.presets())
        except BudgetTooSmall as exc:
            self.budget_error = f"The memory budget is too small for any split ({exc})."

    def _clamp(self, sizes: PoolSizes) -> PoolSizes:
        assert self.budget is not None and self.limits is not None
        limits = self.limits
        moe = min(max(sizes.moe_slots, limits.moe_min), limits.moe_max)
        state = min(max(sizes.state_slots, limits.state_min), limits.state_max)
        if moe == sizes.moe_slots and state == sizes.state_slots \
                and limits.kv_min <= sizes.kv_pages <= limits.kv_max \
                and self.budget.needed_bytes(sizes) <= self.budget.net_bytes:
            return sizes
        return self._split_for(moe, state)

    def _selected_state(self) -> int | None:
        """The state slots the selection holds (``None``: the pool's floor, or no pool)."""
        return self.selection.state_slots if self.selection is not None and self.has_state_pool else None

    def _split_for(self, moe_slots: int, state_slots: int | None) -> PoolSizes:
        """The split with ``moe_slots`` expert slots and ``state_slots`` state slots (each clamped
        to the limits), KV taking the rest."""
        assert self.budget is not None
        fraction = self.budget.fraction_of(PoolSizes(moe_slots, 0))
        return self.budget.split_at(0.0 if fraction is None else fraction, state_slots)

    def _select(self, sizes: PoolSizes | None) -> None:
        if sizes != self.selection:
            self.selection = sizes
            self.selection_changed.emit()
