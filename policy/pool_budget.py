"""How device memory is split between the expert, KV and state pools, and whether a re-split fits.

One budget formula serves every sizing decision, so the start-up plan, the dashboard
slider and the live rebuild can never disagree:

    net bytes    = budget_bytes − fixed_bytes                      (signed: may be negative)
    needed bytes = moe_slots × bytes_per_slot + kv_pages × bytes_per_page
                   + state_slots × bytes_per_state_slot
    a split fits  ⇔  needed ≤ net and every pool ≥ its floor

``budget_bytes`` is what the engine may spend on its pools and their fixed companions
(measured once per process, never re-read, so decisions do not drift with allocator
caching); ``fixed_bytes`` is what the pools cost regardless of size. The MoE floor is one
layer of experts (a layer must be able to hold all its routed experts at once); the KV
floor is at least ``MIN_KV_PAGES``. The third pool exists only for hybrid models
(recurrent linear-attention layers): each slot holds one request's conv and recurrent
states, or one state snapshot kept for prefix reuse (``policy.radix_state``); its floor is
at least ``MIN_STATE_SLOTS``. A model without it has ``PoolFloors.state_slots = None``,
``state_slots = 0``, and a request naming it is refused ``no_such_pool``.

``validate_rebuild`` checks a live change before anything is freed; ``plan_budget`` picks the
start-up split (experts first, after a KV reserve); ``slider_limits``, ``split_at``,
``fraction_of`` and ``presets`` give the dashboard only sizes that ``validate_rebuild``
accepts. ``PoolBudget`` bundles the numbers so callers pass them once. The sizes, floors,
limits, requests and refusals themselves are ``policy.pool_sizes``' (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from moetray.policy.pool_sizes import (
    DEFAULT_KV_RESERVE_TOKENS,
    DEFAULT_MEMORY_RATIO,
    DEFAULT_STATE_RESERVE_SLOTS,
    MIN_KV_PAGES,
    MIN_STATE_SLOTS,
    POOLS,
    PRESET_KV_TOKENS,
    PRESET_STATE_SLOTS,
    BudgetTooSmall,
    PoolFloors,
    PoolLimits,
    PoolSizes,
    Preset,
    Projection,
    RebuildRejected,
    RebuildRequest,
)

__all__ = [
    "DEFAULT_KV_RESERVE_TOKENS",
    "DEFAULT_MEMORY_RATIO",
    "DEFAULT_STATE_RESERVE_SLOTS",
    "MIN_KV_PAGES",
    "MIN_STATE_SLOTS",
    "PRESET_KV_TOKENS",
    "PRESET_STATE_SLOTS",
    "BudgetTooSmall",
    "PoolBudget",
    "PoolFloors",
    "PoolLimits",
    "POOLS",
    "PoolSizes",
    "Preset",
    "Projection",
    "RebuildRejected",
    "RebuildRequest",
    "budget_from_free_memory",
    "fraction_of",
    "plan_budget",
    "presets",
    "project",
    "reserve_pages",
    "slider_limits",
    "split_at",
    "UnitCosts",
    "validate_rebuild",
]

# --- the formula --------------------------------------------------------------------------


class UnitCosts(NamedTuple):
    """Bytes of one unit of each pool; ``bytes_per_state_slot`` is 0 for a model without a state pool."""

    bytes_per_slot: int
    bytes_per_page: int
    bytes_per_state_slot: int = 0

    def needed(self, sizes: PoolSizes) -> int:
        """What ``sizes`` cost in the pools (fixed costs excluded)."""
        return (
            sizes.moe_slots * self.bytes_per_slot
            + sizes.kv_pages * self.bytes_per_page
            + sizes.state_slots * self.bytes_per_state_slot
        )


def _costs(
    bytes_per_slot: int, bytes_per_page: int, bytes_per_state_slot: int, floors: PoolFloors
) -> UnitCosts:
    """The unit costs, refused (``ValueError``) when one that prices a pool the model has is not positive."""
    if bytes_per_slot <= 0 or bytes_per_page <= 0:
        raise ValueError(f"unit costs must be positive: {bytes_per_slot=} {bytes_per_page=}")
    if floors.state_slots is not None and bytes_per_state_slot <= 0:
        raise ValueError(f"a state pool needs a positive unit cost: {bytes_per_state_slot=}")
    return UnitCosts(
        bytes_per_slot, bytes_per_page, bytes_per_state_slot if floors.state_slots is not None else 0
    )


def _net_bytes(budget_bytes: int, fixed_bytes: int) -> int:
    # Python ints neither wrap nor saturate: an over-committed budget stays negative and
    # every request exceeds it.
    return budget_bytes - fixed_bytes


def _kv_floor(floors: PoolFloors) -> int:
    return max(floors.kv_pages, MIN_KV_PAGES)


def _state_floor(floors: PoolFloors) -> int:
    return 0 if floors.state_slots is None else max(floors.state_slots, MIN_STATE_SLOTS)


def _floor_sizes(floors: PoolFloors) -> PoolSizes:
    return PoolSizes(floors.moe_slots or 0, _kv_floor(floors), _state_floor(floors))


def budget_from_free_memory(
    *, baseline_free_bytes: int, free_after_weights_bytes: int, ratio: float = DEFAULT_MEMORY_RATIO
) -> int:
    """The pools' ``budget_bytes`` from two free-memory readings taken once per process.

    ``floor(ratio × baseline) − weights``, where ``baseline`` is the free device memory
    before the model loaded and ``weights = baseline − free after the weights``; the
    ``1 − ratio`` remainder is activation and allocator headroom. Signed: a model whose
    weights ate the headroom yields a negative budget that every split exceeds.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must lie in (0, 1], got {ratio}")
    weights = baseline_free_bytes - free_after_weights_bytes
    return math.floor(ratio * baseline_free_bytes) - weights


