"""The default eviction policy, ``horizon``: evict the expert whose next use is predicted
farthest away, in layer calls, across layers (see `Horizon`), with its λ picked online by
shadow caches (`Shadow`) and each λ's eviction order kept lazily (`HorizonOrder`)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Iterable

from .rankers import Ranker, RoutingHistory

_NOTHING: frozenset[int] = frozenset()
_ADMITTED = -math.inf  # the key of an expert admitted in the call under way (no heap entry yet)


class HorizonOrder:
    """One λ's eviction order over one set of residents (the real pool's, or a shadow's).

    A resident's key is ``log2(CRF_λ) + λ·last`` (see `Horizon`): it changes only when the
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

    def __init__(self, horizon: Horizon, i: int) -> None:
        history = horizon.h
        self.num_layers, self.num_experts = history.num_layers, history.num_experts
        self.lam = horizon.LAMBDAS[i]
        self.share = 1.0 - 2.0 ** -self.lam  # r = CRF · share
        self.crf = horizon.crf[i]  # shared with the other orders of the same λ
        self.last = horizon.last
        self.passes = history.passes
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
            own_key = self.key[own]
            assert own_key is not None, "a layer's head is resident"
            best_score, best_flat = self._base(layer, own_key) + n_layers, own
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
        decay: float = 2.0 ** (-self.lam * (self.passes[layer] - self.last[flat]))
        return self.crf[flat] * decay


class Shadow:
    """A fixed-λ horizon cache over the sampled experts, for the duel: it decides exactly as
    ``ExpertCache(..., policy="horizon@λ")`` fed only the sampled ids would, but keeps no
    slots (only which experts are resident) and shares the CRFs and clocks of the real cache."""

    __slots__ = ("capacity", "held", "order", "size")

    def __init__(self, horizon: Horizon, i: int, capacity: int, held: list[int]) -> None:
        self.order = HorizonOrder(horizon, i)
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


class Horizon(Ranker):
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
    only for the few layers within ``L`` of the best (`HorizonOrder`). The ``d`` term is
    what a global LRU lacks: when every expert is reused every token (the cyclic sweep) it
    evicts the layer that just ran instead of the one that runs next, and keeps
    ``capacity − k`` experts for good.

    **Adaptive λ (set dueling).** Which λ fits depends on the routing and on the cache
    size, so λ is chosen online among `LAMBDAS`. One shadow cache per candidate (`Shadow`:
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

    def __init__(self, history: RoutingHistory, capacity: int) -> None:
        super().__init__(history, capacity)
        n_layers, n = history.num_layers, history.num_layers * history.num_experts
        self.crf = [[0.0] * n for _ in self.LAMBDAS]  # per candidate λ, at the last reference
        self._log_decay = [-lam * math.log(2.0) for lam in self.LAMBDAS]  # CRF decay per visit, as ln
        # The decay factors of every λ over a gap of ``age`` visits, exp(ln-decay · age), for
        # the common small gaps (the same floats as computing them each time).
        self._decay = [tuple(math.exp(rate * age) for rate in self._log_decay)
                       for age in range(self.DECAY_TABLE)]
        self.last = [0] * n  # the layer's pass index at the last reference
        self.active = min(1, len(self.LAMBDAS) - 1)  # starts at 0.1, the best single λ measured
        self.order = HorizonOrder(self, self.active)
        # Dueling: one shadow cache per candidate λ over every layer but a hashed sample of
        # the experts (1 in `sample_rate`), with the same share of the pool. Sampling experts
        # rather than layers keeps the cross-layer competition that decides the real pool.
        dueling = len(self.LAMBDAS) > 1
        self.sample_rate = max(1, min(self.SAMPLE_RATE, n // 512))
        self.in_sample = [dueling and (flat * 2654435761) % 4294967296 % self.sample_rate == 0
                          for flat in range(n)]
        self.sample_share = sum(self.in_sample) / n
        self.held = [0] * n  # how many shadows hold each expert: all of them = no shadow misses
        self.shadows = [Shadow(self, i, self._shadow_capacity(capacity), self.held)
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

    def fetch_priority(self, flat: int) -> tuple[float, ...]:
        return (self.order.priority(flat),)

    def _shadow_capacity(self, capacity: int) -> int:
        return max(1, round(capacity * self.sample_share))

    def resize(self, capacity: int) -> None:
        for shadow in self.shadows:
            shadow.resize(self._shadow_capacity(capacity), self.h.latest_layer)

    def end(self, flats: list[int]) -> None:
        if not flats:
            return
        layer = flats[0] // self.h.num_experts
        now = self.h.passes[layer]
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
            self.order = HorizonOrder(self, best)
            self.order.adopt(residents)
