"""Which (layer, expert) lives in which device slot, and what to evict: the residency planner.

The planner moves no bytes. `ExpertCache.ensure` is called once per MoE layer per forward
step with that layer's routed expert ids and answers with an `ExpertPlan`: the slot each
routed id should be computed from (``None`` = compute it on the CPU from host memory), and
the ``(slot, expert)`` copies that must land before the layer runs. The engine applies the
copies with `moetray.policy.moe.expert_slots.ExpertSlots` and reports a failed copy back
with `ExpertCache.forget_slot`.

One pool of ``capacity`` slots is shared by every layer. The layers are assumed to be
visited in order 0, 1, …, L−1 once per forward step (the order transformers runs them);
policies may use that to know when a layer's experts are next needed. Statistics are kept
per layer; the global figures are their sums, exactly.

Policies (``policy=``):

- ``"horizon"`` (the default, :data:`DEFAULT_POLICY`): evicts the resident expert whose
  next use is predicted farthest away, in global layer-call positions. The prediction
  combines each expert's reuse rate (a decayed routing count, LRFU-style, whose decay λ is
  picked online by shadow caches: frequency when the pool is small, recency when it is
  large) with the distance to its layer's next visit. The distance term is what a single
  global LRU lacks: it evicts the layer that runs next, which is why it hits 0 % once
  ``capacity < layers × top_k``. ``"horizon@<λ>"`` fixes λ (one of
  `horizon.Horizon.LAMBDAS`; an ablation, not listed in `POLICIES`).
- ``"layer_aware_lru"``: the horizon with recency alone (age in visits of the layer plus
  the distance to its next visit); an ablation.
- ``"lru"``: plain global LRU over all layers (FreeToken's policy); collapses to 0 % hits
  on the cyclic layer sweep when ``capacity < layers × top_k``.
- ``"layer_lru"``: LRU inside a fixed per-layer share of the pool (``capacity // L`` each,
  the remainder to the first layers), as mixtral-offloading does.
- ``"lfu"``: least frequently routed first (counts over the whole history, including
  routes computed on the CPU), ties to the least recent.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from moetray.policy.refused import Refused

from .horizon import Horizon
from .rankers import LFU, GlobalLRU, LayerAwareLRU, LayerLRU, Ranker, RoutingHistory

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "CacheIntegrityError",
    "CacheRefused",
    "CacheStats",
    "ExpertCache",
    "ExpertPlan",
    "ResizePlan",
]

DEFAULT_POLICY = "horizon"
"""The project's best online policy (see `bench/results/trace.json` for the evidence)."""


class CacheRefused(Refused, ValueError):
    """A request the planner refuses before changing any state.

    ``kind`` is one of ``invalid_geometry``, ``below_floor``, ``unknown_policy``,
    ``layer_out_of_range``, ``expert_out_of_range``, ``slot_out_of_range``,
    ``invalid_fetch_limit``, ``not_resident``; the offending values are attributes named in
    ``fields``.
    """


class CacheIntegrityError(Refused, RuntimeError):
    """`ExpertCache.check_integrity` found the maps or counters inconsistent (a bug)."""

    KINDS = ("integrity",)

    def __init__(self, message: str) -> None:
        super().__init__("integrity", message)


