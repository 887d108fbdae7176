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
  ``_Horizon.LAMBDAS``; an ablation, not listed in `POLICIES`).
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
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from moetray.policy.refused import Refused

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
    ``invalid_fetch_limit``; the offending values are attributes named in ``fields``.
    """


class CacheIntegrityError(RuntimeError):
    """`ExpertCache.check_integrity` found the maps or counters inconsistent (a bug)."""

    kind = "integrity"


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

    def __add__(self, other: object) -> CacheStats:  # type: ignore[override]
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


# --- eviction policies ------------------------------------------------------------------
#
# A ranker only orders the resident experts; the cache owns the maps, the free list and the
# counters. Flat ids are ``layer * num_experts + expert``. The cache calls, per ensure:
# ``touch(flat)`` for each hit (only rankers that override it), then for each admitted miss
# ``victim(layer, protected)`` (only when no free slot may be used) and ``admit(flat)``,
# then ``end(flats)`` once the recency and counts are updated.


class _Ranker:
    name = ""

    def __init__(self, cache: ExpertCache) -> None:
        self.c = cache

    def touch(self, flat: int) -> None:
        """A resident expert was routed (a hit)."""

    def admit(self, flat: int) -> None:
        """A missed expert now owns a slot."""

    def remove(self, flat: int) -> None:
        """An expert lost its slot (evicted, forgotten or dropped by a resize)."""

    def end(self, flats: list[int]) -> None:
        """The call is over and the recency and counts of its routed ``flats`` are updated."""

    def must_evict(self, layer: int) -> bool:
        """True when ``layer`` may not take a free slot even if one exists (quota policies)."""
        return False

    def victim(self, layer: int, protected: set[int]) -> int | None:
        """The resident flat id to evict for a miss of ``layer``; never one in ``protected``.

        None when every candidate is protected. Mutates nothing.
        """
        raise NotImplementedError

    def fetch_priority(self, flat: int) -> tuple:
        """Sort key, larger first: which misses to fetch when ``fetch_limit`` caps them."""
        last = self.c._last_call[flat]
        return (-1 if last is None else last,)

    def resize(self, capacity: int) -> None:
        """The pool size changes to ``capacity`` (after the shrink's evictions)."""

    def info(self) -> dict[str, object]:
        """The policy's own state worth showing (read-only)."""
        return {}


class _GlobalLRU(_Ranker):
    """Evict the expert least recently routed, over all layers."""

    name = "lru"

    def __init__(self, cache: ExpertCache) -> None:
        super().__init__(cache)
        self.order: OrderedDict[int, None] = OrderedDict()

    def touch(self, flat: int) -> None:
        self.order.move_to_end(flat)

    def admit(self, flat: int) -> None:
        self.order[flat] = None

    def remove(self, flat: int) -> None:
        del self.order[flat]

    def victim(self, layer: int, protected: set[int]) -> int | None:
        for flat in self.order:
            if flat not in protected:
                return flat
        return None


class _LayerLRU(_Ranker):
    """Evict the least recently routed expert of the same layer, within its fixed share."""

    name = "layer_lru"

    def __init__(self, cache: ExpertCache) -> None:
        super().__init__(cache)
        self.orders = [OrderedDict[int, None]() for _ in range(cache.num_layers)]
        self.quota = self._quotas(cache.capacity)

    def _quotas(self, capacity: int) -> list[int]:
        n = self.c.num_layers
        return [capacity // n + (1 if i < capacity % n else 0) for i in range(n)]

    def touch(self, flat: int) -> None:
        self.orders[flat // self.c.num_experts].move_to_end(flat)

    def admit(self, flat: int) -> None:
        self.orders[flat // self.c.num_experts][flat] = None

    def remove(self, flat: int) -> None:
        del self.orders[flat // self.c.num_experts][flat]

    def must_evict(self, layer: int) -> bool:
        return len(self.orders[layer]) >= self.quota[layer]

    def victim(self, layer: int, protected: set[int]) -> int | None:
        if self.quota[layer] == 0:
            return None
        for flat in self.orders[layer]:
            if flat not in protected:
                return flat
        return None

    def shrink_victim(self) -> int | None:
        over = [(len(o) - q, i) for i, (o, q) in enumerate(zip(self.orders, self.quota, strict=True))]
        excess, layer = max(over)
        return next(iter(self.orders[layer])) if excess > 0 else None

    def resize(self, capacity: int) -> None:
        self.quota = self._quotas(capacity)


class _LFU(_Ranker):
    """Evict the expert routed least often (whole history), ties to the least recent."""

    name = "lfu"

    def __init__(self, cache: ExpertCache) -> None:
        super().__init__(cache)
        self.heap: list[tuple[int, int, int]] = []
        self.resident: set[int] = set()

    def _key(self, flat: int) -> tuple[int, int, int]:
        last = self.c._last_call[flat]
        return (self.c._count[flat], -1 if last is None else last, flat)

    def admit(self, flat: int) -> None:
        self.resident.add(flat)

    def end(self, flats: list[int]) -> None:
        for flat in flats:
            if flat in self.resident:
                heapq.heappush(self.heap, self._key(flat))

    def remove(self, flat: int) -> None:
        self.resident.discard(flat)

    def victim(self, layer: int, protected: set[int]) -> int | None:
        skipped = []
        found = None
        while self.heap:
            key = self.heap[0]
            flat = key[2]
            if flat not in self.resident or key != self._key(flat):
                heapq.heappop(self.heap)  # stale entry: the expert moved on or left
                continue
            if flat in protected:
                skipped.append(heapq.heappop(self.heap))
                continue
            found = flat
            break
        for key in skipped:
            heapq.heappush(self.heap, key)
        if len(self.heap) > 4 * (len(self.resident) + 16):
            self.heap = [self._key(f) for f in self.resident]
            heapq.heapify(self.heap)
        return found

    def fetch_priority(self, flat: int) -> tuple:
        count, last, _ = self._key(flat)
        return (count, last)


class _LayerAwareLRU(_Ranker):
    """Per-layer recency, compared across layers by the distance to each expert's next use.

    Each layer keeps its resident experts in recency order (the last visit of that layer that
    routed them). For a candidate of layer ``m`` last routed ``age`` visits of ``m`` ago, the
    next use is predicted ``age × L + d`` layer calls ahead, where ``d`` is the distance from
    the current layer to layer ``m``'s next visit; the farthest is evicted. Only each layer's
    least recent expert can hold the maximum, so a victim costs O(L). This is the recency
    half of ``horizon`` (kept as an ablation).
    """

    name = "layer_aware_lru"

    def __init__(self, cache: ExpertCache) -> None:
        super().__init__(cache)
        self.orders = [OrderedDict[int, None]() for _ in range(cache.num_layers)]

    def touch(self, flat: int) -> None:
        self.orders[flat // self.c.num_experts].move_to_end(flat)

    def admit(self, flat: int) -> None:
        self.orders[flat // self.c.num_experts][flat] = None

    def remove(self, flat: int) -> None:
        del self.orders[flat // self.c.num_experts][flat]

    def _horizon(self, flat: int, layer: int) -> int:
        c = self.c
        owner = flat // c.num_experts
        last = c._last_pass[flat]
        age = c._passes[owner] - (0 if last is None else last)
        dist = (owner - layer) % c.num_layers or c.num_layers
        return age * c.num_layers + dist

    def victim(self, layer: int, protected: set[int]) -> int | None:
        best: tuple[int, int] | None = None
        best_flat = None
        for owner, order in enumerate(self.orders):
            for flat in order:
                if flat in protected:
                    continue
                key = (self._horizon(flat, layer), -owner)
                if best is None or key > best:
                    best, best_flat = key, flat
                break
        return best_flat

    def fetch_priority(self, flat: int) -> tuple:
        last = self.c._last_pass[flat]
        return (-1 if last is None else last,)


class _HorizonOrder:
    """One λ's eviction order over one set of residents (the real pool's, or a shadow's).

    A resident's key is ``log2(CRF_λ) + λ·last`` (see `_Horizon`): it changes only when the
    expert is routed, and then it grows. So each layer's order is static between its visits
    and kept in a min-heap, and a heap entry may lag behind its expert's key: routing an
    expert pushes nothing. An entry is re-keyed only when it reaches the top of its heap
    (`_head`); since a lagging entry sits *below* its true key, the top entry, once checked
    against its true key, is the true minimum. A call where every routed expert is resident
    therefore touches no heap, and a hot expert that never nears the top is never re-keyed.

    ``key[flat]`` is None for a non-resident, `_ADMITTED` for an expert admitted in the call
    under way (it gets its entry when the call ends), and otherwise the key of its one live
    heap entry; entries that do not match it are dead (evicted or superseded) and dropped.

    The layers' heads sit in a max-heap by their base score ``L · (1/r − 1)`` (the horizon
    without the distance term), refreshed lazily for the layers marked ``dirty`` (they ran or
    lost an expert since). A victim adds the distance term only for layers whose base is
    within ``L`` of the best, so it usually looks at a few layers instead of all.
    """

    __slots__ = ("admitted", "base", "base_heap", "crf", "dirty", "head", "heaps", "key", "lam",
                 "last", "layer_count", "num_experts", "num_layers", "passes", "share")

    def __init__(self, horizon: _Horizon, i: int) -> None:
        cache = horizon.c
        self.num_layers, self.num_experts = cache.num_layers, cache.num_experts
        self.lam = horizon.LAMBDAS[i]
        self.share = 1.0 - 2.0 ** -self.lam  # r = CRF · share
        self.crf = horizon.crf[i]  # shared with the other orders of the same λ
        self.last = horizon.last
        self.passes = cache._passes
        self.key: list[float | None] = [None] * (self.num_layers * self.num_experts)
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in range(self.num_layers)]
        self.admitted: list[int] = []  # in the call under way
        self.layer_count = [0] * self.num_layers
        self.base: list[float | None] = [None] * self.num_layers
        self.head: list[int | None] = [None] * self.num_layers  # the flat the base was taken from
        self.base_heap: list[tuple[float, int]] = []  # (−base, layer), lazily invalidated
        self.dirty: set[int] = set()

    def adopt(self, residents: Iterable[int]) -> None:
        """Take ``residents`` (between calls) and key them all."""
        for flat in residents:
            self.key[flat] = 0.0  # any float: keyed by the rebuild
            self.layer_count[flat // self.num_experts] += 1
        for layer in range(self.num_layers):
            self._rebuild(layer)
        self.dirty = set(range(self.num_layers))

    def admit(self, flat: int) -> None:
        self.key[flat] = _ADMITTED
        self.admitted.append(flat)
        self.layer_count[flat // self.num_experts] += 1

    def remove(self, flat: int) -> None:
        self.key[flat] = None
        layer = flat // self.num_experts
        self.layer_count[layer] -= 1
        self.dirty.add(layer)  # it may have been the head

    def routed(self, layer: int) -> None:
        """A call of ``layer`` is over and the CRFs of its routed experts are updated: the
        experts it admitted get their heap entries. O(admitted · log)."""
        if self.admitted:
            key, crf, last, lam, heap = self.key, self.crf, self.last, self.lam, self.heaps[layer]
            for flat in self.admitted:
                k = key[flat] = math.log2(crf[flat]) + lam * last[flat]
                heapq.heappush(heap, (k, flat))
            self.admitted = []
            if len(heap) > 4 * self.layer_count[layer] + 32:
                self._rebuild(layer)
        self.dirty.add(layer)  # its passes advanced: its head's rate changed

    def _rebuild(self, layer: int) -> None:
        # Drop the dead entries: one entry per resident, at its true key.
        key, crf, last, lam = self.key, self.crf, self.last, self.lam
        start = layer * self.num_experts
        heap = []
        for flat in range(start, start + self.num_experts):
            k = key[flat]
            if k is not None and k != _ADMITTED:
                k = key[flat] = math.log2(crf[flat]) + lam * last[flat]
                heap.append((k, flat))
        heapq.heapify(heap)
        self.heaps[layer] = heap

    def _head(self, layer: int, protected: Container[int]) -> tuple[float, int] | None:
        """The minimum ``(key, flat)`` of ``layer`` outside ``protected``, or None. Re-keys the
        lagging entries it meets on the way (the order does not change)."""
        heap, key, crf, last, lam = self.heaps[layer], self.key, self.crf, self.last, self.lam
        aside, found = [], None
        while heap:
            k, flat = heap[0]
            if key[flat] != k:
                heapq.heappop(heap)  # dead: evicted or superseded
                continue
            true = math.log2(crf[flat]) + lam * last[flat]
            if true != k:  # routed since it was keyed: its key grew, sink it
                key[flat] = true
                heapq.heapreplace(heap, (true, flat))
                continue
            if flat in protected:
                aside.append(heapq.heappop(heap))
                continue
            found = (k, flat)
            break
        for item in aside:
            heapq.heappush(heap, item)
        return found

    def _base(self, layer: int, key: float) -> float:
        """``L · (1/r − 1)`` for a head with heap ``key``: the horizon without the distance term."""
        rate = 2.0 ** (key - self.lam * self.passes[layer]) * self.share
        if rate >= 1.0:
            return 0.0
        return self.num_layers * (1.0 / rate - 1.0) if rate > 0 else math.inf

    def _refresh(self, layer: int) -> None:
        head = self._head(layer, _NOTHING)
        if head is None:
            self.base[layer] = self.head[layer] = None
            return
        base = self.base[layer] = self._base(layer, head[0])
        self.head[layer] = head[1]
        heapq.heappush(self.base_heap, (-base, layer))

    def victim(self, layer: int, protected: Container[int]) -> int | None:
        """The resident with the largest horizon seen from ``layer``, not in ``protected``
        (which holds experts of ``layer`` only); None when every resident is protected.
        Mutates only the bookkeeping: refreshes the dirty layers' heads, re-keys lagging
        heap entries and drops dead ones (none of which changes the order)."""
        n_layers = self.num_layers
        if self.dirty:
            for m in self.dirty:
                self._refresh(m)
            self.dirty.clear()
        if len(self.base_heap) > 4 * n_layers + 16:
            self.base_heap = [(-b, m) for m, b in enumerate(self.base) if b is not None]
            heapq.heapify(self.base_heap)
        # Every layer's heap is unchanged since its refresh, so each layer's unprotected head
        # is the one taken then, except in ``layer`` when that head is protected.
        best_score, best_flat = -math.inf, None
        own = self.head[layer]
        if own is not None and own in protected:
            found = self._head(layer, protected)
            own = None if found is None else found[1]
        if own is not None:  # the base again: this layer's clock moved since its refresh
            best_score, best_flat = self._base(layer, self.key[own]) + n_layers, own
        base_heap, base, head, aside = self.base_heap, self.base, self.head, []
        while base_heap:
            neg, m = base_heap[0]
            if base[m] != -neg or m == layer:
                item = heapq.heappop(base_heap)
                if m == layer and base[m] == -neg:
                    aside.append(item)
                continue
            if -neg + n_layers <= best_score:
                break  # no layer below can beat the best, whatever its distance
            aside.append(heapq.heappop(base_heap))
            score = -neg + ((m - layer) % n_layers or n_layers)
            if score > best_score:
                best_score, best_flat = score, head[m]
        for item in aside:
            heapq.heappush(base_heap, item)
        return best_flat

    def priority(self, flat: int) -> float:
        """The expert's current CRF (decayed to now): which misses to fetch first."""
        layer = flat // self.num_experts
        return self.crf[flat] * 2.0 ** (-self.lam * (self.passes[layer] - self.last[flat]))


_NOTHING: frozenset[int] = frozenset()
_ADMITTED = -math.inf  # the key of an expert admitted in the call under way (no heap entry yet)


class _Shadow:
    """A fixed-λ horizon cache over the sampled experts, for the duel: it decides exactly as
    ``ExpertCache(..., policy="horizon@λ")`` fed only the sampled ids would, but keeps no
    slots (only which experts are resident) and shares the CRFs and clocks of the real cache."""

    __slots__ = ("capacity", "held", "order", "size")

    def __init__(self, horizon: _Horizon, i: int, capacity: int, held: list[int]) -> None:
        self.order = _HorizonOrder(horizon, i)
        self.capacity = capacity
        self.size = 0
        self.held = held  # per expert, how many shadows hold it (shared by all of them)

    def decide(self, layer: int, flats: list[int]) -> int:
        """Admit this call's sampled ``flats`` (distinct; CRFs not yet updated), evicting by
        the shadow's order; returns how many were not resident (its misses)."""
        order = self.order
        key = order.key
        missed = [f for f in flats if key[f] is None]
        if not missed:
            return 0
        if len(flats) > self.capacity:  # not every miss can get a slot: most valuable first
            missed.sort(key=lambda f: (-order.priority(f), f))
        protected = set(flats)  # the hits and the admitted (a missing flat is never a candidate)
        for flat in missed:
            if self.size < self.capacity:
                self.size += 1
            else:
                out = order.victim(layer, protected)
                if out is None:
                    continue  # computed on the CPU
                order.remove(out)
                self.held[out] -= 1
            order.admit(flat)
            self.held[flat] += 1
        return len(missed)

    def resize(self, capacity: int, latest_layer: int) -> None:
        while self.size > capacity:
            out = self.order.victim(latest_layer, _NOTHING)
            assert out is not None, "an unprotected victim always exists while shrinking"
            self.order.remove(out)
            self.held[out] -= 1
            self.size -= 1
        self.capacity = capacity


class _Horizon(_Ranker):
    """Evict the expert whose next use is predicted farthest away, in layer calls, across layers.

    **Reuse rate.** Every (layer, expert) carries a combined recency-frequency value (LRFU's
    CRF): each visit of its layer that routes it adds 1, and the value halves every ``1/λ``
    visits of its layer. ``CRF · (1 − 2^−λ)`` estimates the share ``r`` of the layer's visits
    that route the expert (1 for an expert routed every visit). Small λ behaves like LFU,
    λ = 1 like LRU.

    **Horizon.** An expert of layer ``m`` is predicted to be needed next after
    ``d + L · (1/r − 1)`` layer calls, where ``d`` is the distance from the current layer to
    layer ``m``'s next visit. The largest horizon is evicted. Because a layer's experts all
    decay at the same rate between its visits, each layer's order is static and kept in a
    heap; the layers' heads sit in a max-heap by ``L · (1/r − 1)``, and a victim adds ``d``
    only for the few layers within ``L`` of the best (`_HorizonOrder`). The ``d`` term is
    what a global LRU lacks: when every expert is reused every token (the cyclic sweep) it
    evicts the layer that just ran instead of the one that runs next, and keeps
    ``capacity − k`` experts for good.

    **Adaptive λ (set dueling).** Which λ fits depends on the routing and on the cache
    size, so λ is chosen online among `LAMBDAS`. One shadow cache per candidate (`_Shadow`:
    a fixed-λ ``"horizon@λ"`` planner without slots) follows a hashed sample of the experts
    (1 in `SAMPLE_RATE`) of every layer, with the same share of the pool, and counts the
    misses it would have had, fading with a time constant of `MEMORY_TOKENS` forward steps.
    Sampling experts rather than layers keeps the cross-layer competition that decides a
    shared pool (a sample of 4 layers out of 30 picked the wrong λ on a real-text trace).
    Every `PERIOD_TOKENS` steps the real cache adopts the candidate with the fewest shadow
    misses if it beats the active one by `MARGIN` (re-keying its residents, O(residents · log)).

    **Cost.** The CRFs of every candidate λ are kept once, for all experts, and shared by
    the real order and the shadows. A call where every routed expert is resident (in the
    real pool and in every shadow) costs the CRF updates and a dirty mark per order: no heap
    is touched until a victim is needed, and then only the heads are re-keyed.
    """

    name = "horizon"
    LAMBDAS = (0.02, 0.1, 0.3, 1.0)
    SAMPLE_RATE = 8  # shadows follow at most 1 in 8 experts, and all of them under 1024
    PERIOD_TOKENS = 8  # forward steps (L calls each) between decisions
    MEMORY_TOKENS = 50  # shadow miss counts fade with this time constant, in forward steps
    MARGIN = 0.03  # switch only when a candidate missed ≥ 3 % less than the active λ
    DECAY_TABLE = 256  # gaps (in visits of a layer) whose decay factors are tabulated

    def __init__(self, cache: ExpertCache) -> None:
        super().__init__(cache)
        n_layers, n = cache.num_layers, cache.num_layers * cache.num_experts
        self.crf = [[0.0] * n for _ in self.LAMBDAS]  # per candidate λ, at the last reference
        self._log_decay = [-lam * math.log(2.0) for lam in self.LAMBDAS]  # CRF decay per visit, as ln
        # The decay factors of every λ over a gap of ``age`` visits, exp(ln-decay · age), for
        # the common small gaps (the same floats as computing them each time).
        self._decay = [tuple(math.exp(rate * age) for rate in self._log_decay)
                       for age in range(self.DECAY_TABLE)]
        self.last = [0] * n  # the layer's pass index at the last reference
        self.active = min(1, len(self.LAMBDAS) - 1)  # starts at 0.1, the best single λ measured
        self.order = _HorizonOrder(self, self.active)
        # Dueling: one shadow cache per candidate λ over every layer but a hashed sample of
        # the experts (1 in `sample_rate`), with the same share of the pool. Sampling experts
        # rather than layers keeps the cross-layer competition that decides the real pool.
        dueling = len(self.LAMBDAS) > 1
        self.sample_rate = max(1, min(self.SAMPLE_RATE, n // 512))
        self.in_sample = [dueling and (flat * 2654435761) % 4294967296 % self.sample_rate == 0
                          for flat in range(n)]
        self.sample_share = sum(self.in_sample) / n
        self.held = [0] * n  # how many shadows hold each expert: all of them = no shadow misses
        self.shadows = [_Shadow(self, i, self._shadow_capacity(cache.capacity), self.held)
                        for i in range(len(self.LAMBDAS))] if dueling else []
        self.shadow_misses = [0.0] * len(self.LAMBDAS)
        self.calls_seen = 0
        self.forget = 1.0 - 1.0 / (self.MEMORY_TOKENS * n_layers)
        self.period = self.PERIOD_TOKENS * n_layers
        self.switches = 0

    @property
    def lam(self) -> float:
        return self.LAMBDAS[self.active]

    def admit(self, flat: int) -> None:
        self.order.admit(flat)

    def remove(self, flat: int) -> None:
        self.order.remove(flat)

    def victim(self, layer: int, protected: set[int]) -> int | None:
        return self.order.victim(layer, protected)

    def fetch_priority(self, flat: int) -> tuple:
        return (self.order.priority(flat),)

    def _shadow_capacity(self, capacity: int) -> int:
        return max(1, round(capacity * self.sample_share))

    def resize(self, capacity: int) -> None:
        for shadow in self.shadows:
            shadow.resize(self._shadow_capacity(capacity), self.c._latest_layer)

    def end(self, flats: list[int]) -> None:
        if not flats:
            return
        layer = flats[0] // self.c.num_experts
        now = self.c._passes[layer]
        sampled: list[int] = []
        if self.shadows:  # what each candidate λ would have missed on this call's sample
            in_sample = self.in_sample
            sampled = flats if self.sample_rate == 1 else [flat for flat in flats if in_sample[flat]]
            forget = self.forget
            if sampled and min(map(self.held.__getitem__, sampled)) < len(self.shadows):
                misses = self.shadow_misses  # decided on the CRFs before this call, as the real cache did
                for i, shadow in enumerate(self.shadows):
                    misses[i] = misses[i] * forget + shadow.decide(layer, sampled)
            else:  # no shadow misses (the common warm call): only the fading
                self.shadow_misses = [m * forget for m in self.shadow_misses]
        self._update_crf(flats, now)
        self.order.routed(layer)
        if sampled:
            for shadow in self.shadows:
                shadow.order.routed(layer)
        if self.shadows:
            self.calls_seen += 1
            if self.calls_seen % self.period == 0:
                self._switch()

    def _update_crf(self, flats: list[int], now: int) -> None:
        """CRF ← 1 + CRF · 2^(−λ · visits since the last reference), for every candidate λ."""
        last, crfs, decay = self.last, self.crf, self._decay
        size = len(decay)
        if len(crfs) == 4:  # the default candidates, unrolled: this runs on every call
            c0, c1, c2, c3 = crfs
            for flat in flats:
                age = now - last[flat]
                f0, f1, f2, f3 = decay[age] if age < size else self._factors(age)
                c0[flat] = 1.0 + c0[flat] * f0
                c1[flat] = 1.0 + c1[flat] * f1
                c2[flat] = 1.0 + c2[flat] * f2
                c3[flat] = 1.0 + c3[flat] * f3
                last[flat] = now
            return
        for flat in flats:
            age = now - last[flat]
            factors = decay[age] if age < size else self._factors(age)
            for crf, factor in zip(crfs, factors, strict=True):
                crf[flat] = 1.0 + crf[flat] * factor
            last[flat] = now

    def _factors(self, age: int) -> tuple[float, ...]:
        return tuple(math.exp(rate * age) for rate in self._log_decay)

    def info(self) -> dict[str, object]:
        return {"lambda": self.lam, "switches": self.switches,
                "shadow_misses": dict(zip(self.LAMBDAS, (round(m, 3) for m in self.shadow_misses),
                                          strict=True))}

    def _switch(self) -> None:
        """Adopt the candidate λ whose shadows missed least (ties keep the current one)."""
        best = min(range(len(self.LAMBDAS)), key=lambda i: (self.shadow_misses[i], i != self.active))
        if self.shadow_misses[best] < self.shadow_misses[self.active] * (1.0 - self.MARGIN):
            residents = [flat for flat, k in enumerate(self.order.key) if k is not None]
            self.active = best
            self.switches += 1
            self.order = _HorizonOrder(self, best)
            self.order.adopt(residents)


_RANKERS: dict[str, type[_Ranker]] = {
    r.name: r for r in (_Horizon, _GlobalLRU, _LayerLRU, _LFU, _LayerAwareLRU)
}
POLICIES: tuple[str, ...] = tuple(_RANKERS)
# Fixed-λ horizon variants, ``"horizon@<λ>"``: the shadows of the dueling policy, and ablations.
# Accepted by `ExpertCache` but not listed in POLICIES.
_FIXED_HORIZON: dict[str, type[_Ranker]] = {
    f"horizon@{lam}": type(f"_Horizon_{i}", (_Horizon,), {"name": f"horizon@{lam}", "LAMBDAS": (lam,)})
    for i, lam in enumerate(_Horizon.LAMBDAS)
}
"""Every policy name `ExpertCache` accepts; the first is the default."""


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
        n = num_layers * num_experts
        self._slot_of: dict[int, int] = {}
        self._owner: list[int | None] = [None] * capacity
        self._free: list[int] = list(range(capacity))  # a heap: lowest free slot first
        self._calls = 0  # ensure calls so far, all layers
        self._passes = [0] * num_layers  # ensure calls so far, per layer
        self._last_call: list[int | None] = [None] * n  # global call index of the last route
        self._last_pass: list[int | None] = [None] * n  # that layer's pass index of the last route
        self._count = [0] * n  # routes over the whole history (distinct per call)
        self._latest_layer = num_layers - 1  # as if the last layer had just run
        # Per layer: calls, hits, misses, fetched, bypassed (the fields of CacheStats).
        self._counters = [[0] * 5 for _ in range(num_layers)]
        self._ranker = ranker(self)
        overrides_touch = type(self._ranker).touch is not _Ranker.touch
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
            passes = self._passes[layer]
            grid.append([None if (p := self._last_pass[base + e]) is None else passes - p
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
        n_experts = self.num_experts
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            self._check_layer(layer)
            layer = operator.index(layer)
        routed = tuple(expert_ids)
        for e in routed:
            if type(e) is not int or not 0 <= e < n_experts:  # the rare case: check and convert
                self._check_experts(layer, routed)
                routed = tuple(operator.index(e) for e in routed)
                break
        base = layer * n_experts
        slot_of = self._slot_of
        flats = [base + e for e in dict.fromkeys(routed)]  # distinct, in routing order
        missed = [flat for flat in flats if flat not in slot_of]
        budget = len(missed) if fetch_limit is None else self._fetch_budget(fetch_limit, len(missed))
        self._calls += 1
        passes = self._passes[layer] = self._passes[layer] + 1
        self._latest_layer = layer
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

        # Recency and counts after the decisions: this call is "now".
        calls, last_call, last_pass, count = self._calls, self._last_call, self._last_pass, self._count
        for flat in flats:
            last_call[flat] = calls
            last_pass[flat] = passes
            count[flat] += 1
        ranker.end(flats)
        counters = self._counters[layer]
        counters[0] += 1
        counters[1] += len(flats) - len(missed)
        counters[2] += len(missed)
        counters[3] += len(copies)
        counters[4] += len(bypassed)
        return _plan(layer=layer, expert_ids=routed, slots=[slot_of.get(base + e) for e in routed],
                     copies=copies, hits=len(flats) - len(missed), misses=len(missed),
                     bypassed=tuple(sorted(bypassed)) if bypassed else (), evicted=evicted)

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
                    isinstance(ranker, _LayerLRU) and ranker.shrink_victim() is not None):
                if isinstance(ranker, _LayerLRU):
                    flat = ranker.shrink_victim()
                else:
                    flat = ranker.victim(self._latest_layer, set())
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
