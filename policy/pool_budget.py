"""How device memory is split between the expert cache and the KV pool, and whether a re-split fits.

One budget formula serves every sizing decision, so the start-up plan, the dashboard
slider and the live rebuild can never disagree:

    net bytes   = budget_bytes − fixed_bytes                      (signed: may be negative)
    needed bytes = moe_slots × bytes_per_slot + kv_pages × bytes_per_page
    a split fits  ⇔  needed ≤ net, moe_slots ≥ the MoE floor, kv_pages ≥ the KV floor

``budget_bytes`` is what the engine may spend on its pools and their fixed companions
(measured once per process, never re-read, so decisions do not drift with allocator
caching); ``fixed_bytes`` is what the pools cost regardless of size. The MoE floor is one
layer of experts (a layer must be able to hold all its routed experts at once); the KV
floor is at least ``MIN_KV_PAGES``.

``validate_rebuild`` checks a live change before anything is freed; ``plan_budget`` picks the
start-up split (experts first, after a KV reserve); ``slider_limits``, ``split_at``,
``fraction_of`` and ``presets`` give the dashboard only sizes that ``validate_rebuild``
accepts. ``PoolBudget`` bundles the numbers so callers pass them once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from moetray.policy.refused import Refused

__all__ = [
    "DEFAULT_KV_RESERVE_TOKENS",
    "DEFAULT_MEMORY_RATIO",
    "MIN_KV_PAGES",
    "PRESET_KV_TOKENS",
    "BudgetTooSmall",
    "PoolBudget",
    "PoolFloors",
    "PoolLimits",
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
    "validate_rebuild",
]

MIN_KV_PAGES = 2
"""No KV pool is smaller than this, whatever floor the caller passes (one page cannot hold a
prompt and its first decoded token once paging rounds up)."""
DEFAULT_KV_RESERVE_TOKENS = 8192
"""KV tokens the start-up plan sets aside before experts take the rest (FreeToken's default)."""
DEFAULT_MEMORY_RATIO = 0.9
"""Share of the free device memory the engine plans to use; the rest is headroom."""
PRESET_KV_TOKENS = {"chat": DEFAULT_KV_RESERVE_TOKENS, "agent": 65536}
"""KV reserve per preset: chat keeps one long conversation; agent keeps tool-heavy contexts."""


class PoolSizes(NamedTuple):
    """The two resizable pools: expert cache slots and KV pages."""

    moe_slots: int
    kv_pages: int


class PoolFloors(NamedTuple):
    """The smallest size each pool may take; ``moe_slots=None`` means the model has no expert pool."""

    moe_slots: int | None
    kv_pages: int


class RebuildRequest(NamedTuple):
    """A live re-split: each pool named gets that size; ``None`` leaves the pool alone."""

    moe_slots: int | None = None
    kv_pages: int | None = None

    def is_empty(self) -> bool:
        """Whether the request names no pool at all (a no-op, not an error)."""
        return self.moe_slots is None and self.kv_pages is None

    def invalidates_prefix_cache(self) -> bool:
        """Whether applying it drops the prefix cache: any KV change does, a MoE-only one does not.

        Cached prefixes are page indices into the KV allocation about to be replaced; the
        expert cache holds no per-request state.
        """
        return self.kv_pages is not None

    def touched(self) -> frozenset[str]:
        """The pools this request names: a subset of ``{"moe", "kv"}``."""
        names = []
        if self.moe_slots is not None:
            names.append("moe")
        if self.kv_pages is not None:
            names.append("kv")
        return frozenset(names)


class RebuildRejected(Refused):
    """A re-split refused by arithmetic before anything was freed; the engine is untouched.

    ``.kind`` is ``busy`` (requests are running), ``below_floor`` (``.pool`` is ``"moe"``
    or ``"kv"``, with ``.requested`` and ``.floor``), ``no_such_pool`` (``.pool``) or
    ``too_large`` (more slots than the model has experts: ``.pool`` and ``.requested``; or
    more bytes than the budget: ``.needed_bytes`` and ``.budget_bytes``, the net budget left
    for the two pools, and the rejected ``.sizes``). Attributes not given are ``None``.
    """

    KINDS = ("busy", "below_floor", "no_such_pool", "too_large")

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        pool: str | None = None,
        requested: int | None = None,
        floor: int | None = None,
        needed_bytes: int | None = None,
        budget_bytes: int | None = None,
        sizes: PoolSizes | None = None,
    ) -> None:
        super().__init__(
            kind,
            message,
            pool=pool,
            requested=requested,
            floor=floor,
            needed_bytes=needed_bytes,
            budget_bytes=budget_bytes,
            sizes=sizes,
        )