class CacheStats(NamedTuple):
    """Counters over ``ensure`` calls. ``hits + misses`` counts distinct routed experts;
    ``misses = fetched + bypassed`` (a bypassed miss is computed on the CPU)."""

    calls: int = 0
    hits: int = 0
    misses: int = 0
    fetched: int = 0
    bypassed: int = 0

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)``; None before any routed expert was seen."""
        total = self.hits + self.misses
        return self.hits / total if total else None

    def __add__(self, other: object) -> CacheStats:
        if not isinstance(other, CacheStats):
            return NotImplemented
        return CacheStats(*(a + b for a, b in zip(self, other, strict=True)))


@dataclass(frozen=True)
class ExpertPlan:
    """What one layer call needs. Read-only; produced by `ExpertCache.ensure`.

    - ``slots[i]``: the slot routed id ``expert_ids[i]`` is computed from, or None to compute
      it on the CPU (a miss beyond ``fetch_limit``, or more distinct experts than slots).
      Duplicated ids share one slot.
    - ``copies``: ``(slot, expert)`` pairs (experts of ``layer``) to copy from host memory
      before the layer runs; each slot and each expert appears at most once.
    - ``hits`` / ``misses``: counts over the *distinct* routed experts; ``fetched`` =
      ``len(copies)``; ``bypassed``: the distinct missed experts sent to the CPU, ascending.
    - ``evicted``: ``(layer, expert)`` pairs that lost their slot to this plan.
    """

    layer: int
    expert_ids: tuple[int, ...]
    slots: list[int | None]
    copies: list[tuple[int, int]]
    hits: int
    misses: int
    bypassed: tuple[int, ...]
    evicted: list[tuple[int, int]]

    @property
    def fetched(self) -> int:
        return len(self.copies)

    @property
    def warm(self) -> bool:
        """True when nothing has to be copied."""
        return not self.copies


def _plan(**fields: object) -> ExpertPlan:
    """An `ExpertPlan` equal to ``ExpertPlan(**fields)``, built for the hot path: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__`` (about 1 µs for a
    plan, per layer call); this fills the instance's dict at once."""
    plan = object.__new__(ExpertPlan)
    plan.__dict__.update(fields)
    return plan


@dataclass(frozen=True)
class ResizePlan:
    """What `ExpertCache.resize` decided; the slot pool must apply it in this order.

    1. ``moves``: ``(src_slot, dst_slot)`` copies that compact the kept experts into
       ``[0, capacity)`` (only when shrinking; sources are ≥ capacity, destinations below it
       and never a source, so the moves may run in any order);
    2. then truncate or extend the pool to ``capacity`` slots.

    ``dropped`` lists the ``(layer, expert)`` pairs that lost residency (the coldest).
    """

    old_capacity: int
    capacity: int
    moves: list[tuple[int, int]]
    dropped: list[tuple[int, int]]


# --- the policies by name (the rankers live in `rankers` and `horizon`) ---------------

_RANKERS: dict[str, type[Ranker]] = {
    r.name: r for r in (Horizon, GlobalLRU, LayerLRU, LFU, LayerAwareLRU)
}
POLICIES: tuple[str, ...] = tuple(_RANKERS)
"""Every policy name `ExpertCache` accepts; the first is the default."""
# Fixed-λ horizon variants, ``"horizon@<λ>"``: the shadows of the dueling policy, and ablations.
# Accepted by `ExpertCache` but not listed in POLICIES.
_FIXED_HORIZON: dict[str, type[Ranker]] = {
    f"horizon@{lam}": type(f"Horizon_{i}", (Horizon,), {"name": f"horizon@{lam}", "LAMBDAS": (lam,)})
    for i, lam in enumerate(Horizon.LAMBDAS)
}


