"""A layer's routed experts in a compiled decode step: what cannot be traced as opaque operators.

A compiled step (``engine/cb/compiled_step.py``) traces the whole decoder into one graph, but a
layer's experts call cannot be traced: it plans against the expert cache, copies missed experts
into slots and counts hits, all Python state. So under ``torch.compile`` the experts interface
calls this operator instead: the graph sees ``[T, H], [T, k], [T, k] → [T, H]`` (the fake kernel
gives the shape), and at run time the kernel is the runtime's own eager ``forward`` (which runs
the compiled decode kernel where it serves). Where that kernel serves, only the planning is
opaque: ``moetray::expert_slots`` (``[T, k]`` routed experts, the slots the graph looked up for
them and whether all were found → ``[T, k]`` slots; a call whose experts all have slots returns
them and the planner sees it later, ``resident.py``; one that misses is planned and its misses
copied in; on CPU, where ``served_calls.cpp`` is built, a C++ kernel serves the first kind and
hands the second to ``moetray::expert_slots_planned``) and the kernel's arithmetic is traced into
the step's graph after it. The runtime is found by a small integer key the graph holds as a
constant: a registry entry per runtime, dropped with the runtime.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moetray.engine.experts.runtime import ExpertRuntime

_RUNTIMES: weakref.WeakValueDictionary[int, ExpertRuntime] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)

_LIB = torch.library.Library("moetray", "FRAGMENT")
_LIB.define("experts(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, int runtime, int layer)"
            " -> Tensor")
_LIB.define("expert_slots(Tensor top_k_index, Tensor looked_up, Tensor resident, int runtime, int layer)"
            " -> Tensor")
_LIB.define("expert_slots_planned(Tensor top_k_index, int runtime, int layer) -> Tensor")


def register(runtime: ExpertRuntime) -> int:
    """The key a compiled graph names ``runtime`` by (valid while the runtime lives)."""
    key = next(_KEYS)
    _RUNTIMES[key] = runtime
    return key


def _experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             runtime: int, layer: int) -> torch.Tensor:
    served = _RUNTIMES[runtime]
    return served.forward(served.modules[layer], layer, hidden_states, top_k_index, top_k_weights)


def _experts_shape(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   runtime: int, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)


def _expert_slots(top_k_index: torch.Tensor, looked_up: torch.Tensor, resident: torch.Tensor,
                  runtime: int, layer: int) -> torch.Tensor:
    """Where ``served_calls.cpp`` is built its CPU kernel serves instead, in C++."""
    if resident.item():  # every routed expert has its slot: the planner sees the call later
        return _RUNTIMES[runtime].resident.served(layer, top_k_index, looked_up)
    return _expert_slots_planned(top_k_index, runtime, layer)


def _expert_slots_planned(top_k_index: torch.Tensor, runtime: int, layer: int) -> torch.Tensor:
    """A call that misses: planned, its misses copied in."""
    slots = _RUNTIMES[runtime].planned_slots(layer, top_k_index)
    if slots is None:  # the step fails and reruns eagerly, where the grouped path serves them
        raise ValueError(f"layer {layer}: expert-parallel routing, which the decode kernel does not serve")
    return slots


def _expert_slots_shape(top_k_index: torch.Tensor, looked_up: torch.Tensor, resident: torch.Tensor,
                        runtime: int, layer: int) -> torch.Tensor:
    return torch.empty_like(top_k_index, dtype=torch.long)


_LIB.impl("experts", _experts, "CompositeExplicitAutograd")
torch.library.register_fake("moetray::experts", _experts_shape, lib=_LIB)
_LIB.impl("expert_slots", _expert_slots, "CompositeExplicitAutograd")
_LIB.impl("expert_slots_planned", _expert_slots_planned, "CompositeExplicitAutograd")
torch.library.register_fake("moetray::expert_slots", _expert_slots_shape, lib=_LIB)

experts_op = torch.ops.moetray.experts.default
expert_slots_op = torch.ops.moetray.expert_slots.default
