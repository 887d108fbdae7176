"""Where a compiled decode step finds a layer's experts without leaving its graph.

A layer call whose routed experts are all resident has nothing to decide: every expert keeps its
slot, nothing is copied, and the planner only counts the call. So in a compiled step each layer
looks its routed experts up in :attr:`ResidentSlots.table` (``[layer, expert] → slot``, −1 where
not resident, kept equal to the planner's residency map; one more column, always −1, for an id
past the experts, an expert-parallel sentinel) and writes its routing to
:attr:`ResidentSlots.log`, both inside the graph, and tests "every routed expert has a slot".
``moetray::expert_slots`` then returns the looked-up slots as they are, or, where one is missing,
plans the call (copies the misses in) as before.

The planner still sees every call, in the same order: the calls the graph served from the table
are *settled* (planned and recorded from the log, each a hit by construction) before the next
call that the operator plans, and the rest right after the step. So its state (recency, counts,
the policy's order) is what planning each call in turn would have made it, and every miss is
decided on that state. Rules:

- Layers are settled in order, each once per step; a step that fails is forgotten (its eager
  rerun plans every layer again).
- A settled call that would not be a pure hit means the table lied: a bug, raised as
  ``CacheIntegrityError``.

Why not a ``torch.cond`` around the operator: each branch is a subgraph inductor compiles on its
own, and on the demo (30 layers, three graphs) that added ~120 s to a cold start (421 s against
301 s, inductor's caches off).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetray.engine.experts.opaque import expert_slots_op

__all__ = ["ResidentSlots"]

NOT_RESIDENT = -1
"""A table entry whose expert has no slot."""


class ResidentSlots:
    """The slot table and the routing log one runtime's compiled steps read and write."""

    def __init__(self, num_layers: int, num_experts: int, *, max_tokens: int, top_k: int) -> None:
        self.table = torch.full((num_layers, num_experts + 1), NOT_RESIDENT, dtype=torch.long)
        self.log = torch.zeros((num_layers, max_tokens, top_k), dtype=torch.long)
        self.logged = torch.zeros(1, dtype=torch.long)  # the running step's tokens, once layer 0 logged
        self.settled = 0  # layers of the running step the planner has seen

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
        """``[T, k]`` routed experts → ``[T, k]`` slots, traced into a compiled step: logged and
        looked up in the graph; ``moetray::expert_slots`` plans the call only where some routed
        expert has no slot (a sentinel has none; the operator refuses it)."""
        self.log[layer, : top_k_index.shape[0]].copy_(top_k_index)
        if layer == 0:
            self.logged.fill_(top_k_index.shape[0])
        looked = self.table[layer][top_k_index]
        resident = (looked >= 0).all()
        return expert_slots_op(top_k_index, looked, resident, self.log, runtime, layer)

    # --- settling ---------------------------------------------------------------------------

    def settle(self, until: int, log: torch.Tensor, tokens: int,
               plan_hit: Callable[[int, list[int], int], None]) -> None:
        """Have the planner see the logged calls of layers ``[settled, until)``: ``plan_hit(layer,
        routed ids ascending, tokens)`` each, in order."""
        first = self.settled
        if first >= until:
            return
        rows = log[first:until, :tokens].tolist()
        self.settled = until
        for layer, pairs in enumerate(rows, first):
            plan_hit(layer, sorted({expert for row in pairs for expert in row}), tokens)

    def settle_step(self, plan_hit: Callable[[int, list[int], int], None]) -> None:
        """The step returned: settle the calls it logged that the planner has not seen, and start
        the next step. A step that logged nothing (no layer took :meth:`traced`) settles nothing."""
        tokens = int(self.logged.item())
        try:
            if tokens:
                self.settle(len(self.log), self.log, tokens, plan_hit)
        finally:
            self.forget_step()

    def forget_step(self) -> None:
        """Start the next step; a failed step's unsettled calls are dropped (its eager rerun plans
        them)."""
        self.settled = 0
        self.logged.zero_()