class BudgetTooSmall(Refused):
    """Even both pools at their floors exceed the budget: there is no split to plan or offer.

    ``.kind`` is ``too_large``; ``.needed_bytes`` is what the floors cost and
    ``.budget_bytes`` the net budget they had to fit in.
    """

    KINDS = ("too_large",)

    def __init__(self, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            "too_large",
            f"memory budget too small: the smallest pools need {needed_bytes} bytes, "
            f"{budget_bytes} are available",
            needed_bytes=needed_bytes,
            budget_bytes=budget_bytes,
        )


class PoolLimits(NamedTuple):
    """The range each pool may take in a split that fits (inclusive).

    ``moe_max`` assumes the KV pool at its floor and ``kv_max`` the expert pool at its
    floor: the slider trades one for the other between these ends.
    """

    moe_min: int
    moe_max: int
    kv_min: int
    kv_max: int

    def to_wire(self) -> dict[str, dict[str, int]]:
        """``PoolInfo.limits``' shape: ``{"moe_slots": {"min", "max"}, "kv_pages": {...}}``."""
        return {
            "moe_slots": {"min": self.moe_min, "max": self.moe_max},
            "kv_pages": {"min": self.kv_min, "max": self.kv_max},
        }


class Projection(NamedTuple):
    """What a split means to a person: slots, tokens and bytes per pool."""

    moe_slots: int
    kv_pages: int
    kv_tokens: int
    moe_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.moe_bytes + self.kv_bytes


class Preset(NamedTuple):
    """A named split the dashboard offers as a one-click choice."""

    name: str  # "minimum", "chat", "agent"
    sizes: PoolSizes


# --- the formula --------------------------------------------------------------------------


def _needed_bytes(moe_slots: int, kv_pages: int, bytes_per_slot: int, bytes_per_page: int) -> int:
    return moe_slots * bytes_per_slot + kv_pages * bytes_per_page


def _net_bytes(budget_bytes: int, fixed_bytes: int) -> int:
    # Python ints neither wrap nor saturate: an over-committed budget stays negative and
    # every request exceeds it.
    return budget_bytes - fixed_bytes


def _kv_floor(floors: PoolFloors) -> int:
    return max(floors.kv_pages, MIN_KV_PAGES)


def _check_unit_costs(bytes_per_slot: int, bytes_per_page: int) -> None:
    if bytes_per_slot <= 0 or bytes_per_page <= 0:
        raise ValueError(f"unit costs must be positive: {bytes_per_slot=} {bytes_per_page=}")


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


