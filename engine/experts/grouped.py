"""The grouped compute path's GEMMs: each routed expert's group of rows times its weights.

The runtime (:mod:`moetray.engine.experts.runtime`) sorts a call's token-expert pairs by
expert as the stock ``grouped_mm`` path sorts them and hands each projection here as
``(first row, end row, weight, bias)`` groups: :func:`project` runs one ``mm`` per group into
an output laid out as the stock kernel lays it out (:func:`grouped_output`), sharing a
batched step's small groups out over the torch thread budget. Torch only; no planning.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from moetray.engine.experts.int8 import Int8Weight, int8_gemm
from moetray.engine.experts.store import ExpertGeometry

Operands = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]
"""``(first, first_bias, down, down_bias)`` of one expert (see :func:`operands`)."""
Group = tuple[int, int, torch.Tensor, torch.Tensor | None]
"""``(lo, hi, weight, bias)``: rows ``lo:hi`` of one projection times one expert's matrix."""


def grouped_output(rows: int, cols: int, like: torch.Tensor, padded: bool) -> torch.Tensor:
    """An output as the stock grouped GEMM allocates it (rows padded to 16 bytes when the
    stock path runs PyTorch's grouped-mm kernel, ``padded``; plain rows under transformers'
    fallback)."""
    if padded:
        align = max(1, 16 // like.element_size())
        stride = -(-cols // align) * align
        return torch.empty_strided((rows, cols), (stride, 1), dtype=like.dtype, device=like.device)
    return torch.empty((rows, cols), dtype=like.dtype, device=like.device)


def operands(views: dict[str, torch.Tensor], geo: ExpertGeometry) -> Operands:
    """``(first, first_bias, down, down_bias)``: one expert's matrices as the right-hand side of
    ``states @ matrix``, exactly as the stock grouped path hands them to its GEMM (a transposed
    view for the ``[out, in]`` layout, the tensor itself for the transposed layout)."""
    first = views["gate_up_proj" if geo.has_gate else "up_proj"]
    down = views["down_proj"]
    if not geo.is_transposed:
        first, down = first.transpose(-2, -1), down.transpose(-2, -1)
    return (first, views.get("gate_up_proj_bias" if geo.has_gate else "up_proj_bias"),
            down, views.get("down_proj_bias"))


PARALLEL_MAX_ROWS = 4
"""Groups of at most this many rows are matrix-vector-like, bound by reading the expert's
weights. A batched step has many such groups (decode of several requests: one or two rows per
routed expert), so the runtime shares them out over the torch thread budget itself, on helper
threads pinned to one intra-op thread each: left at the budget, each helper's ``mm`` opens its
own OpenMP team (MKL from 2 rows, oneDNN's bfloat16 from 1), so 2 helpers × 2 threads fight
over 2 cores (measured on 2 busy cores, the demo's 30 layers of 12-of-16 experts: a step's
expert GEMMs took 0.5-0.7× the time pinned at batch 4, fp32 and bfloat16, and bfloat16 at
batch 1; fp32 at batch 1, whose ``mm`` MKL already runs on one thread, within noise)."""
PARALLEL_MIN_GROUPS = 4
"""Fewer small groups than this are run on the calling thread (a hand-off costs ~10-30 µs)."""

_workers: ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()


def _gemm_workers() -> ThreadPoolExecutor:
    """The process's helper threads for :func:`project`, each pinned to one intra-op thread
    (made on first use, daemon-like: idle threads hold nothing and end with the interpreter)."""
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 2)),
                                          thread_name_prefix="moetray-gemm", initializer=_one_thread)
        return _workers


def _one_thread() -> None:
    """A helper's GEMMs run on the helper alone: OpenMP's and MKL's thread counts are per
    calling thread, so the caller's budget stays as it was (torch also records 1 as the count
    later-started ATen pool threads begin with; the engine starts none)."""
    torch.set_num_threads(1)


def project(out: torch.Tensor, src: torch.Tensor, items: list[Group]) -> None:
    """One projection of the grouped path: ``out[lo:hi] = src[lo:hi] @ w (+ b)`` for every
    ``(lo, hi, w, b)`` in ``items`` (disjoint row ranges, so any order gives the same tensor).

    Small groups (≤ :data:`PARALLEL_MAX_ROWS` rows) are shared out round-robin over as many
    one-thread helpers as the torch thread budget when there are at least
    :data:`PARALLEL_MIN_GROUPS` of them and gradients are off; the rest run here, at the full
    budget, meanwhile. Mutates ``out`` only.
    """
    threads = torch.get_num_threads()
    small = ([item for item in items if item[1] - item[0] <= PARALLEL_MAX_ROWS]
             if threads > 1 and len(items) >= PARALLEL_MIN_GROUPS and src.device.type == "cpu"
             and not torch.is_grad_enabled() else [])
    if len(small) < PARALLEL_MIN_GROUPS:
        gemm = _gemm_into if not torch.is_grad_enabled() else _gemm_into_autograd
        for lo, hi, w, b in items:
            gemm(out, lo, hi, src, w, b)
        return
    workers = _gemm_workers()
    parts = min(threads, len(small) // 2, workers._max_workers)  # noqa: SLF001 - our own pool
    futures = [workers.submit(_gemm_many, out, src, small[i::parts]) for i in range(parts)]
    try:
        _gemm_many(out, src, [item for item in items if item[1] - item[0] > PARALLEL_MAX_ROWS])
    finally:
        for future in futures:
            future.result()


def _gemm_many(out: torch.Tensor, src: torch.Tensor, items: list[Group]) -> None:
    for lo, hi, w, b in items:
        _gemm_into(out, lo, hi, src, w, b)


def _gemm_into(out: torch.Tensor, lo: int, hi: int, states: torch.Tensor, w: torch.Tensor,
               bias: torch.Tensor | None) -> None:
    """``out[lo:hi] = states[lo:hi] @ w (+ bias)``: the stock grouped kernel's ``mm_out`` for one group;
    an :class:`~moetray.engine.experts.int8.Int8Weight` goes to the weight-only int8 kernel instead."""
    if type(w) is Int8Weight:
        out[lo:hi].copy_(int8_gemm(states[lo:hi], w))
    else:
        torch.mm(states[lo:hi], w, out=out[lo:hi])
    if bias is not None:
        out[lo:hi].add_(bias)


def _gemm_into_autograd(out: torch.Tensor, lo: int, hi: int, states: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None) -> None:
    """:func:`_gemm_into` where autograd records the call (``out=`` is not differentiable);
    the same values: the product is computed by the same kernel, then copied into place."""
    out[lo:hi] = torch.mm(states[lo:hi], w) if bias is None else torch.mm(states[lo:hi], w) + bias