class ExpertCache:
    """The residency map of one slot pool shared by all MoE layers (planner only).

    ``ExpertCache(num_layers, num_experts, capacity, policy=DEFAULT_POLICY)`` refuses with
    `CacheRefused` (``invalid_geometry`` for non-positive layers or experts,
    ``below_floor`` for ``capacity < 1``, ``unknown_policy``) before building anything.
    """

    def __init__(self, num_layers: int, num_experts: int, capacity: int,
                 policy: str = DEFAULT_POLICY) -> None:
        if not _is_int(num_layers) or not _is_int(num_experts) or num_layers < 1 or num_experts < 1:
            raise CacheRefused("invalid_geometry", f"need ≥ 1 layer and ≥ 1 expert, got "
                               f"{num_layers} × {num_experts}", num_layers=num_layers,
                               num_experts=num_experts)
        if not _is_int(capacity) or capacity < 1:
            raise CacheRefused("below_floor", f"capacity {capacity} < 1 slot", capacity=capacity, floor=1)
        ranker = _RANKERS.get(policy) or _FIXED_HORIZON.get(policy)
        if ranker is None:
            raise CacheRefused("unknown_policy", f"unknown policy {policy!r}; choose from {POLICIES}",
                               policy=policy, choices=POLICIES)
        self.num_layers = num_layers
        self.num_experts = num_experts
        self._capacity = capacity
        self._slot_of: dict[int, int] = {}
        self._owner: list[int | None] = [None] * capacity
        self._free: list[int] = list(range(capacity))  # a heap: lowest free slot first
        self._history = RoutingHistory(num_layers, num_experts)
        # Per layer: calls, hits, misses, fetched, bypassed (the fields of CacheStats).
        self._counters = [[0] * 5 for _ in range(num_layers)]
        self._ranker = ranker(self._history, capacity)
        overrides_touch = type(self._ranker).touch is not Ranker.touch
        self._touch = self._ranker.touch if overrides_touch else None

    # --- read-only views ----------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def policy(self) -> str:
        return self._ranker.name

    @property
    def resident_count(self) -> int:
        return len(self._slot_of)

    def policy_info(self) -> dict[str, object]:
        """The policy's adaptive state, e.g. horizon's current ``lambda`` and ``switches``;
        empty for the fixed policies. Mutates nothing."""
        return {"policy": self.policy, **self._ranker.info()}

    def slot_of(self, layer: int, expert: int) -> int | None:
        """The slot holding ``(layer, expert)``, or None. Mutates nothing; refuses out-of-range ids."""
        self._check_layer(layer)
        self._check_experts(layer, (expert,))
        return self._slot_of.get(layer * self.num_experts + expert)

    def occupant(self, slot: int) -> tuple[int, int] | None:
        """``(layer, expert)`` in ``slot``, or None when empty. Refuses ``slot_out_of_range``."""
        self._check_slot(slot)
        flat = self._owner[slot]
        return None if flat is None else divmod(flat, self.num_experts)

    def residency_map(self) -> list[list[int | None]]:
        """``[layer][expert] → slot`` or None (the telemetry ``residency`` field)."""
        grid: list[list[int | None]] = [[None] * self.num_experts for _ in range(self.num_layers)]
        for flat, slot in self._slot_of.items():
            layer, expert = divmod(flat, self.num_experts)
            grid[layer][expert] = slot
        return grid

    def recency_map(self) -> list[list[int | None]]:
        """``[layer][expert] →`` visits of that layer since the expert was last routed (0 = in
        the latest visit); None if never routed."""
        grid: list[list[int | None]] = []
        for layer in range(self.num_layers):
            base = layer * self.num_experts
            passes = self._history.passes[layer]
            grid.append([None if (p := self._history.last_pass[base + e]) is None else passes - p
                         for e in range(self.num_experts)])
        return grid

    def stats(self) -> CacheStats:
        """Global counters: the exact sum of `layer_stats` over all layers."""
        total = CacheStats()
        for s in self.per_layer_stats():
            total = total + s
        return total

    def layer_stats(self, layer: int) -> CacheStats:
        self._check_layer(layer)
        return CacheStats(*self._counters[layer])

    def per_layer_stats(self) -> list[CacheStats]:
        return [CacheStats(*c) for c in self._counters]

    def reset_stats(self) -> None:
        """Zero the counters. Residency, recency and the policy's ordering are kept."""
        self._counters = [[0] * 5 for _ in range(self.num_layers)]

    # --- the verbs ----------------------------------------------------------------------

    def ensure(self, layer: int, expert_ids: Sequence[int] | Iterable[int],
               fetch_limit: int | Callable[[int], int] | None = None) -> ExpertPlan:
        """Decide where each routed expert of ``layer`` is computed this call.

        Hits keep their slots. Misses are admitted in the policy's fetch order (the most
        valuable first), at most ``fetch_limit`` of them (None = all; a callable is given the
        number of distinct misses and returns the limit, e.g. ``QStarPolicy.fetch_count``;
        the limit is decided before anything changes): each takes the lowest
        free slot, or evicts the policy's victim. A slot that holds an expert routed in this
        call is never a victim. Misses beyond ``fetch_limit``, or beyond the slots that are
        not protected, get ``None`` (compute on the CPU). Duplicated ids collapse to one
        entry.

        Mutates the residency, the policy's ordering, the recency and the counters.
        Refuses with `CacheRefused` (``layer_out_of_range``, ``expert_out_of_range``,
        ``invalid_fetch_limit``) before any state changes.
        """
        layer, routed = self._checked_call(layer, expert_ids)
        base = layer * self.num_experts
        slot_of = self._slot_of
        flats = [base + e for e in dict.fromkeys(routed)]  # distinct, in routing order
        missed = [flat for flat in flats if flat not in slot_of]
        budget = len(missed) if fetch_limit is None else self._fetch_budget(fetch_limit, len(missed))
        self._begin_call(layer)
        ranker = self._ranker

        touch = self._touch
        if touch is not None:
            for flat in flats:
                if flat in slot_of:
                    touch(flat)
        copies: list[tuple[int, int]] = []
        evicted: list[tuple[int, int]] = []
        bypassed: list[int] = []
        if missed:
            if budget < len(missed) or len(flats) > self._capacity:
                # Not every miss gets a slot: the policy's most valuable misses go first.
                missed.sort(key=lambda f: (tuple(-v for v in ranker.fetch_priority(f)), f))
            # Never a victim: the routed experts that are resident (a routed expert that is
            # not resident is no candidate anyway).
            protected = set(flats)
            for flat in missed:
                slot = self._take_slot(layer, protected, evicted) if len(copies) < budget else None
                if slot is None:
                    bypassed.append(flat - base)
                    continue
                slot_of[flat] = slot
                self._owner[slot] = flat
                ranker.admit(flat)
                copies.append((slot, flat - base))

        self._end_call(layer, flats)  # recency and counts after the decisions: this call is "now"
        counters = self._counters[layer]
        counters[0] += 1
        counters[1] += len(flats) - len(missed)
        counters[2] += len(missed)
        counters[3] += len(copies)
        counters[4] += len(bypassed)
        return _plan(layer=layer, expert_ids=routed, slots=[slot_of.get(base + e) for e in routed],
                     copies=copies, hits=len(flats) - len(missed), misses=len(missed),
                     bypassed=tuple(sorted(bypassed)) if bypassed else (), evicted=evicted)

    def record_hits(self, layer: int, expert_ids: Sequence[int] | Iterable[int]) -> int:
        """Count a call of ``layer`` whose routed experts all hold slots, exactly as `ensure`
        would plan it (the same recency, counts, policy order and counters), without building a
        plan: every expert keeps its slot and nothing is copied. Returns the distinct experts
        counted (the call's hits).

        A compiled decode step serves most calls from its slot table and settles them here after
        the step (``engine/experts/resident.py``): ~30 calls a token, each a pure hit by
        construction, so the plan `ensure` builds and the engine validates would say nothing.

        Refuses with `CacheRefused` (``layer_out_of_range``, ``expert_out_of_range``,
        ``not_resident``: a routed expert has no slot, so the call is no pure hit) before any
        state changes.
        """
        layer, routed = self._checked_call(layer, expert_ids)
        base = layer * self.num_experts
        slot_of = self._slot_of
        flats = [base + e for e in dict.fromkeys(routed)]
        missing = [flat - base for flat in flats if flat not in slot_of]
        if missing:
            raise CacheRefused("not_resident", f"layer {layer}: experts {missing} hold no slot",
                               layer=layer, experts=tuple(missing))
        self._begin_call(layer)
        touch = self._touch
        if touch is not None:
            for flat in flats:
                touch(flat)
        self._end_call(layer, flats)
        counters = self._counters[layer]
        counters[0] += 1
        counters[1] += len(flats)
        return len(flats)

    def _checked_call(self, layer: int,
                      expert_ids: Sequence[int] | Iterable[int]) -> tuple[int, tuple[int, ...]]:
        """``(layer, routed ids)`` of a call, checked and converted to ints; refuses out-of-range ids."""
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            self._check_layer(layer)
            layer = operator.index(layer)
        routed = tuple(expert_ids)
        n_experts = self.num_experts
        for e in routed:
            if type(e) is not int or not 0 <= e < n_experts:  # the rare case: check and convert
                self._check_experts(layer, routed)
                return layer, tuple(operator.index(e) for e in routed)
        return layer, routed

    def _begin_call(self, layer: int) -> None:
        """A call of ``layer`` starts: it is the latest call and its layer's latest pass."""
        history = self._history
        history.calls += 1
        history.passes[layer] += 1
        history.latest_layer = layer

    def _end_call(self, layer: int, flats: list[int]) -> None:
        """The call's routed ``flats`` were used now: their recency and counts, then the policy's."""
        history = self._history
        calls, passes = history.calls, history.passes[layer]
        last_call, last_pass, count = history.last_call, history.last_pass, history.count
        for flat in flats:
            last_call[flat] = calls
            last_pass[flat] = passes
            count[flat] += 1
        self._ranker.end(flats)

    def forget_slot(self, slot: int) -> tuple[int, int] | None:
        """Mark ``slot`` empty after its copy failed; it becomes the first slot to be reused.

        Returns the ``(layer, expert)`` that lost residency (None if the slot was empty).
        Mutates the residency only. Refuses ``slot_out_of_range`` before any change.
        """
        self._check_slot(slot)
        flat = self._owner[slot]
        if flat is None:
            return None
        self._drop(flat)
        return divmod(flat, self.num_experts)

    def resize(self, capacity: int) -> ResizePlan:
        """Change the pool to ``capacity`` slots, keeping the hottest experts.

        Shrinking evicts in the policy's own eviction order until the residents fit, then
        moves the survivors that sit at or above ``capacity`` into freed slots below it.
        Growing adds empty slots. Mutates the residency and the policy; keeps recency and
        counters. Refuses ``below_floor`` (capacity < 1) before any change.
        """
        if not _is_int(capacity) or capacity < 1:
            raise CacheRefused("below_floor", f"capacity {capacity} < 1 slot", capacity=capacity, floor=1)
        old = self._capacity
        dropped: list[tuple[int, int]] = []
        moves: list[tuple[int, int]] = []
        ranker = self._ranker
        if capacity < old:
            ranker.resize(capacity)
            while len(self._slot_of) > capacity or (
                    isinstance(ranker, LayerLRU) and ranker.shrink_victim() is not None):
                if isinstance(ranker, LayerLRU):
                    flat = ranker.shrink_victim()
                else:
                    flat = ranker.victim(self._history.latest_layer, set())
                assert flat is not None, "an unprotected victim always exists while shrinking"
                self._drop(flat)
                dropped.append(divmod(flat, self.num_experts))
            free_low = sorted(s for s in range(capacity) if self._owner[s] is None)
            for src in range(capacity, old):
                flat = self._owner[src]
                if flat is None:
                    continue
                dst = free_low.pop(0)
                moves.append((src, dst))
                self._owner[dst] = flat
                self._slot_of[flat] = dst
            del self._owner[capacity:]
            self._free = [s for s in range(capacity) if self._owner[s] is None]
            heapq.heapify(self._free)
        elif capacity > old:
            self._owner.extend([None] * (capacity - old))
            for s in range(old, capacity):
                heapq.heappush(self._free, s)
            ranker.resize(capacity)
        self._capacity = capacity
        return ResizePlan(old_capacity=old, capacity=capacity, moves=moves, dropped=dropped)

    def check_integrity(self) -> None:
        """Raise `CacheIntegrityError` naming the counts when the maps or free list disagree.

        The slot→expert and expert→slot maps must be mutual inverses, every slot is either
        free or owned, and the per-layer counters must be internally consistent. Mutates nothing.
        """
        for flat, slot in self._slot_of.items():
            if not 0 <= slot < self._capacity or self._owner[slot] != flat:
                raise CacheIntegrityError(f"expert {flat} → slot {slot}, but that slot holds "
                                          f"{self._owner[slot] if 0 <= slot < self._capacity else '—'}")
        owned = sum(1 for f in self._owner if f is not None)
        if owned != len(self._slot_of):
            raise CacheIntegrityError(f"{owned} owned slots vs {len(self._slot_of)} resident experts")
        free = set(self._free)
        if len(free) != len(self._free) or any(self._owner[s] is not None for s in free):
            raise CacheIntegrityError(f"free list {sorted(self._free)} repeats or holds owned slots")
        if len(free) + owned != self._capacity:
            raise CacheIntegrityError(f"free {len(free)} + owned {owned} ≠ capacity {self._capacity}")
        for layer, s in enumerate(self.per_layer_stats()):
            if s.misses != s.fetched + s.bypassed:
                raise CacheIntegrityError(f"layer {layer}: misses {s.misses} ≠ fetched {s.fetched} "
                                          f"+ bypassed {s.bypassed}")

    # --- internals ----------------------------------------------------------------------

    def _fetch_budget(self, fetch_limit: int | Callable[[int], int] | None, missing: int) -> int:
        limit = fetch_limit(missing) if callable(fetch_limit) else fetch_limit
        if limit is None:
            return missing
        if not _is_int(limit) or limit < 0:
            raise CacheRefused("invalid_fetch_limit", f"fetch_limit {limit!r} must be None or an "
                               f"integer ≥ 0", fetch_limit=limit, missing=missing)
        return min(operator.index(limit), missing)

    def _take_slot(self, layer: int, protected: set[int], evicted: list[tuple[int, int]]) -> int | None:
        ranker = self._ranker
        if self._free and not ranker.must_evict(layer):
            return heapq.heappop(self._free)
        flat = ranker.victim(layer, protected)
        if flat is None:
            return None
        slot = self._slot_of[flat]
        self._drop(flat, free=False)
        evicted.append(divmod(flat, self.num_experts))
        return slot

    def _drop(self, flat: int, free: bool = True) -> None:
        slot = self._slot_of.pop(flat)
        self._owner[slot] = None
        self._ranker.remove(flat)
        if free:
            heapq.heappush(self._free, slot)

    def _check_layer(self, layer: int) -> None:
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise CacheRefused("layer_out_of_range", f"layer {layer!r} not in [0, {self.num_layers})",
                               layer=layer, num_layers=self.num_layers)

    def _check_experts(self, layer: int, experts: Sequence[int]) -> None:
        n = self.num_experts
        for e in experts:
            if type(e) is int and 0 <= e < n:
                continue  # the common case, checked without a call
            if not _is_int(e) or not 0 <= e < n:
                raise CacheRefused("expert_out_of_range", f"expert {e!r} of layer {layer} not in "
                                   f"[0, {self.num_experts})", layer=layer, expert=e,
                                   num_experts=self.num_experts)

    def _check_slot(self, slot: int) -> None:
        if not _is_int(slot) or not 0 <= slot < self._capacity:
            raise CacheRefused("slot_out_of_range", f"slot {slot!r} not in [0, {self._capacity})",
                               slot=slot, capacity=self._capacity)


def _is_int(value: object) -> bool:
    # bool is an int subclass; a True layer index is a bug, not layer 1. Accept numpy/torch
    # integer scalars through __index__.
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    try:
        value.__index__()  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return False
    return True