def validate_rebuild(
    request: RebuildRequest,
    current: PoolSizes,
    floors: PoolFloors,
    *,
    idle: bool,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    fixed_bytes: int = 0,
    max_moe_slots: int | None = None,
) -> PoolSizes:
    """Decides whether a live re-split fits, before anything is freed; returns the target sizes.

    Each pool the request names takes that size; the others keep ``current``. Mutates
    nothing. Refuses with ``RebuildRejected``, checking in this order: ``busy`` (not
    ``idle``), ``below_floor`` (MoE, then KV, whose floor is at least ``MIN_KV_PAGES``),
    ``no_such_pool`` (MoE named on a model without an expert pool), ``too_large`` (more
    expert slots than ``max_moe_slots``, when given, or the MoE floor if larger, as in
    ``slider_limits``: the model has no more experts to hold; then a target costing more
    than ``budget_bytes − fixed_bytes``, signed: an over-committed budget rejects every size).
    """
    _check_unit_costs(bytes_per_slot, bytes_per_page)
    if not idle:
        raise RebuildRejected("busy", "requests are running; the pools can only be re-split when idle")
    if (
        floors.moe_slots is not None
        and request.moe_slots is not None
        and request.moe_slots < floors.moe_slots
    ):
        raise RebuildRejected(
            "below_floor",
            f"moe_slots {request.moe_slots} is below the floor of {floors.moe_slots} (one layer of experts)",
            pool="moe",
            requested=request.moe_slots,
            floor=floors.moe_slots,
        )
    kv_floor = _kv_floor(floors)
    if request.kv_pages is not None and request.kv_pages < kv_floor:
        raise RebuildRejected(
            "below_floor",
            f"kv_pages {request.kv_pages} is below the floor of {kv_floor}",
            pool="kv",
            requested=request.kv_pages,
            floor=kv_floor,
        )
    if floors.moe_slots is None and request.moe_slots is not None:
        raise RebuildRejected("no_such_pool", "this model has no expert cache to resize", pool="moe")
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
    )
    needed = _needed_bytes(*target, bytes_per_slot, bytes_per_page)
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
    fixed_bytes: int = 0,
) -> PoolLimits:
    """Decides the range of each pool from the same formula ``validate_rebuild`` enforces.

    ``moe_max`` is the most slots that fit beside the KV floor, capped at
    ``max_moe_slots`` (every expert of every MoE layer: more slots would sit empty);
    ``kv_max`` the most pages that fit beside the MoE floor. Fixed costs are included, so
    no size in range is rejected for want of memory. A model without an expert pool has
    ``moe_min == moe_max == 0``. Mutates nothing. Refuses with ``BudgetTooSmall`` when
    the floors alone do not fit.
    """
    _check_unit_costs(bytes_per_slot, bytes_per_page)
    net = _net_bytes(budget_bytes, fixed_bytes)
    kv_min = _kv_floor(floors)
    moe_min = 0 if floors.moe_slots is None else floors.moe_slots
    floor_bytes = _needed_bytes(moe_min, kv_min, bytes_per_slot, bytes_per_page)
    if floor_bytes > net:
        raise BudgetTooSmall(floor_bytes, net)
    if floors.moe_slots is None:
        moe_max = 0
    else:
        moe_max = min(max(max_moe_slots, moe_min), (net - kv_min * bytes_per_page) // bytes_per_slot)
    kv_max = (net - moe_min * bytes_per_slot) // bytes_per_page
    return PoolLimits(moe_min, moe_max, kv_min, kv_max)


def split_at(
    fraction: float,
    limits: PoolLimits,
    *,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    fixed_bytes: int = 0,
) -> PoolSizes:
    """Projects a slider position into a split that fits: 0 favours KV, 1 favours experts.

    Experts take ``moe_min + round(fraction × (moe_max − moe_min))`` slots; KV takes every
    whole page the rest of the net budget pays for, capped at ``kv_max``. ``fraction`` is
    clamped to [0, 1]. Mutates nothing; refuses a NaN fraction with ``ValueError``.
    """
    if math.isnan(fraction):
        raise ValueError("fraction is NaN")
    _check_unit_costs(bytes_per_slot, bytes_per_page)
    fraction = min(max(fraction, 0.0), 1.0)
    moe = limits.moe_min + round(fraction * (limits.moe_max - limits.moe_min))
    net = _net_bytes(budget_bytes, fixed_bytes)
    kv = min(limits.kv_max, (net - moe * bytes_per_slot) // bytes_per_page)
    return PoolSizes(moe, max(kv, limits.kv_min))


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
    fixed_bytes: int = 0,
) -> PoolSizes:
    """Decides the start-up split: experts first, after setting aside a KV reserve.

    Experts get ``(net − reserve_pages × bytes_per_page) // bytes_per_slot`` slots, clamped
    between the MoE floor (one layer of experts) and ``max_moe_slots`` (all experts); KV
    gets every whole page the rest pays for. The reserve is a priority, not a floor: when
    the budget cannot pay for it beyond the expert floor, KV gets what remains, down to
    its own floor. Every plan lies within ``slider_limits`` and passes ``validate_rebuild``.
    Mutates nothing. Refuses with ``BudgetTooSmall`` when the floors alone do not fit.
    """
    limits = slider_limits(
        floors,
        budget_bytes=budget_bytes,
        bytes_per_slot=bytes_per_slot,
        bytes_per_page=bytes_per_page,
        max_moe_slots=max_moe_slots,
        fixed_bytes=fixed_bytes,
    )
    net = _net_bytes(budget_bytes, fixed_bytes)
    raw = (net - max(reserve_pages, 0) * bytes_per_page) // bytes_per_slot
    moe = min(max(raw, limits.moe_min), limits.moe_max)
    kv = (net - moe * bytes_per_slot) // bytes_per_page
    return PoolSizes(moe, kv)


def presets(
    floors: PoolFloors,
    *,
    budget_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    max_moe_slots: int,
    page_size: int,
    fixed_bytes: int = 0,
) -> tuple[Preset, ...]:
    """The one-click splits, each a pure function of the budget numbers.

    ``minimum``: both pools at their floors (the least device memory that still serves);
    ``chat``: the start-up plan with a ``PRESET_KV_TOKENS["chat"]`` reserve; ``agent``: the
    plan with the larger agent reserve (long, tool-heavy contexts), experts taking the rest.
    Mutates nothing; refuses with ``BudgetTooSmall`` like ``slider_limits``.
    """
    common = {
        "budget_bytes": budget_bytes,
        "bytes_per_slot": bytes_per_slot,
        "bytes_per_page": bytes_per_page,
        "max_moe_slots": max_moe_slots,
        "fixed_bytes": fixed_bytes,
    }
    limits = slider_limits(floors, **common)
    out = [Preset("minimum", PoolSizes(limits.moe_min, limits.kv_min))]
    for name in ("chat", "agent"):
        reserve = reserve_pages(PRESET_KV_TOKENS[name], page_size)
        out.append(Preset(name, plan_budget(floors, reserve_pages=reserve, **common)))
    return tuple(out)


def project(sizes: PoolSizes, *, page_size: int, bytes_per_slot: int, bytes_per_page: int) -> Projection:
    """What a split holds and costs: slots, KV pages and tokens, bytes per pool. Mutates nothing."""
    return Projection(
        moe_slots=sizes.moe_slots,
        kv_pages=sizes.kv_pages,
        kv_tokens=sizes.kv_pages * page_size,
        moe_bytes=sizes.moe_slots * bytes_per_slot,
        kv_bytes=sizes.kv_pages * bytes_per_page,
    )


# --- one bundle of numbers ------------------------------------------------------------------


@dataclass(frozen=True)
class PoolBudget:
    """One engine's pool arithmetic, fixed at start-up: every sizing verb with its numbers bound.

    ``budget_bytes`` and ``fixed_bytes`` as in the module doc; ``bytes_per_slot`` is one
    expert's bytes in the slot pool; ``bytes_per_page`` one KV page over all layers;
    ``page_size`` tokens per page; ``max_moe_slots`` every expert of every MoE layer.
    The engine builds it once; the dashboard rebuilds it from the status snapshot with
    ``from_wire``.
    """

    budget_bytes: int
    bytes_per_slot: int
    bytes_per_page: int
    page_size: int
    floors: PoolFloors
    max_moe_slots: int
    fixed_bytes: int = 0

    def _costs(self) -> dict[str, int]:
        return {
            "budget_bytes": self.budget_bytes,
            "bytes_per_slot": self.bytes_per_slot,
            "bytes_per_page": self.bytes_per_page,
            "fixed_bytes": self.fixed_bytes,
        }

    @property
    def net_bytes(self) -> int:
        """The budget left for the two pools after fixed costs (signed)."""
        return _net_bytes(self.budget_bytes, self.fixed_bytes)

    def needed_bytes(self, sizes: PoolSizes) -> int:
        """What ``sizes`` cost in the pools (fixed costs excluded)."""
        return _needed_bytes(*sizes, self.bytes_per_slot, self.bytes_per_page)

    def validate(self, request: RebuildRequest, current: PoolSizes, *, idle: bool) -> PoolSizes:
        """``validate_rebuild`` with this budget's numbers, its expert cap included."""
        return validate_rebuild(
            request, current, self.floors, idle=idle, max_moe_slots=self.max_moe_slots, **self._costs()
        )

    def limits(self) -> PoolLimits:
        """``slider_limits`` with this budget's numbers."""
        return slider_limits(self.floors, max_moe_slots=self.max_moe_slots, **self._costs())

    def plan(
        self, reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS, pinned: RebuildRequest | None = None
    ) -> PoolSizes:
        """Decides the start-up split: ``plan_budget`` with a KV reserve given in tokens.

        A pool ``pinned`` (the user named its size) keeps that size; the other takes what the
        budget leaves beside it, within its floor and (experts) the cap of every expert. Pinned
        expert slots beyond the cap are capped. The result is checked like a re-split against
        the plan. Mutates nothing. Refuses with ``BudgetTooSmall`` when the floors do not fit
        and with ``RebuildRejected`` when the pinned split does not.
        """
        planned = plan_budget(
            self.floors,
            max_moe_slots=self.max_moe_slots,
            reserve_pages=reserve_pages(reserve_tokens, self.page_size),
            **self._costs(),
        )
        if pinned is None or pinned.is_empty():
            return planned
        moe, kv = pinned
        if kv is None:
            room = (self.net_bytes - moe * self.bytes_per_slot) // self.bytes_per_page
            kv = max(room, self.floors.kv_pages)
        elif moe is None and self.floors.moe_slots is not None:
            room = (self.net_bytes - kv * self.bytes_per_page) // self.bytes_per_slot
            moe = max(min(room, self.max_moe_slots), self.floors.moe_slots)
        if moe is not None:
            moe = min(moe, self.max_moe_slots)
        return self.validate(RebuildRequest(moe, kv), planned, idle=True)

    def split_at(self, fraction: float) -> PoolSizes:
        """``split_at`` within this budget's limits."""
        return split_at(fraction, self.limits(), **self._costs())

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
        )

    def to_wire(
        self,
        current: PoolSizes,
        *,
        kv_pages_used: int | None,
        kv_pages_evictable: int | None,
        live_moe_bytes: int | None = None,
        live_kv_bytes: int | None = None,
    ) -> dict[str, object]:
        """The snapshot's ``pools`` object (``policy.wire.PoolInfo``) for ``current`` sizes.

        ``kv_pages_used`` / ``kv_pages_evictable`` and the bytes each live pool holds
        (``live_*_bytes``, measured, not priced) come from the caller; unknown is ``None``.
        """
        return {
            "moe_slots": current.moe_slots,
            "kv_pages": current.kv_pages,
            "page_size": self.page_size,
            "kv_tokens": current.kv_pages * self.page_size,
            "bytes_per_slot": self.bytes_per_slot,
            "bytes_per_page": self.bytes_per_page,
            "budget_bytes": self.budget_bytes,
            "fixed_bytes": self.fixed_bytes,
            "floors": {
                "moe_slots": 0 if self.floors.moe_slots is None else self.floors.moe_slots,
                "kv_pages": self.floors.kv_pages,
            },
            "limits": self.limits().to_wire(),
            "kv_pages_used": kv_pages_used,
            "kv_pages_evictable": kv_pages_evictable,
            "live_bytes": {"moe_slots": live_moe_bytes, "kv_pages": live_kv_bytes},
        }

    @classmethod
    def from_wire(cls, pools: dict) -> PoolBudget:
        """Rebuilds the budget from a snapshot's ``pools`` object (what the dashboard receives).

        The expert cap is read back from the published limits: ``moe_max`` already is the
        smaller of the cap and what the budget allows, so limits recomputed here equal the
        engine's. A zero MoE floor with a zero MoE maximum means the model has no expert pool.
        """
        limits = pools["limits"]
        moe_floor = pools["floors"]["moe_slots"]
        moe_max = limits["moe_slots"]["max"]
        no_moe = moe_floor == 0 and moe_max == 0
        return cls(
            budget_bytes=pools["budget_bytes"],
            bytes_per_slot=pools["bytes_per_slot"],
            bytes_per_page=pools["bytes_per_page"],
            page_size=pools["page_size"],
            floors=PoolFloors(None if no_moe else moe_floor, pools["floors"]["kv_pages"]),
            max_moe_slots=moe_max,
            fixed_bytes=pools["fixed_bytes"],
        )
