"""The linear-attention seam: a hybrid's Gated DeltaNet layers computing in the state pool.

Continuous batching packs every scheduled request into one ``[1, tokens, hidden]`` batch. An
attention layer handles that through the paged cache; a Gated DeltaNet layer cannot: its
convolution and its recurrence run along the sequence, so the packed batch would leak one
request's state into the next. transformers' own layer takes its states from a ``cache``
object (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``, ``is_recording_past``), the interface ``generate``'s
``DynamicCache`` implements.

:func:`install_linear_attention` wraps each linear layer's ``forward``: given the hybrid cache
(``hybrid.HybridPagedCache``), it follows the plan of the forward in flight
(``state.StateAllocator.plan``) and calls the stock forward unchanged on each request's slice
with a small view of that request's slots as its ``cache``:

- decode steps (one token after a state) of every request together, as a ``[B, 1, hidden]``
  batch over their gathered states, scattered back after;
- a prefill segment on its own, from no state when it starts the sequence (the stock layer's
  first-forward path, exactly as ``generate`` runs it) or from its slot's state (a later
  chunk, or a state restored from a snapshot), split at the snapshot boundary when one falls
  inside it, whose state is then copied into the snapshot slot.

Called with any other cache (``generate``), the stock forward runs as it always did. The
fused kernels (flash-linear-attention, causal-conv1d) are used by the stock forward when they
are installed; the torch fallback otherwise.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
import torch.nn.functional as F

from moetray.engine.cb.state import StateGeometry, StatePool, UnsupportedLayers

_STOCK = "_moetray_stock_forward"


class _SlotStates:
    """What one call of a linear layer sees as its cache: the states of ``slots`` (or none, to start)."""

    def __init__(self, pool: StatePool, layer: int, slots: torch.Tensor, *, fresh: bool) -> None:
        self._pool = pool
        self._layer = layer
        self._slots = slots
        self._kernel = pool.geometry.conv_kernel
        self.conv: torch.Tensor | None = None if fresh else pool.conv[layer].index_select(0, slots)
        self.recurrent: torch.Tensor | None = None if fresh else pool.recurrent[layer].index_select(0, slots)

    # The cache interface the stock layer calls.
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """As ``LinearAttentionLayer.update_conv_state``: inputs with their left context; keeps the last K."""
        kernel = conv_kernel_size or self._kernel
        if self.conv is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = F.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv, conv_states], dim=-1)
        self.conv = full[..., -kernel:].clone()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_: Any
    ) -> torch.Tensor:
        self.recurrent = recurrent_states
        return recurrent_states

    def write_back(self) -> None:
        """Stores the layer's new states in the pool's slots."""
        pool, layer = self._pool, self._layer
        assert self.conv is not None and self.recurrent is not None, "the layer left no state"
        pool.conv[layer].index_copy_(0, self._slots, self.conv.to(pool.conv[layer].dtype))
        pool.recurrent[layer].index_copy_(0, self._slots, self.recurrent.to(pool.recurrent[layer].dtype))


def _slots(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _hybrid_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    stock = getattr(module, _STOCK)
    states = getattr(cache, "states", None)
    if states is None:  # generate, or any cache that is not the hybrid paged cache
        return stock(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    pool: StatePool = states.pool
    layer = cast(int, module.layer_idx)
    device = hidden_states.device
    out = torch.empty_like(hidden_states)
    starts = []
    offset = 0
    for segment in states.plan:
        starts.append(offset)
        offset += segment.length
    if offset != hidden_states.shape[1]:
        raise AssertionError(f"the state plan covers {offset} tokens, the batch has {hidden_states.shape[1]}")

    decode = [i for i, seg in enumerate(states.plan) if seg.length == 1 and seg.past > 0]
    if decode:
        plan = [states.plan[i] for i in decode]
        rows = _slots([starts[i] for i in decode], device)
        live = _slots([seg.live for seg in plan], device)
        view = _SlotStates(pool, layer, live, fresh=False)
        out[0, rows] = stock(hidden_states[0, rows].unsqueeze(1), cache=view)[:, 0]
        view.write_back()
        snapped = [seg for seg in plan if seg.snapshot is not None]
        if snapped:
            pool.copy_layer(
                layer,
                _slots([s.live for s in snapped], device),
                _slots([s.snapshot.slot for s in snapped], device),
            )
    taken = set(decode)
    for i, seg in enumerate(states.plan):
        if i in taken:
            continue
        end = seg.past + seg.length
        cuts = [seg.past, end]
        if seg.snapshot is not None and seg.snapshot.boundary < end:
            cuts.insert(1, seg.snapshot.boundary)
        live = _slots([seg.live], device)
        for a, b in zip(cuts, cuts[1:], strict=False):
            lo, hi = starts[i] + a - seg.past, starts[i] + b - seg.past
            view = _SlotStates(pool, layer, live, fresh=a == 0)
            out[:, lo:hi] = stock(hidden_states[:, lo:hi], cache=view)
            view.write_back()
            if seg.snapshot is not None and b == seg.snapshot.boundary:
                pool.copy_layer(layer, live, _slots([seg.snapshot.slot], device))
    return out


def linear_attention_modules(model: torch.nn.Module, geometry: StateGeometry) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet modules, one per linear layer, checked against ``geometry``.

    Refuses ``unsupported_layers`` when the modules do not match the config's linear layers or
    the geometry the state pool is sized from (a family whose layer keeps other states).
    """
    found: dict[int, Any] = {
        cast(int, module.layer_idx): module
        for module in model.modules()
        if type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "conv_dim")
    }
    if sorted(found) != list(geometry.layers):
        raise UnsupportedLayers(
            "unsupported_layers",
            f"the model's Gated DeltaNet layers {sorted(found)} are not its linear-attention layers "
            f"{list(geometry.layers)}",
        )
    g = geometry
    for module in found.values():
        shape = (
            module.conv_dim,
            module.conv_kernel_size,
            module.num_v_heads,
            module.head_k_dim,
            module.head_v_dim,
        )
        if shape != (g.conv_dim, g.conv_kernel, g.heads, g.key_dim, g.value_dim):
            raise UnsupportedLayers(
                "unsupported_layers",
                f"linear layer {module.layer_idx} has state shape {shape}, the config says "
                f"{(g.conv_dim, g.conv_kernel, g.heads, g.key_dim, g.value_dim)}",
            )
    return [found[layer] for layer in geometry.layers]


def install_linear_attention(model: torch.nn.Module, geometry: StateGeometry) -> int:
    """Routes every linear layer of ``model`` through the state pool when called by the hybrid cache.

    Idempotent; returns the number of layers installed. ``generate`` keeps the stock forward.
    """
    modules = linear_attention_modules(model, geometry)
    for module in modules:
        if not hasattr(module, _STOCK):
            setattr(module, _STOCK, module.forward)
            module.forward = types.MethodType(_hybrid_forward, module)
    return len(modules)
