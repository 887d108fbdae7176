"""A layer's routed experts as one opaque operator, ``moetray::experts``, for a compiled decode step.

A compiled step (``engine/cb/compiled_step.py``) traces the whole decoder into one graph, but a
layer's experts call cannot be traced: it plans against the expert cache, copies missed experts
into slots and counts hits, all Python state. So under ``torch.compile`` the experts interface
calls this operator instead: the graph sees ``[T, H], [T, k], [T, k] → [T, H]`` (the fake kernel
gives the shape), and at run time the kernel is the runtime's own eager ``forward`` (which runs
the compiled decode kernel where it serves). The runtime is found by a small integer key the
graph holds as a constant: a registry entry per runtime, dropped with the runtime.
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


_LIB.impl("experts", _experts, "CompositeExplicitAutograd")
torch.library.register_fake("moetray::experts", _experts_shape, lib=_LIB)

experts_op = torch.ops.moetray.experts.default
