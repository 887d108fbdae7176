"""The eviction policies of `ExpertCache`: each ranker orders the resident experts.

A ranker only orders the residents; the cache owns the maps, the free list and the
counters, and writes the `RoutingHistory` the rankers read. Flat ids are
``layer * num_experts + expert``. The cache calls, per ensure: ``touch(flat)`` for each
hit (only rankers that override it), then for each admitted miss ``victim(layer,
protected)`` (only when no free slot may be used) and ``admit(flat)``, then
``end(flats)`` once the recency and counts are updated. The horizon ranker, the default,
lives in `horizon`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict


class RoutingHistory:
    """What the rankers read about past routing; written only by `ExpertCache.ensure`.

    ``passes[layer]``: ensure calls of that layer so far; per flat id, ``last_call`` (the
    global call index of its last route), ``last_pass`` (that layer's pass index then) and
    ``count`` (routes over the whole history, distinct per call); ``latest_layer``: the
    layer of the latest call (as if the last layer had just run, before any).
    """

    __slots__ = ("calls", "count", "last_call", "last_pass", "latest_layer", "num_experts",
                 "num_layers", "passes")

    def __init__(self, num_layers: int, num_experts: int) -> None:
        n = num_layers * num_experts
        self.num_layers, self.num_experts = num_layers, num_experts
        self.calls = 0  # ensure calls so far, all layers
        self.passes = [0] * num_layers
        self.last_call: list[int | None] = [None] * n
        self.last_pass: list[int | None] = [None] * n
        self.count = [0] * n
        self.latest_layer = num_layers - 1


class Ranker:
    """The base every policy derives from: it orders the residents; the defaults do nothing."""

    name = ""

    def __init__(self, history: RoutingHistory, capacity: int) -> None:
        self.h = history

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

    def fetch_priority(self, flat: int) -> tuple[float, ...]:
        """Sort key, larger first: which misses to fetch when ``fetch_limit`` caps them."""
        last = self.h.last_call[flat]
        return (-1 if last is None else last,)

    def resize(self, capacity: int) -> None:
        """The pool size changes to ``capacity`` (after the shrink's evictions)."""

    def info(self) -> dict[str, object]:
        """The policy's own state worth showing (read-only)."""
        return {}


class GlobalLRU(Ranker):
    """Evict the expert least recently routed, over all layers."""

    name = "lru"

    def __init__(self, history: RoutingHistory, capacity: int) -> None:
        super().__init__(history, capacity)
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


class PerLayerRecency(Ranker):
    """The residents of each layer in recency order (least recent first); picks no victim itself."""

    def __init__(self, history: RoutingHistory, capacity: int) -> None:
        super().__init__(history, capacity)
        self.orders = [OrderedDict[int, None]() for _ in range(history.num_layers)]

    def touch(self, flat: int) -> None:
        self.orders[flat // self.h.num_experts].move_to_end(flat)

    def admit(self, flat: int) -> None:
        self.orders[flat // self.h.num_experts][flat] = None

    def remove(self, flat: int) -> None:
        del self.orders[flat // self.h.num_experts][flat]


class LayerLRU(PerLayerRecency):
    """Evict the least recently routed expert of the same layer, within its fixed share."""

    name = "layer_lru"

    def __init__(self, history: RoutingHistory, capacity: int) -> None:
        super().__init__(history, capacity)
        self.quota = self._quotas(capacity)

    def _quotas(self, capacity: int) -> list[int]:
        n = self.h.num_layers
        return [capacity // n + (1 if i < capacity % n else 0) for i in range(n)]

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


class LFU(Ranker):
    """Evict the expert routed least often (whole history), ties to the least recent."""

    name = "lfu"

    def __init__(self, history: RoutingHistory, capacity: int) -> None:
        super().__init__(history, capacity)
        self.heap: list[tuple[int, int, int]] = []
        self.resident: set[int] = set()

    def _key(self, flat: int) -> tuple[int, int, int]:
        last = self.h.last_call[flat]
        return (self.h.count[flat], -1 if last is None else last, flat)

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

    def fetch_priority(self, flat: int) -> tuple[float, ...]:
        count, last, _ = self._key(flat)
        return (count, last)


class LayerAwareLRU(PerLayerRecency):
    """Per-layer recency, compared across layers by the distance to each expert's next use.

    Each layer keeps its resident experts in recency order (the last visit of that layer that
    routed them). For a candidate of layer ``m`` last routed ``age`` visits of ``m`` ago, the
    next use is predicted ``age × L + d`` layer calls ahead, where ``d`` is the distance from
    the current layer to layer ``m``'s next visit; the farthest is evicted. Only each layer's
    least recent expert can hold the maximum, so a victim costs O(L). This is the recency
    half of ``horizon`` (kept as an ablation).
    """

    name = "layer_aware_lru"

    def _horizon(self, flat: int, layer: int) -> int:
        h = self.h
        owner = flat // h.num_experts
        last = h.last_pass[flat]
        age = h.passes[owner] - (0 if last is None else last)
        dist = (owner - layer) % h.num_layers or h.num_layers
        return age * h.num_layers + dist

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

    def fetch_priority(self, flat: int) -> tuple[float, ...]:
        last = self.h.last_pass[flat]
        return (-1 if last is None else last,)
