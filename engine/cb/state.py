"""Recurrent state of hybrid models: the state pool, its allocator, and the snapshot-aware radix ledger.

A hybrid model (Qwen3.5/3.6-MoE, Qwen3-Next) interleaves Gated DeltaNet linear-attention layers
with a few full-attention layers. A linear layer keeps no KV: it carries, per request, a
fixed-size *conv state* (the last ``linear_conv_kernel_dim`` inputs of its short convolution)
and a *recurrent state* (``[value heads, key dim, value dim]``, fp32 as transformers keeps it).
This module holds what that costs and where it lives:

- ``StateGeometry`` — the unit cost of one state slot, from the model config (priced in
  ``pool_budget`` before any pool exists, like a KV page).
- ``StatePool`` — the third pool: one conv tensor and one recurrent tensor per linear layer,
  each ``[slots, ...]``, and the free list of slot ids.
- ``StateAllocator`` — the state allocator beside the substrate's full-attention (and
  sliding-window) allocators: which slot each running request holds (one, while it runs), the
  snapshot slot it is filling at its next page boundary, the snapshot it resumes from, and the
  plan of the forward in flight that the linear-attention seam (``recurrent``) executes.
- ``HybridLedger`` — the full-attention allocator's radix ledger over a
  ``policy.radix_state.HybridRadixCache``: KV blocks and state snapshots in one tree, evictions
  returning both currencies.

The substrate-facing cache and scheduler that drive these are in ``hybrid``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetray.engine.cb.prefix import RadixLedger
from moetray.policy.radix_state import HybridRadixCache
from moetray.policy.refused import Refused

LINEAR_ATTENTION = "linear_attention"
SUPPORTED_LINEAR_MODELS = ("qwen3_5_moe_text", "qwen3_next")
"""Text model types whose linear-attention layers moetray serves (Gated DeltaNet with the
``get_conv_state`` / ``update_recurrent_state`` cache interface of transformers 5.24)."""
SERVABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedLayers(Refused, ValueError):
    """``unsupported_layers``: the model has layers transformers' continuous batching cannot page and
    moetray has no state pool for; refused from the config, before any weight is read."""

    KINDS = ("unsupported_layers",)


def _layer_types(text) -> list[str]:
    types = getattr(text, "layer_types", None)
    return list(types) if types is not None else []


def linear_layers(text) -> tuple[int, ...]:
    """Indices of the linear-attention (recurrent-state) layers of a text config; empty for other models."""
    return tuple(i for i, kind in enumerate(_layer_types(text)) if kind == LINEAR_ATTENTION)


def attention_layers(text) -> tuple[int, ...]:
    """Indices of the layers that keep KV: every layer but the linear-attention ones."""
    linear = set(linear_layers(text))
    return tuple(i for i in range(text.num_hidden_layers) if i not in linear)


def attention_groups(text) -> dict[str, list[int]]:
    """The substrate's layer grouping over the KV-keeping layers only (``group_layers_by_attn_type``
    raises on ``linear_attention``; a hybrid's linear layers live in the state pool instead)."""
    types = _layer_types(text)
    if not types:
        kind = "sliding_attention" if getattr(text, "sliding_window", None) is not None else "full_attention"
        return {kind: list(range(text.num_hidden_layers))}
    groups: dict[str, list[int]] = {}
    for i, kind in enumerate(types):
        if kind != LINEAR_ATTENTION:
            groups.setdefault(kind, []).append(i)
    return groups


def refuse_unservable_layers(config) -> None:
    """Refuses, from the config alone, a model with a layer type moetray cannot serve.

    Servable: full and sliding-window attention (the substrate pages their KV), and linear
    attention for the families in ``SUPPORTED_LINEAR_MODELS`` (the state pool). Anything else
    (Mamba blocks, chunked or compressed attention, another family's linear layers) raises
    ``UnsupportedLayers("unsupported_layers")`` naming the types and the model type. Pure.
    """
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None)
    allowed = set(SERVABLE_LAYER_TYPES)
    if model_type in SUPPORTED_LINEAR_MODELS:
        allowed.add(LINEAR_ATTENTION)
    unknown = sorted(set(_layer_types(text)) - allowed)
    if unknown:
        raise UnsupportedLayers(
            "unsupported_layers",
            f"{model_type} has {', '.join(unknown)} layers, which moetray cannot serve (it pages full and "
            f"sliding-window attention, and keeps recurrent state for {', '.join(SUPPORTED_LINEAR_MODELS)})",
            model_type=model_type,
            layer_types=unknown,
        )


