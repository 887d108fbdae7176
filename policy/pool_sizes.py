"""The numbers the pools are described in: their sizes, floors and limits, a re-split request, the
refusals of one, and the constants every sizing decision shares.

``policy.pool_budget`` decides with them (the budget formula, the plan, the slider, the presets)
and re-exports them, so callers import every pool name from there. Stdlib only.
"""

from __future__ import annotations

from typing import NamedTuple

from moetray.policy.refused import Refused

__all__ = [
    "DEFAULT_KV_RESERVE_TOKENS",
    "DEFAULT_MEMORY_RATIO",
    "DEFAULT_STATE_RESERVE_SLOTS",
    "MIN_KV_PAGES",
    "MIN_STATE_SLOTS",
    "POOLS",
    "PRESET_KV_TOKENS",
    "PRESET_STATE_SLOTS",
    "BudgetTooSmall",
    "PoolFloors",
    "PoolLimits",
    "PoolSizes",
    "Preset",
    "Projection",
    "RebuildRejected",
    "RebuildRequest",
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
MIN_STATE_SLOTS = 2
"""No state pool is smaller than this: one running request, and one snapshot for its next turn."""
DEFAULT_STATE_RESERVE_SLOTS = 8
"""State slots the start-up plan sets aside (before experts) on a model that has the pool."""
PRESET_STATE_SLOTS = {"chat": DEFAULT_STATE_RESERVE_SLOTS, "agent": 32}
"""State reserve per preset: agent keeps a snapshot at every tool-call turn it may come back to."""

POOLS = ("moe", "kv", "state")
"""Every pool's name, as refusals (``RebuildRejected.pool``) and ``touched`` sets spell it."""


class PoolSizes(NamedTuple):
    """The resizable pools: expert cache slots, KV pages, recurrent-state slots (0 when absent)."""

    moe_slots: int
    kv_pages: int
    state_slots: int = 0


class PoolFloors(NamedTuple):
    """The smallest size each pool may take; ``None`` means the model has no such pool."""

    moe_slots: int | None
    kv_pages: int
    state_slots: int | None = None


class RebuildRequest(NamedTuple):
    """A live re-split: each pool named gets that size; ``None`` leaves the pool alone."""

    moe_slots: int | None = None
    kv_pages: int | None = None
    state_slots: int | None = None

    def is_empty(self) -> bool:
        """Whether the request names no pool at all (a no-op, not an error)."""
        return self.moe_slots is None and self.kv_pages is None and self.state_slots is None

    def invalidates_prefix_cache(self) -> bool:
        """Whether applying it drops the prefix cache: a KV or state change does, a MoE-only one does not.

        Cached prefixes are page indices into the KV allocation and snapshot slots in the
        state pool, both about to be replaced; the expert cache holds no per-request state.
        """
        return self.kv_pages is not None or self.state_slots is not None

    def touched(self) -> frozenset[str]:
        """The pools this request names: a subset of ``POOLS`` (``{"moe", "kv", "state"}``)."""
        named = (self.moe_slots, self.kv_pages, self.state_slots)
        return frozenset(name for name, size in zip(POOLS, named, strict=True) if size is not None)


class RebuildRejected(Refused):
    """A re-split refused by arithmetic before anything was freed; the engine is untouched.

    ``.kind`` is ``busy`` (requests are running), ``below_floor`` (``.pool`` is ``"moe"``,
    ``"kv"`` or ``"state"``, with ``.requested`` and ``.floor``), ``no_such_pool``
    (``.pool``: the model has no expert or no state pool) or ``too_large`` (more slots than
    the model has experts: ``.pool`` and ``.requested``; or more bytes than the budget:
    ``.needed_bytes`` and ``.budget_bytes``, the net budget left for the pools, and the
    rejected ``.sizes``). Attributes not given are ``None``.
    """

    KINDS = ("busy", "below_floor", "no_such_pool", "too_large")
    # Set by ``Refused`` from the keyword arguments below.
    pool: str | None
    requested: int | None
    floor: int | None
    needed_bytes: int | None
    budget_bytes: int | None
    sizes: PoolSizes | None

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
    """Even every pool at its floor exceeds the budget: there is no split to plan or offer.

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

    Each maximum assumes the other pools at their floors: the slider trades experts for
    KV between these ends, and the state pool's field ranges beside it. A model without a
    state pool has ``state_min == state_max == 0``.
    """

    moe_min: int
    moe_max: int
    kv_min: int
    kv_max: int
    state_min: int = 0
    state_max: int = 0

    def to_wire(self) -> dict[str, dict[str, int]]:
        """``PoolInfo.limits``' shape: ``{"moe_slots": {"min", "max"}, "kv_pages": …, "state_slots": …}``."""
        return {
            "moe_slots": {"min": self.moe_min, "max": self.moe_max},
            "kv_pages": {"min": self.kv_min, "max": self.kv_max},
            "state_slots": {"min": self.state_min, "max": self.state_max},
        }


class Projection(NamedTuple):
    """What a split means to a person: slots, tokens and bytes per pool."""

    moe_slots: int
    kv_pages: int
    kv_tokens: int
    moe_bytes: int
    kv_bytes: int
    state_slots: int = 0
    state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.moe_bytes + self.kv_bytes + self.state_bytes


class Preset(NamedTuple):
    """A named split the dashboard offers as a one-click choice."""

    name: str  # "minimum", "chat", "agent"
    sizes: PoolSizes