def reserve_pages(tokens: int, page_size: int) -> int:
    """KV pages needed to hold ``tokens`` tokens (rounded up to whole pages)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    return -(-max(tokens, 0) // page_size)


def _below_floor(pool: str, requested: int, floor: int, why: str = "") -> RebuildRejected:
    return RebuildRejected(
        "below_floor",
        f"{pool} size {requested} is below the floor of {floor}{why}",
        pool=pool,
        requested=requested,
        floor=floor,
    )


def validate_rebuild(
    request: RebuildRequest,
    current: PoolSizes,
    floors: PoolFloors,
    *,
    idle: bool,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    bytes_per_state_slot: int = 0,
    fixed_bytes: int = 0,
    max_moe_slots: int | None = None,
) -> PoolSizes:
    """Decides whether a live re-split fits, before anything is freed; returns the target sizes.

    Each pool the request names takes that size; the others keep ``current``. Mutates
    nothing. Refuses with ``RebuildRejected``, checking in this order: ``busy`` (not
    ``idle``), ``below_floor`` (MoE, then KV, whose floor is at least ``MIN_KV_PAGES``),
    ``no_such_pool`` (MoE named on a model without an expert pool, then state named on a
    model without a state pool), ``below_floor`` (state, at least ``MIN_STATE_SLOTS``),
    ``too_large`` (more expert slots than ``max_moe_slots``, when given, or the MoE floor if
    larger, as in ``slider_limits``: the model has no more experts to hold; then a target
    costing more than ``budget_bytes − fixed_bytes``, signed: an over-committed budget
    rejects every size).
    """
    costs = _costs(bytes_per_slot, bytes_per_page, bytes_per_state_slot, floors)
    if not idle:
        raise RebuildRejected("busy", "requests are running; the pools can only be re-split when idle")
    if (
        floors.moe_slots is not None
        and request.moe_slots is not None
        and request.moe_slots < floors.moe_slots
    ):
        raise _below_floor("moe", request.moe_slots, floors.moe_slots, " (one layer of experts)")
    if request.kv_pages is not None and request.kv_pages < _kv_floor(floors):
        raise _below_floor("kv", request.kv_pages, _kv_floor(floors))
    if floors.moe_slots is None and request.moe_slots is not None:
        raise RebuildRejected("no_such_pool", "this model has no expert cache to resize", pool="moe")
    if request.state_slots is not None:
        if floors.state_slots is None:
            raise RebuildRejected(
                "no_such_pool",
                "this model has no recurrent-state pool (no linear-attention layers)",
                pool="state",
            )
        if request.state_slots < _state_floor(floors):
            raise _below_floor("state", request.state_slots, _state_floor(floors))
    cap = None if max_moe_slots is None else max(max_moe_slots, floors.moe_slots or 0)  # as slider_limits
    if cap is not None and request.moe_slots is not None and request.moe_slots > cap:
        raise RebuildRejected(
            "too_large",
            f"moe_slots {request.moe_slots} exceeds the {cap} experts this model has",
            pool="moe",
            requested=request.moe_slots,
        )
    target = PoolSizes(
        current.moe_slots if request.moe_slots is None else request.moe_slots,
        current.kv_pages if request.kv_pages is None else request.kv_pages,
        current.state_slots if request.state_slots is None else request.state_slots,
    )
    needed = costs.needed(target)
    net = _net_bytes(budget_bytes, fixed_bytes)
    if needed > net:
        raise RebuildRejected(
            "too_large",
            f"needs {needed} bytes but the budget leaves {net}; old pools kept, still serving",
            needed_bytes=needed,
            budget_bytes=net,
            sizes=target,
        )
    return target


def slider_limits(
    floors: PoolFloors,
    *,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    max_moe_slots: int,
    bytes_per_state_slot: int = 0,
    fixed_bytes: int = 0,
) -> PoolLimits:
    """Decides the range of each pool from the same formula ``validate_rebuild`` enforces.

    ``moe_max`` is the most slots that fit beside the other floors, capped at
    ``max_moe_slots`` (every expert of every MoE layer: more slots would sit empty);
    ``kv_max`` and ``state_max`` the most pages and state slots that fit beside the other
    floors. Fixed costs are included, so no size in range is rejected for want of memory.
    A model without an expert pool has ``moe_min == moe_max == 0``, one without a state
    pool ``state_min == state_max == 0``. Mutates nothing. Refuses with ``BudgetTooSmall``
    when the floors alone do not fit.
    """
    costs = _costs(bytes_per_slot, bytes_per_page, bytes_per_state_slot, floors)
    net = _net_bytes(budget_bytes, fixed_bytes)
    least = _floor_sizes(floors)
    floor_bytes = costs.needed(least)
    if floor_bytes > net:
        raise BudgetTooSmall(floor_bytes, net)
    spare = net - floor_bytes
    if floors.moe_slots is None:
        moe_max = 0
    else:
        moe_max = min(max(max_moe_slots, least.moe_slots), least.moe_slots + spare // bytes_per_slot)
    kv_max = least.kv_pages + spare // bytes_per_page
    state_max = 0 if floors.state_slots is None else least.state_slots + spare // costs.bytes_per_state_slot
    return PoolLimits(least.moe_slots, moe_max, least.kv_pages, kv_max, least.state_slots, state_max)


def split_at(
    fraction: float,
    limits: PoolLimits,
    *,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    bytes_per_state_slot: int = 0,
    state_slots: int | None = None,
    fixed_bytes: int = 0,
) -> PoolSizes:
    """Projects a slider position into a split that fits: 0 favours KV, 1 favours experts.

    The state pool keeps ``state_slots`` (its floor when ``None``; clamped to its limits)
    and its bytes come off the top. Experts take ``moe_min + round(fraction × span)``
    slots, the span shrinking when the state pool leaves too little for ``moe_max``; KV
    takes every whole page the rest of the net budget pays for, capped at ``kv_max``.
    ``fraction`` is clamped to [0, 1]. Mutates nothing; refuses a NaN fraction with
    ``ValueError``.
    """
    if math.isnan(fraction):
        raise ValueError("fraction is NaN")
    if bytes_per_slot <= 0 or bytes_per_page <= 0:
        raise ValueError(f"unit costs must be positive: {bytes_per_slot=} {bytes_per_page=}")
    fraction = min(max(fraction, 0.0), 1.0)
    state = limits.state_min if state_slots is None else state_slots
    state = min(max(state, limits.state_min), limits.state_max)
    net = _net_bytes(budget_bytes, fixed_bytes) - state * bytes_per_state_slot
    moe_top = min(
        limits.moe_max, max((net - limits.kv_min * bytes_per_page) // bytes_per_slot, limits.moe_min)
    )
    moe = limits.moe_min + round(fraction * (moe_top - limits.moe_min))
    kv = min(limits.kv_max, (net - moe * bytes_per_slot) // bytes_per_page)
    return PoolSizes(moe, max(kv, limits.kv_min), state)


def fraction_of(sizes: PoolSizes, limits: PoolLimits) -> float | None:
    """The slider position that shows ``sizes``' expert share; ``None`` when the slider has no range.

    Clamped to [0, 1] (a pool outside the current limits shows at the nearest end).
    """
    span = limits.moe_max - limits.moe_min
    if span <= 0:
        return None
    return min(max((sizes.moe_slots - limits.moe_min) / span, 0.0), 1.0)


def plan_budget(
    floors: PoolFloors,
    *,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    max_moe_slots: int,
    reserve_pages: int,
    bytes_per_state_slot: int = 0,
    reserve_state_slots: int = 0,
    fixed_bytes: int = 0,
) -> PoolSizes:
    """Decides the start-up split: the state reserve, then experts, after setting aside a KV reserve.

    A model with a state pool first gets ``reserve_state_slots`` slots (at least its floor,
    at most ``state_max``): they bound how many requests run at once. Experts then get
    ``(net − reserve_pages × bytes_per_page) // bytes_per_slot`` slots, clamped between the
    MoE floor (one layer of experts) and ``max_moe_slots`` (all experts); KV gets every
    whole page the rest pays for. Each reserve is a priority, not a floor: when the budget
    cannot pay for it beyond the other floors, the pool gets what remains, down to its own
    floor. Every plan lies within ``slider_limits`` and passes ``validate_rebuild``.
    Mutates nothing. Refuses with ``BudgetTooSmall`` when the floors alone do not fit.
    """
    limits = slider_limits(
        floors,
        budget_bytes=budget_bytes,
        bytes_per_slot=bytes_per_slot,
        bytes_per_page=bytes_per_page,
        bytes_per_state_slot=bytes_per_state_slot,
        max_moe_slots=max_moe_slots,
        fixed_bytes=fixed_bytes,
    )
    state = min(max(reserve_state_slots, limits.state_min), limits.state_max)
    net = _net_bytes(budget_bytes, fixed_bytes) - state * bytes_per_state_slot
    raw = (net - max(reserve_pages, 0) * bytes_per_page) // bytes_per_slot
    moe_top = max((net - limits.kv_min * bytes_per_page) // bytes_per_slot, limits.moe_min)
    moe = min(max(raw, limits.moe_min), limits.moe_max, moe_top)
    kv = (net - moe * bytes_per_slot) // bytes_per_page
    return PoolSizes(moe, kv, state)


def presets(
    floors: PoolFloors,
    *,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    max_moe_slots: int,
    page_size: int,
    bytes_per_state_slot: int = 0,
    fixed_bytes: int = 0,
) -> tuple[Preset, ...]:
    """The one-click splits, each a pure function of the budget numbers; each sets all three pools.

    ``minimum``: every pool at its floor (the least device memory that still serves);
    ``chat``: the start-up plan with the ``"chat"`` KV and state reserves
    (``PRESET_KV_TOKENS``, ``PRESET_STATE_SLOTS``); ``agent``: the plan with the larger
    agent reserves (long, tool-heavy contexts and a snapshot per tool turn), experts taking
    the rest. Mutates nothing; refuses with ``BudgetTooSmall`` like ``slider_limits``.
    """
    common = {
        "budget_bytes": budget_bytes,
        "bytes_per_slot": bytes_per_slot,
        "bytes_per_page": bytes_per_page,
        "bytes_per_state_slot": bytes_per_state_slot,
        "max_moe_slots": max_moe_slots,
        "fixed_bytes": fixed_bytes,
    }
    limits = slider_limits(floors, **common)
    out = [Preset("minimum", PoolSizes(limits.moe_min, limits.kv_min, limits.state_min))]
    for name in ("chat", "agent"):
        reserve = reserve_pages(PRESET_KV_TOKENS[name], page_size)
        plan = plan_budget(
            floors, reserve_pages=reserve, reserve_state_slots=PRESET_STATE_SLOTS[name], **common
        )
        out.append(Preset(name, plan))
    return tuple(out)


def project(
    sizes: PoolSizes,
    *,
    page_size: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    bytes_per_state_slot: int = 0,
) -> Projection:
    """What a split holds and costs: slots, pages, tokens, state slots, bytes per pool. Mutates nothing."""
    return Projection(
        moe_slots=sizes.moe_slots,
        kv_pages=sizes.kv_pages,
        kv_tokens=sizes.kv_pages * page_size,
        moe_bytes=sizes.moe_slots * bytes_per_slot,
        kv_bytes=sizes.kv_pages * bytes_per_page,
        state_slots=sizes.state_slots,
        state_bytes=sizes.state_slots * bytes_per_state_slot,
    )


# --- one bundle of numbers ------------------------------------------------------------------


@dataclass(frozen=True)
class PoolBudget:
    """One engine's pool arithmetic, fixed at start-up: every sizing verb with its numbers bound.

    ``budget_bytes`` and ``fixed_bytes`` as in the module doc; ``bytes_per_slot`` is one
    expert's bytes in the slot pool; ``bytes_per_page`` one KV page over all layers;
    ``bytes_per_state_slot`` one request's conv and recurrent states over every linear
    layer (0 without a state pool); ``page_size`` tokens per page; ``max_moe_slots`` every
    expert of every MoE layer. The engine builds it once; the dashboard rebuilds it from the
    status snapshot with ``from_wire``.
    """

    budget_bytes: int
    bytes_per_slot: int
    bytes_per_page: int
    page_size: int
    floors: PoolFloors
    max_moe_slots: int
    fixed_bytes: int = 0
    bytes_per_state_slot: int = 0

    def _costs(self) -> dict[str, int]:
        return {
            "budget_bytes": self.budget_bytes,
            "bytes_per_slot": self.bytes_per_slot,
            "bytes_per_page": self.bytes_per_page,
            "bytes_per_state_slot": self.bytes_per_state_slot,
            "fixed_bytes": self.fixed_bytes,
        }

    @property
    def has_state_pool(self) -> bool:
        """Whether the model has a recurrent-state pool (hybrid linear-attention layers)."""
        return self.floors.state_slots is not None

    @property
    def net_bytes(self) -> int:
        """The budget left for the pools after fixed costs (signed)."""
        return _net_bytes(self.budget_bytes, self.fixed_bytes)

    def needed_bytes(self, sizes: PoolSizes) -> int:
        """What ``sizes`` cost in the pools (fixed costs excluded)."""
        return UnitCosts(self.bytes_per_slot, self.bytes_per_page, self.bytes_per_state_slot).needed(sizes)

    def validate(self, request: RebuildRequest, current: PoolSizes, *, idle: bool) -> PoolSizes:
        """``validate_rebuild`` with this budget's numbers, its expert cap included."""
        return validate_rebuild(
            request, current, self.floors, idle=idle, max_moe_slots=self.max_moe_slots, **self._costs()
        )

    def limits(self) -> PoolLimits:
        """``slider_limits`` with this budget's numbers."""
        return slider_limits(self.floors, max_moe_slots=self.max_moe_slots, **self._costs())

    def plan(
        self,
        reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS,
        reserve_state_slots: int = DEFAULT_STATE_RESERVE_SLOTS,
        pinned: RebuildRequest | None = None,
    ) -> PoolSizes:
        """Decides the start-up split: ``plan_budget`` with a KV reserve in tokens, a state reserve in slots.

        A pool ``pinned`` (the user named its size) keeps that size; a pinned state pool
        replaces the state reserve. Of experts and KV, the one not pinned takes what the
        budget leaves beside the others, within its floor and (experts) the cap of every
        expert. Pinned expert slots beyond the cap are capped. The result is checked like a
        re-split against the plan. Mutates nothing. Refuses with ``BudgetTooSmall`` when the
        floors do not fit and with ``RebuildRejected`` when the pinned split does not.
        """
        if pinned is not None and pinned.state_slots is not None:
            reserve_state_slots = pinned.state_slots
        planned = plan_budget(
            self.floors,
            max_moe_slots=self.max_moe_slots,
            reserve_pages=reserve_pages(reserve_tokens, self.page_size),
            reserve_state_slots=reserve_state_slots,
            **self._costs(),
        )
        if pinned is None or pinned.is_empty():
            return planned
        moe, kv, state = pinned
        net = self.net_bytes - planned.state_slots * self.bytes_per_state_slot
        if kv is None and moe is not None:
            room = (net - moe * self.bytes_per_slot) // self.bytes_per_page
            kv = max(room, self.floors.kv_pages)
        elif moe is None and kv is not None and self.floors.moe_slots is not None:
            room = (net - kv * self.bytes_per_page) // self.bytes_per_slot
            moe = max(min(room, self.max_moe_slots), self.floors.moe_slots)
        if moe is not None:
            moe = min(moe, self.max_moe_slots)
        return self.validate(RebuildRequest(moe, kv, state), planned, idle=True)

    def split_at(self, fraction: float, state_slots: int | None = None) -> PoolSizes:
        """``split_at`` within this budget's limits, the state pool at ``state_slots``."""
        return split_at(fraction, self.limits(), state_slots=state_slots, **self._costs())

    def fraction_of(self, sizes: PoolSizes) -> float | None:
        """``fraction_of`` within this budget's limits."""
        return fraction_of(sizes, self.limits())

    def presets(self) -> tuple[Preset, ...]:
        """``presets`` with this budget's numbers."""
        return presets(
            self.floors, max_moe_slots=self.max_moe_slots, page_size=self.page_size, **self._costs()
        )

    def project(self, sizes: PoolSizes) -> Projection:
        """``project`` with this budget's unit costs."""
        return project(
            sizes,
            page_size=self.page_size,
            bytes_per_slot=self.bytes_per_slot,
            bytes_per_page=self.bytes_per_page,
            bytes_per_state_slot=self.bytes_per_state_slot,
        )

    def to_wire(
        self,
        current: PoolSizes,
        *,
        kv_pages_used: int | None,
        kv_pages_evictable: int | None,
        state_slots_used: int | None = None,
        live_moe_bytes: int | None = None,
        live_kv_bytes: int | None = None,
        live_state_bytes: int | None = None,
    ) -> dict[str, object]:
        """The snapshot's ``pools`` object (``policy.wire.PoolInfo``) for ``current`` sizes.

        ``kv_pages_used`` / ``kv_pages_evictable``, ``state_slots_used`` and the bytes each
        live pool holds (``live_*_bytes``, measured, not priced) come from the caller; unknown
        is ``None``. A model without a state pool reports ``state_slots: 0``, a 0 floor and a 0
        range (the pool's absence, not an unknown); ``state_slots_used`` and its live bytes
        are then 0 as well.
        """
        floors = self.floors
        try:
            limits: dict[str, dict[str, int]] = self.limits().to_wire()
        except BudgetTooSmall:
            limits = {}
        return {
            "moe_slots": current.moe_slots,
            "kv_pages": current.kv_pages,
            "page_size": self.page_size,
            "kv_tokens": current.kv_pages * self.page_size,
            "state_slots": current.state_slots,
            "bytes_per_slot": self.bytes_per_slot,
            "bytes_per_page": self.bytes_per_page,
            "bytes_per_state_slot": self.bytes_per_state_slot,
            "budget_bytes": self.budget_bytes,
            "fixed_bytes": self.fixed_bytes,
            "floors": {
                "moe_slots": 0 if floors.moe_slots is None else floors.moe_slots,
                "kv_pages": floors.kv_pages,
                "state_slots": 0 if floors.state_slots is None else floors.state_slots,
            },
            "limits": limits,
            "kv_pages_used": kv_pages_used,
            "kv_pages_evictable": kv_pages_evictable,
            "state_slots_used": state_slots_used if self.has_state_pool else 0,
            "live_bytes": {
                "moe_slots": live_moe_bytes,
                "kv_pages": live_kv_bytes,
                "state_slots": live_state_bytes if self.has_state_pool else 0,
            },
        }

    @classmethod
    def from_wire(cls, pools: Mapping[str, Any]) -> PoolBudget:
        """Rebuilds the budget from a snapshot's ``pools`` object (what the dashboard receives).

        The expert cap is read back from the published limits: ``moe_max`` already is the
        smaller of the cap and what the budget allows, so limits recomputed here equal the
        engine's. A zero MoE floor with a zero MoE maximum means the model has no expert
        pool; a zero state floor (or none: an older engine) means it has no state pool.
        """
        limits = pools["limits"]
        moe_floor = pools["floors"]["moe_slots"]
        moe_max = limits["moe_slots"]["max"]
        no_moe = moe_floor == 0 and moe_max == 0
        state_floor = pools["floors"].get("state_slots") or None
        return cls(
            budget_bytes=pools["budget_bytes"],
            bytes_per_slot=pools["bytes_per_slot"],
            bytes_per_page=pools["bytes_per_page"],
            page_size=pools["page_size"],
            floors=PoolFloors(None if no_moe else moe_floor, pools["floors"]["kv_pages"], state_floor),
            max_moe_slots=moe_max,
            fixed_bytes=pools["fixed_bytes"],
            bytes_per_state_slot=pools.get("bytes_per_state_slot", 0) if state_floor else 0,
        )