@dataclass(frozen=True)
class StateGeometry:
    """The shape of one request's recurrent state over every linear-attention layer."""

    layers: tuple[int, ...]
    conv_dim: int
    conv_kernel: int
    heads: int  # value heads
    key_dim: int
    value_dim: int
    conv_dtype: torch.dtype
    recurrent_dtype: torch.dtype = torch.float32  # transformers keeps the recurrent state in fp32

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> StateGeometry | None:
        """The geometry of a hybrid model's state (conv states in ``dtype``); None without linear layers."""
        text = config.get_text_config()
        layers = linear_layers(text)
        if not layers:
            return None
        key_heads, key_dim = text.linear_num_key_heads, text.linear_key_head_dim
        heads, value_dim = text.linear_num_value_heads, text.linear_value_head_dim
        return cls(
            layers=layers,
            conv_dim=2 * key_heads * key_dim + heads * value_dim,
            conv_kernel=text.linear_conv_kernel_dim,
            heads=heads,
            key_dim=key_dim,
            value_dim=value_dim,
            conv_dtype=dtype,
        )

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one state slot: a conv and a recurrent state per linear layer."""
        conv = self.conv_dim * self.conv_kernel * self.conv_dtype.itemsize
        recurrent = self.heads * self.key_dim * self.value_dim * self.recurrent_dtype.itemsize
        return len(self.layers) * (conv + recurrent)


class StatePool:
    """``slots`` state slots on ``device``: conv and recurrent tensors per linear layer, and a free list."""

    def __init__(self, geometry: StateGeometry, slots: int, device: torch.device | str) -> None:
        if slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {slots}")
        g = geometry
        self.geometry = geometry
        self.capacity = slots
        self.conv = {
            layer: torch.zeros((slots, g.conv_dim, g.conv_kernel), dtype=g.conv_dtype, device=device)
            for layer in g.layers
        }
        self.recurrent = {
            layer: torch.zeros(
                (slots, g.heads, g.key_dim, g.value_dim), dtype=g.recurrent_dtype, device=device
            )
            for layer in g.layers
        }
        self._free: list[int] = []
        self.reset()

    def reset(self) -> None:
        """Every slot free again (the allocator and the tree that held them are gone)."""
        self._free = list(range(self.capacity - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free slot id (lowest first), or None when every slot is held."""
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        """Returns ``slot`` to the free list; a slot freed twice is a bookkeeping bug and raises."""
        if not 0 <= slot < self.capacity or slot in self._free:
            raise AssertionError(f"state slot {slot} freed twice or out of range")
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Copies slot ``src``'s states into ``dst`` over every layer (a snapshot, or a resume)."""
        for layer in self.geometry.layers:
            self.conv[layer][dst].copy_(self.conv[layer][src])
            self.recurrent[layer][dst].copy_(self.recurrent[layer][src])

    def copy_layer(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies one layer's states from slots ``src`` to slots ``dst`` (index tensors)."""
        self.conv[layer].index_copy_(0, dst, self.conv[layer].index_select(0, src))
        self.recurrent[layer].index_copy_(0, dst, self.recurrent[layer].index_select(0, src))


@dataclass
class Snapshot:
    """A snapshot slot a request fills when its forward reaches ``boundary`` tokens (whole pages)."""

    slot: int
    boundary: int


@dataclass(frozen=True)
class Segment:
    """One request's share of the forward in flight: ``length`` tokens after ``past``, in its ``live`` slot.

    ``snapshot`` (when set) is filled once the segment reaches ``snapshot.boundary``.
    """

    request_id: str
    past: int
    length: int
    live: int
    snapshot: Snapshot | None = None


@dataclass
class StateAllocator:
    """Which state slot each running request holds, and what the forward in flight does with them.

    ``live``: request → its slot (taken at admission, or at a prefix match, where a snapshot is
    copied into it; freed when it ends). ``filling``: request → the snapshot slot its forward
    fills at the next page boundary (committed to the tree by the scheduler, or rolled
    forward). ``pinned``: request → the boundary at its tool-call opener, whose snapshot is
    committed as soon as it is filled. ``plan``: the segments of the forward in flight, in
    batch order.
    """

    pool: StatePool
    page_size: int
    live: dict[str, int] = field(default_factory=dict)
    filling: dict[str, Snapshot] = field(default_factory=dict)
    pinned: dict[str, int] = field(default_factory=dict)
    plan: list[Segment] = field(default_factory=list)
    counters: dict[str, int] = field(
        default_factory=lambda: {"snapshots_taken": 0, "snapshots_committed": 0, "resumed": 0}
    )

    layer_type = LINEAR_ATTENTION

    def held_slots(self) -> list[int]:
        """Slots requests hold (live and filling), not counting the tree's snapshots."""
        return list(self.live.values()) + [snap.slot for snap in self.filling.values()]

    def release(self, request_id: str) -> None:
        """The request ended (finished, cancelled, offloaded): its slots return. Idempotent."""
        slot = self.live.pop(request_id, None)
        if slot is not None:
            self.pool.give(slot)
        snap = self.filling.pop(request_id, None)
        if snap is not None:
            self.pool.give(snap.slot)
        self.pinned.pop(request_id, None)

    def release_all(self) -> None:
        for request_id in {*self.live, *self.filling, *self.pinned}:
            self.release(request_id)
        self.plan = []


class HybridLedger(RadixLedger):
    """The radix ledger over a ``HybridRadixCache``: KV blocks and recurrent-state snapshots in one tree.

    Evictions return both currencies: KV blocks to the caller (who returns them to the KV
    pool, as for ``RadixLedger``) and snapshot slots straight to ``state_pool``.
    """

    radix: HybridRadixCache

    def __init__(self, page_size: int, *, state_pool: StatePool, anchor_max_held_tokens: int = 0) -> None:
        self.state_pool = state_pool
        super().__init__(page_size, anchor_max_held_tokens=anchor_max_held_tokens)

    def new_tree(self) -> HybridRadixCache:
        return HybridRadixCache(self.page_size, slot_unit="page")

    def reset(self) -> None:
        for slot in self.radix.snapshot_slots():
            self.state_pool.give(slot)
        super().reset()

    def evict_blocks(self, n_blocks: int) -> list[int]:
        """Frees ``n_blocks`` cached blocks (or fewer) with their leaves' snapshots; returns the blocks."""
        want = min(n_blocks, self.evictable_blocks)
        if want <= 0:
            return []
        freed = self.radix.evict_full(want * self.page_size)
        for slot in freed.state_slots:
            self.state_pool.give(slot)
        return self.forget_blocks(list(freed.kv_slots))

    def evict_snapshots(self, n: int) -> list[int]:
        """Frees ``n`` snapshots (slots back to the pool); returns the KV blocks freed with leaf snapshots."""
        freed = self.radix.evict_states(n)
        for slot in freed.state_slots:
            self.state_pool.give(slot)
        return self.forget_blocks(list(freed.kv_slots)) if freed.kv_slots else []

    def check_states(self, allocator: StateAllocator) -> None:
        """Raise ``AssertionError`` unless every state slot is in exactly one place: free, held by a
        request, or a snapshot in the tree."""
        pool = self.state_pool
        held = allocator.held_slots()
        tree = list(self.radix.snapshot_slots())
        free = pool.capacity - pool.free_count
        places = held + tree
        assert len(set(places)) == len(places), f"state slots held twice: requests {held}, tree {tree}"
        assert free == len(places), (
            f"state pool: {pool.free_count} free + {len(places)} held != {pool.capacity}"
        )
