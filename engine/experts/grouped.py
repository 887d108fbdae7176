"""The grouped compute path's GEMMs: each routed expert's group of rows times its weights.

The runtime (:mod:`moetray.engine.experts.runtime`) sorts a call's token-expert pairs by
expert as the stock ``grouped_mm`` path sorts them and hands each projection here as
``(first row, end row, weight, bias)`` groups: :func:`project` runs one ``mm`` per group into
an output laid out as the stock kernel lays it out (:func:`grouped_output`), small groups on
one intra-op thread each, shared out over the engine's thread budget. Torch only; no planning.
"""

from __future__ import annotations

import torch

from moetray.engine.experts.int8 import Int8Weight, int8_gemm
from moetray.engine.experts.store import ExpertGeometry
from moetray.engine.helpers import helper_count, one_thread_helpers
from moetray.engine.models.precision import half_linear, pads_rows
from moetray.policy.step_threads import ONE_THREAD_MAX_MACS

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


FLOAT32_ONE_THREAD_MAX_ROWS = 4
"""float32 is the token-identity reference, and MKL's float32 product of more rows than this can
round differently on one thread than on two (seen in the tests: groups of 5-8 rows), so in
float32 only products of at most this many rows take the one-thread rule (identical either way)."""
PARALLEL_MIN_GROUPS = 4
"""Fewer one-thread groups than this run on the calling thread alone (a hand-off costs ~10-30 µs)."""


def _one_thread_group(item: Group, dtype: torch.dtype) -> bool:
    """Whether one group's product runs on one intra-op thread: at most
    :data:`~moetray.policy.step_threads.ONE_THREAD_MAX_MACS` multiply-adds (rows × the weight's
    elements; a prefill's expert groups on the demo are ~2.5 M, so a short prompt's prefill does
    not pay an OpenMP wake-up per expert and projection), in float32 at most
    :data:`FLOAT32_ONE_THREAD_MAX_ROWS` rows."""
    lo, hi, w, _ = item
    if dtype == torch.float32:
        return hi - lo <= FLOAT32_ONE_THREAD_MAX_ROWS
    return (hi - lo) * (w.qweight.numel() if type(w) is Int8Weight else w.numel()) <= ONE_THREAD_MAX_MACS


def project(out: torch.Tensor, src: torch.Tensor, items: list[Group], *, share_threads: int = 1) -> bool:
    """One projection of the grouped path: ``out[lo:hi] = src[lo:hi] @ w (+ b)`` for every
    ``(lo, hi, w, b)`` in ``items`` (disjoint row ranges, so any order gives the same tensor).

    Shared over the larger of the step's intra-op threads and ``share_threads`` (the engine's
    budget: a short prefill off the team runs on one intra-op thread, :mod:`moetray.policy.step_threads`,
    and its expert groups are what the other cores can take). With more than one (on the CPU,
    gradients off), the small groups (:func:`_one_thread_group`) run on one intra-op thread each:
    shared out round-robin between this thread and one-thread helpers, up to that many threads,
    when there are at least :data:`PARALLEL_MIN_GROUPS` of them, else here; then the larger groups
    run here at the step's own count. Measured on the demo served as int8 (2 cores, a 42-token chat
    prompt's prefill on one thread): 103-105 ms without the helper, 93-96 with it. In float32 the
    output is bit-identical to stock ``grouped_mm`` at the budget (checked in the tests). Mutates
    ``out`` only; returns whether a helper was handed groups.
    """
    threads = max(torch.get_num_threads(), share_threads)
    if torch.is_grad_enabled():
        for lo, hi, w, b in items:
            _gemm_into_autograd(out, lo, hi, src, w, b)
        return False
    if threads == 1 or src.device.type != "cpu":
        _gemm_many(out, src, items)
        return False
    small: list[Group] = []
    large: list[Group] = []
    for item in items:
        (small if _one_thread_group(item, src.dtype) else large).append(item)
    shared = bool(small) and _one_thread_each(out, src, small, threads)
    if large:
        _gemm_many(out, src, large)
    return shared


def _one_thread_each(out: torch.Tensor, src: torch.Tensor, items: list[Group], threads: int) -> bool:
    """``items`` on one intra-op thread each: shared round-robin between this thread and up to
    ``threads - 1`` helpers (when there are at least :data:`PARALLEL_MIN_GROUPS`); this thread has
    its own count back on return. Returns whether helpers took a share."""
    parts = 1
    futures = []
    if len(items) >= PARALLEL_MIN_GROUPS:
        parts = min(threads, len(items) // 2, helper_count() + 1)
        helpers = one_thread_helpers()
        futures = [helpers.submit(_gemm_many, out, src, items[i::parts]) for i in range(1, parts)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _gemm_many(out, src, items[::parts])
    finally:
        torch.set_num_threads(before)
        for future in futures:
            future.result()
    return bool(futures)


def _gemm_many(out: torch.Tensor, src: torch.Tensor, items: list[Group]) -> None:
    for lo, hi, w, b in items:
        _gemm_into(out, lo, hi, src, w, b)


def _gemm_into(out: torch.Tensor, lo: int, hi: int, states: torch.Tensor, w: torch.Tensor,
               bias: torch.Tensor | None) -> None:
    """``out[lo:hi] = states[lo:hi] @ w (+ bias)``: the stock grouped kernel's ``mm_out`` for one group;
    an :class:`~moetray.engine.experts.int8.Int8Weight` goes to the weight-only int8 kernel instead."""
    if type(w) is Int8Weight:
        out[lo:hi].copy_(int8_gemm(states[lo:hi], w))
    elif pads_rows(states):  # over the few row counts oneDNN keeps kernels for
        out[lo:hi].copy_(half_linear(states[lo:hi], w.t()))
    else:  # written in place
        torch.mm(states[lo:hi], w, out=out[lo:hi])
    if bias is not None:
        out[lo:hi].add_(bias)


def _gemm_into_autograd(out: torch.Tensor, lo: int, hi: int, states: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None) -> None:
    """:func:`_gemm_into` where autograd records the call (``out=`` is not differentiable);
    the same values: the product is computed by the same kernel, then copied into place."""
    out[lo:hi] = torch.mm(states[lo:hi], w) if bias is None else torch.mm(states[lo:hi], w) + bias
