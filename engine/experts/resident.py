"""Where a compiled decode step finds a layer's experts without planning the call.

A layer call whose routed experts are all resident has nothing to decide: every expert keeps its
slot, nothing is copied, and the planner only counts the call. So in a compiled step each layer
looks its routed experts up in :attr:`ResidentSlots.table` (``[layer, expert] → slot``, −1 where
not resident, kept equal to the planner's residency map; one more column, always −1, for an id
past the experts, an expert-parallel sentinel) inside the graph, and tests "every routed expert
has a slot". ``moetray::expert_slots`` then returns the looked-up slots and keeps the call's
routing for the planner, or, where a slot is missing, plans the call (copies the misses in) as
before.

The planner still sees every call, in the same order: the calls served from the table are
*settled* (counted as the pure hits they are by construction, ``ExpertCache.record_hits``: the
bookkeeping ``ensure`` does for a hit, without a plan to build, validate and apply) before the next
call the operator plans, and the rest right after the step. So its state (recency, counts, the
policy's order) is what planning each call in turn would have made it, and every miss is decided on
that state. Settling as plans took ~1.0 ms of a ~13 ms int8 decode step of one request on the demo
(30 calls); counted, ~0.63 ms (same host, served, the step's own timer).

On CPU, where ``served_calls.cpp`` is built (with the few-rows kernels), the operator is C++: a
served call is appended to its runtime's log without the GIL or a boxed Python call, and a call that
misses goes to the Python ``moetray::expert_slots_planned``. Measured on the demo in int8, one
request of 64 tokens at a time, three pairs of processes interleaved, median tok/s of 6 requests,
the C++ operator against the Python one: 86.5 / 79.3, 107.1 / 94.7, 101.9 / 95.6.

Rules:

- Calls are settled in the order they ran, each once; a step that fails is forgotten (its eager
  rerun plans every layer again).
- A settled call that would not be a pure hit means the table lied: a bug, raised as
  ``CacheIntegrityError``.

Tried and not kept: a ``torch.cond`` around the operator (each branch is a subgraph inductor
compiles on its own: on the demo, 30 layers and three graphs, a cold start's step compilation
took 421 s against 301), and the routing written to a log tensor inside the graph (379 s).
"""

from __future__ import annotations

import torch

from moetray.engine.experts.opaque import expert_slots_op
from moetray.engine.models import few_rows

__all__ = ["ResidentSlots", "ServedCall", "read_served_calls"]

ServedCall = tuple[int, list[int], int]
"""A call the table served: its layer, its distinct routed experts ascending, its tokens."""

NOT_RESIDENT = -1
"""A table entry whose expert has no slot."""


class ResidentSlots:
    """The slot table one runtime's compiled steps read, and the calls it served not yet settled."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.table = torch.full((num_layers, num_experts + 1), NOT_RESIDENT, dtype=torch.long)
        self.pending: list[ServedCall] = []  # the Python operator's served calls, in order

    # --- kept equal to the planner's residency ---------------------------------------------

    def admit(self, layer: int, expert: int, slot: int) -> None:
        self.table[layer, expert] = slot

    def drop(self, layer: int, expert: int) -> None:
        self.table[layer, expert] = NOT_RESIDENT

    def rebuild(self, residency: list[list[int | None]]) -> None:
        """Take the planner's whole map (after a resize)."""
        rows = [[NOT_RESIDENT if s is None else s for s in row] + [NOT_RESIDENT] for row in residency]
        self.table.copy_(torch.tensor(rows, dtype=torch.long))

    def disagreements(self, residency: list[list[int | None]]) -> list[tuple[int, int]]:
        """``(layer, expert)`` pairs whose table entry is not the planner's slot. Mutates nothing."""
        table = self.table.tolist()
        return [(layer, expert) for layer, row in enumerate(residency)
                for expert, slot in enumerate([*row, None])  # the sentinels' column: never resident
                if table[layer][expert] != (NOT_RESIDENT if slot is None else slot)]

    # --- in the graph ---------------------------------------------------------------------

    def traced(self, top_k_index: torch.Tensor, runtime: int, layer: int) -> torch.Tensor:
        """``[T, k]`` routed experts → ``[T, k]`` slots, traced into a compiled step: looked up in
        the graph; ``moetray::expert_slots`` plans the call only where some routed expert has no
        slot (a sentinel has none; the operator refuses it)."""
        looked = self.table[layer][top_k_index]
        return expert_slots_op(top_k_index, looked, (looked >= 0).all(), runtime, layer)

    def served(self, layer: int, top_k_index: torch.Tensor, looked_up: torch.Tensor) -> torch.Tensor:
        """The Python operator's answer for a call the table served: its slots, the call kept."""
        pairs = top_k_index.tolist()
        self.pending.append((layer, sorted({expert for row in pairs for expert in row}), len(pairs)))
        return looked_up.clone()  # an operator's output may not alias its input

    # --- settling ---------------------------------------------------------------------------

    def take(self, key: int) -> list[ServedCall]:
        """The served calls not yet settled, in the order they ran (each taken once): the Python
        operator's, or where ``served_calls.cpp`` serves, runtime ``key``'s C++ log."""
        calls, self.pending = self.pending, []
        if few_rows.loaded():
            calls += read_served_calls(torch.ops.moetray.take_served_calls(key).tolist())
        return calls

    def forget_step(self, key: int) -> None:
        """A step failed: its unsettled calls are dropped (its eager rerun plans them)."""
        self.take(key)


def read_served_calls(flat: list[int]) -> list[ServedCall]:
    """``moetray::take_served_calls``' log: per call ``layer, tokens, n`` then its ``n`` experts."""
    calls: list[ServedCall] = []
    at = 0
    while at < len(flat):
        layer, tokens, n = flat[at:at + 3]
        calls.append((layer, flat[at + 3:at + 3 + n], tokens))
        at += 3 + n
    return calls
