"""Host memory classes for expert banks (pinned / locked / pageable) and the pin budget.

- **pinned**: page-locked and addressable by the device; the only class a device copy may
  read from asynchronously, so every layer whose experts are copied to slots needs it;
- **locked**: resident (mlock) but not device-addressable; for layers the CPU computes;
- **pageable**: ordinary memory the OS may page out; a fallback when locking fails.

A label the engine does not know is None, never pinned: guessing "pinned" would let a device
copy read memory that is not page-locked. A layer is as resident as its worst bank, and a
downgrade is never raised back. Host facts (RAM size, WSL, lock results) are parameters.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from enum import StrEnum
from typing import Literal

from moetray.policy.refused import Refused

__all__ = [
    "HostResidency",
    "ResidencyPlan",
    "ResidencyRefused",
    "pin_budget",
    "requested_labels",
]

SettleAction = Literal["pin", "lock", "leave_pageable"]


class ResidencyRefused(Refused, ValueError):
    """``kind``: ``layer_out_of_range``, ``device_layer_not_pinned`` (a layer whose experts are
    copied to the device would read unpinned memory) or ``overlap_needs_pinned`` (prefill
    overlap streams every layer, so every layer must be pinned)."""


class HostResidency(StrEnum):
    PINNED = "pinned"
    LOCKED = "locked"
    PAGEABLE = "pageable"

    @classmethod
    def from_label(cls, label: object) -> HostResidency | None:
        """The class for a label (case and surrounding blanks ignored); None when unknown."""
        if not isinstance(label, str):
            return None
        try:
            return cls(label.strip().lower())
        except ValueError:
            return None

    @property
    def device_addressable(self) -> bool:
        return self is HostResidency.PINNED

    @property
    def rank(self) -> int:
        """Higher is more resident: pinned 2, locked 1, pageable 0."""
        return _RANK[self]


_RANK = {HostResidency.PINNED: 2, HostResidency.LOCKED: 1, HostResidency.PAGEABLE: 0}


def requested_labels(num_layers: int, cpu_layers: Collection[int]) -> list[HostResidency]:
    """What each layer asks for: CPU layers → locked, every other layer → pinned. Pure."""
    return [HostResidency.LOCKED if layer in cpu_layers else HostResidency.PINNED
            for layer in range(num_layers)]


def pin_budget(total_ram_bytes: int, *, wsl: bool, wsl_fraction: float = 0.4) -> int | None:
    """How many bytes may be pinned: None (no cap) on plain Linux; under WSL pinning is capped
    machine-wide, at about ``wsl_fraction`` of physical RAM. Pure."""
    return int(total_ram_bytes * wsl_fraction) if wsl else None


class ResidencyPlan:
    """What each layer's host banks should become after they are filled, and what they became.

    ``ResidencyPlan(requested)`` takes one requested class per layer (see `requested_labels`).
    """

    def __init__(self, requested: Sequence[HostResidency]) -> None:
        self.requested = list(requested)
        self._achieved: list[HostResidency | None] = [None] * len(self.requested)
        self._lock_exhausted = False

    @property
    def lock_exhausted(self) -> bool:
        return self._lock_exhausted

    def settle_action(self, layer: int) -> SettleAction:
        """What to do with ``layer``'s banks once filled: ``pin`` a pinned layer, ``lock`` a
        locked one (``leave_pageable`` once a lock has failed: the quota is known exhausted),
        else ``leave_pageable``. Mutates nothing; refuses ``layer_out_of_range``."""
        want = self.requested[self._check(layer)]
        if want is HostResidency.PINNED:
            return "pin"
        if want is HostResidency.LOCKED and not self._lock_exhausted:
            return "lock"
        return "leave_pageable"

    def record_lock(self, ok: bool) -> None:
        """A lock attempt's outcome; one failure makes the quota exhausted for good (sticky)."""
        if not ok:
            self._lock_exhausted = True

    def record(self, layer: int, achieved: HostResidency) -> HostResidency:
        """Record one bank of ``layer`` as ``achieved``; the layer keeps its worst bank's class
        (a pageable result is never raised back). Returns the layer's class now."""
        self._check(layer)
        now = self._achieved[layer]
        if now is None or achieved.rank < now.rank:
            self._achieved[layer] = achieved
        return self._achieved[layer]  # type: ignore[return-value]

    def achieved_labels(self) -> list[HostResidency | None]:
        """Per layer: the class reached, None where nothing was recorded yet."""
        return list(self._achieved)

    def downgraded(self) -> list[int]:
        """Layers that ended below what they asked for."""
        return [i for i, (want, got) in enumerate(zip(self.requested, self._achieved, strict=True))
                if got is not None and got.rank < want.rank]

    @property
    def applied(self) -> bool:
        """True once every layer has a recorded class."""
        return all(a is not None for a in self._achieved)

    def check_attach(self, cpu_layers: Collection[int], *, prefill_overlap: bool = False) -> None:
        """Refuse to attach banks the device would misuse: a layer that is not pinned must
        be a CPU layer (``device_layer_not_pinned``), and prefill overlap needs every layer
        pinned (``overlap_needs_pinned``). Unrecorded layers count as their request.
        Mutates nothing."""
        for layer, (want, got) in enumerate(zip(self.requested, self._achieved, strict=True)):
            cls = got or want
            if cls.device_addressable:
                continue
            if prefill_overlap:
                raise ResidencyRefused("overlap_needs_pinned", f"layer {layer} is {cls.value}; prefill "
                                       "overlap streams every layer from pinned memory", layer=layer)
            if layer not in cpu_layers:
                raise ResidencyRefused("device_layer_not_pinned", f"layer {layer} is {cls.value} but its "
                                       "experts are copied to the device", layer=layer)

    def _check(self, layer: int) -> int:
        if not 0 <= layer < len(self.requested):
            raise ResidencyRefused("layer_out_of_range", f"layer {layer} not in [0, {len(self.requested)})",
                                   layer=layer)
        return layer
