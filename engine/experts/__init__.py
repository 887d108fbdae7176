"""Offloaded MoE experts: the host store, the slot pool and the registered experts runtime.

The engine loads a checkpoint with :func:`load_offloaded_model` and serves
``OffloadedModel.model`` like any transformers model (``generate``, continuous batching);
the MoE layers run through the ``"moetray"`` experts implementation, which fetches experts
from host memory into a fixed pool of device slots as routing asks for them.

Public API (stable; the engine server calls these)::

    load_offloaded_model(checkpoint_dir, *, device="cpu", dtype=None, capacity,
                         policy=None, fetch_fraction=None, cpu_layers=None,
                         link_gbps=None, progress=None, compute=None, expert_format=None,
                         compile_decode=False) -> OffloadedModel
    load_resident_model(checkpoint_dir, *, device="cpu", dtype=None,
                        experts_implementation="grouped_mm") -> transformers model

    OffloadedModel.model     transformers model: non-expert weights on ``device``, experts
                             implementation "moetray", no expert parameters anywhere on the
                             device (the Experts modules hold ``None`` for their weights)
    OffloadedModel.runtime   ExpertRuntime
    OffloadedModel.store     ExpertStore (host tier; pinned on CUDA)

    ExpertRuntime.num_layers, .num_experts, .top_k     geometry (MoE layers only)
    ExpertRuntime.compute                              "grouped_mm" (default) or "eager": the stock
                                                       implementation it equals bit for bit (fp32)
    ExpertRuntime.warm_up()                            compile the decode kernel (when it may serve)
    ExpertRuntime.decode_kernel, .decode_kernel_reason "compiled" or the compute mode, and why not
    ExpertRuntime.op_key                               its name in a compiled decode step's graph: a
                                                       layer's experts there are the opaque operator
                                                       ``moetray::experts`` (``opaque.py``)
    ExpertRuntime.settle_step()                        after a compiled step: the planner sees the calls
                                                       its slot table served (``resident.py``)
    ExpertRuntime.capacity                             slots in the pool now
    ExpertRuntime.bytes_per_slot                       device bytes per slot (one expert)
    ExpertRuntime.resize(capacity, mark_teardown=None) -> dict
        keeps the hottest experts; allocates the new pool first (failure → ResizeFault
        "allocation_failed", old pool intact, mark_teardown not called), then calls
        mark_teardown() before freeing anything
    ExpertRuntime.snapshot() -> dict with the keys of policy.wire.ExpertStats
    ExpertRuntime.reset_window()
    ExpertRuntime.check_integrity(deep=False)          raises CacheIntegrityError
    ExpertRuntime.inject_resize_fault("before_teardown" | "after_teardown" | None)

``capacity`` is a number of slots (one expert each), from 1 to ``num_layers × num_experts``;
:func:`capacity_for_fraction` converts a fraction. ``policy`` names an
:class:`~moetray.policy.moe.expert_cache.ExpertCache` policy (None = the project default).
``fetch_fraction`` turns on the hybrid backend (q*: fetch that share of each call's misses,
compute the rest on the CPU); None reads this machine's bandwidth profile
(``moetray bench bw``) and uses hybrid only where the profile recommends it. ``cpu_layers``
(``"3,7,11"``, a count ``"4"`` or a fraction ``"0.25"``) runs those MoE layers' experts on the
CPU. ``link_gbps`` throttles slot copies to that many GB/s (emulates a PCIe link on a
machine without a GPU).

Host memory: the store holds every expert once (``store.total_bytes``), packed from the
memory-mapped safetensors one expert at a time; non-expert weights are read straight to the
device. Nothing is ever materialised as a fused ``[E, …]`` stack. A quantized checkpoint
(GGUF, MXFP4, FP8) keeps its experts' stored blocks in a :class:`QuantizedExpertStore`; a slot
fill moves those bytes and decodes them on the device (:func:`offload_loaded` serves both).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetray.engine.experts.loader import (
    LoaderError,
    load_resident_model,
    load_skeleton_and_store,
    resolve_device,
    resolve_dtype,
)
from moetray.engine.experts.runtime import (
    IMPLEMENTATION_NAME,
    ExpertRuntime,
    ResizeFault,
    UnknownComputeMode,
    attach,
    check_compute,
    moetray_experts_forward,
    register,
)
from moetray.engine.experts.store import ExpertStore, ExpertStoreError, QuantizedExpertStore

__all__ = [
    "IMPLEMENTATION_NAME",
    "ExpertRuntime",
    "ExpertStore",
    "ExpertStoreError",
    "LoaderError",
    "QuantizedExpertStore",
    "OffloadedModel",
    "ResizeFault",
    "UnknownComputeMode",
    "capacity_for_fraction",
    "load_offloaded_model",
    "load_resident_model",
    "moetray_experts_forward",
    "offload_loaded",
    "register",
]

log = logging.getLogger(__name__)


@dataclass
class OffloadedModel:
    model: Any  # a transformers PreTrainedModel
    runtime: ExpertRuntime
    store: ExpertStore
    device: torch.device
    dtype: torch.dtype


def capacity_for_fraction(fraction: float, num_layers: int, num_experts: int) -> int:
    """Slots for ``fraction`` of all ``num_layers × num_experts`` experts (at least 1)."""
    return max(1, round(fraction * num_layers * num_experts))


def load_offloaded_model(checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                         dtype: torch.dtype | str | None = None, capacity: int,
                         policy: str | None = None, fetch_fraction: float | None = None,
                         cpu_layers: str | None = None, link_gbps: float | None = None,
                         progress: Callable[[str, int, int | None], None] | None = None,
                         allocate: Callable[..., torch.Tensor] | None = None,
                         compute: str | None = None, expert_format: str | None = None,
                         compile_decode: bool = False) -> OffloadedModel:
    """Load ``checkpoint_dir`` with its routed experts in the host store and ``capacity`` device slots.

    ``compute`` names the stock experts implementation whose arithmetic the runtime
    reproduces bit for bit (``"grouped_mm"``, transformers' default and the default here, or
    ``"eager"``); an unknown name is refused (:class:`UnknownComputeMode`) before anything
    is read. ``expert_format="int8"`` keeps the experts as int8 rows computed by the weight-only
    int8 kernel (:mod:`moetray.engine.experts.int8`); None keeps them in ``dtype``.
    ``compile_decode`` lets small batches of a lossy format (16-bit, int8) on the CPU run the
    compiled kernel (:mod:`moetray.engine.experts.fused`) once ``runtime.warm_up()`` built it.
    ``progress(stage, done, total)`` reports loading. ``allocate(shape, dtype, device)``
    replaces the slot pool's allocator (fault injection). Raises :class:`LoaderError`,
    :class:`ExpertStoreError`, or the planner's ``CacheRefused`` for a bad capacity or
    policy; nothing is left half-built.
    """
    compute = check_compute(compute)  # refused before anything is read
    dev = resolve_device(device)
    dt = resolve_dtype(checkpoint_dir, dtype)
    model, store, modules = load_skeleton_and_store(checkpoint_dir, device=dev, dtype=dt,
                                                    pin=False, progress=progress)
    return offload_loaded(model, store, modules, device=dev, capacity=capacity, policy=policy,
                          fetch_fraction=fetch_fraction, cpu_layers=cpu_layers, link_gbps=link_gbps,
                          allocate=allocate, compute=compute, expert_format=expert_format,
                          compile_decode=compile_decode)


def offload_loaded(model, store: ExpertStore, modules: list[torch.nn.Module], *, device: torch.device,
                   capacity: int, policy: str | None = None, fetch_fraction: float | None = None,
                   cpu_layers: str | None = None, link_gbps: float | None = None,
                   allocate: Callable[..., torch.Tensor] | None = None,
                   compute: str | None = None, expert_format: str | None = None,
                   compile_decode: bool = False) -> OffloadedModel:
    """Put a loaded skeleton (non-expert weights on ``device``, Experts modules empty) and its
    expert store behind the ``"moetray"`` runtime: the second half of :func:`load_offloaded_model`,
    shared with the quantized-format loaders (``moetray.engine.models.gguf``). The q* split is
    priced with the store's bytes per expert as stored (what a fill moves) against the bytes the
    CPU reads decoded (:func:`~moetray.engine.experts.hybrid.resolve_qstar`)."""
    from moetray.engine.experts.hybrid import resolve_cpu_layers, resolve_qstar, settle_host_banks

    compute = check_compute(compute)
    dev = resolve_device(device)
    if expert_format == "int8":
        from moetray.engine.experts.int8 import Int8ExpertStore

        store = Int8ExpertStore.from_store(store)
    elif expert_format is not None:
        raise ValueError(f"unknown expert format {expert_format!r}")
    qstar = resolve_qstar(fetch_fraction, device=dev,
                          expert_bytes=(_mean_link_bytes(store), store.slot_bytes))
    register()
    top_k = _top_k(model.config)
    cpu = resolve_cpu_layers(cpu_layers, store.num_layers, bank_bytes=store.total_bytes)
    residency = settle_host_banks(store.banks, cpu, dev)
    store.banks_replaced()
    runtime = ExpertRuntime(store, device=dev, capacity=capacity, top_k=top_k, policy=policy,
                            qstar=qstar, cpu_layers=cpu, link_gbps=link_gbps, allocate=allocate,
                            compute=compute, compile_decode=compile_decode)
    runtime.host_residency = [None if c is None else c.value for c in residency.achieved_labels()]
    attach(modules, runtime)
    model.set_experts_implementation(IMPLEMENTATION_NAME)
    return OffloadedModel(model=model, runtime=runtime, store=store, device=dev, dtype=store.dtype)

def _mean_link_bytes(store: ExpertStore) -> int:
    """Bytes one slot fill moves, averaged over the layers (a quantized file may mix types)."""
    if not isinstance(store, QuantizedExpertStore):
        return store.row_bytes
    return round(sum(store.link_bytes(layer) for layer in range(store.num_layers)) / store.num_layers)


def _top_k(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise LoaderError("no_top_k", f"{type(config).__name__} names no experts-per-token count")
