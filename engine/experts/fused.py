"""The compiled decode kernel: a small batch's routed experts in one compiled function per layer call.

A decode step routes each of its few tokens to ``top_k`` experts. The grouped path then makes
two GEMM calls per routed expert (the demo at batch 1: 24 calls a layer, ~30 µs each in
bfloat16 on 2 cores, six times what reading their weight bytes takes). Here, once the plan has
put every routed expert in a slot, the layer's experts are one function of the states
``[T, H]``, each token-expert pair's slot ``[T, k]``, the routing weights ``[T, k]`` and views
of the slot pool ``[capacity, …]``, compiled by ``torch.compile`` (inductor; C++ on the CPU):
each matrix-vector product becomes a reduction that reads the pair's weights straight from its
slot (no gather), accumulates in float32 and rounds once; the gate, the routing weights and the
sum over top-k fuse around them.

Lossy against ``grouped_mm`` (another summation order), so it serves only formats that are
lossy anyway: 16-bit slots and int8 rows (whose scales fuse into the reduction). float32 keeps
the exact grouped path, the token-identity reference. Each pair's reduction reads its own expert's
weights, so a batch of several tokens would read an expert once per token routed to it: int8 rows
and 16-bit ``[out, in]`` rows of two tokens or more go to ``moetray::int8_experts_mm`` and
``moetray::half_experts_mm`` instead (:data:`GROUPED_MIN_TOKENS`), which compute the pairs of one
slot together; past :data:`FUSED_MAX_TOKENS` the grouped path (one
GEMM per expert over all its rows) takes over.

Compiled per dtype, geometry and gate at warm-up (:meth:`FusedExperts.warm_up`: batch 1, then
2, after which the batch size is symbolic; the pool's capacity is symbolic from the start, so a
live re-split does not recompile). Where compilation fails (no C++ compiler, an unsupported
gate) the runtime says why and keeps the grouped path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetray.engine.compiling import compile_region
from moetray.engine.experts.hf import ExpertsModule
from moetray.engine.experts.int8 import Int8Layout
from moetray.engine.experts.store import ExpertGeometry, unpack_row
from moetray.engine.models import few_rows
from moetray.policy.step_threads import DECODE_STEP_TOKENS

__all__ = ["FUSED_DTYPES", "FUSED_MAX_TOKENS", "GROUPED_MIN_TOKENS", "FusedExperts", "PoolViews",
           "compile_kernel", "fused_refusal"]

log = logging.getLogger(__name__)

FUSED_MAX_TOKENS = DECODE_STEP_TOKENS
"""Tokens per layer call up to which the compiled kernel computes the call (a decode step of up
to 8 requests, :data:`~moetray.policy.step_threads.DECODE_STEP_TOKENS`). Measured on the demo
(30 layers of 12-of-16 experts, bfloat16, 2 cores) in one process: the kernel took 4-5 ms a step
at batch 1 and 17 ms at batch 8, against 21.5 ms and ~50 ms for the grouped GEMMs; past 8 tokens
a prefill chunk's groups have many rows each and the GEMMs read each expert once."""

FUSED_DTYPES = (torch.bfloat16, torch.float16)
"""Float slot dtypes the kernel serves (int8 rows too); float32 stays on the exact grouped path."""


@dataclass(frozen=True)
class PoolViews:
    """The slot pool seen per projection: ``[capacity, out, in]`` (``[capacity, in, out]`` for a
    transposed float layout), an int8 matrix's ``[capacity, out]`` scales, a bias ``[capacity, out]``."""

    first: torch.Tensor
    first_scale: torch.Tensor | None
    first_bias: torch.Tensor | None
    down: torch.Tensor
    down_scale: torch.Tensor | None
    down_bias: torch.Tensor | None

    @classmethod
    def of_float_rows(cls, rows: torch.Tensor, geo: ExpertGeometry) -> PoolViews:
        seg = unpack_row(rows, geo)
        first = "gate_up_proj" if geo.has_gate else "up_proj"
        return cls(seg[first], None, seg.get(first + "_bias"),
                   seg["down_proj"], None, seg.get("down_proj_bias"))

    @classmethod
    def of_int8_rows(cls, rows: torch.Tensor, layout: Int8Layout) -> PoolViews:
        first, first_bias, down, down_bias = layout.operands(rows)
        return cls(first.qweight, first.scale, first_bias, down.qweight, down.scale, down_bias)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.first, self.first_scale, self.first_bias,
                            self.down, self.down_scale, self.down_bias) if t is not None]


def fused_refusal(*, device: torch.device, slot_dtype: torch.dtype, int8: bool,
                  host_share: bool) -> str | None:
    """Why the kernel cannot serve this runtime, or None when it can. Pure."""
    if device.type != "cpu":
        return f"the experts live on {device.type} (the compiled kernel is the CPU's)"
    if host_share:
        return "some experts are computed from host memory (q* or --cpu-layers)"
    if not int8 and slot_dtype not in FUSED_DTYPES:
        return f"{str(slot_dtype).removeprefix('torch.')} experts are computed exactly (the grouped path)"
    return None


def _project(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None,
             bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Per token-expert pair, ``x[t(·k)] @ W[slot]ᵀ`` as a float32 reduction over the input features."""
    # Widened to float32 before the product (measured: int8 rows 0.7-0.8× the CPU time of widening to
    # the activations' bfloat16 first, 16-bit rows 0.9×); indexing fuses into the reduction's loads.
    mat = w[slots].float()
    xs = (x if x.dim() == 3 else x[:, None, :]).float()  # [T, k|1, in]
    if transposed:
        out = (xs.unsqueeze(-1) * mat).sum(-2)
    else:
        out = (xs.unsqueeze(-2) * mat).sum(-1)
    if scale is not None:
        out = out * scale[slots]
    if bias is not None:
        out = out + bias[slots]
    return out


def float_buffer(x: torch.Tensor) -> torch.Tensor:
    """``x`` widened to float32 in a buffer of its own, for the int8 products that read it.

    Inductor vectorizes a C++ kernel at the width of its 16-bit loads (32 lanes of a bfloat16
    activation), and at that width a row of int8 weights loads through a masked 32-byte path; at
    float32's width (16 lanes) it takes ATen's 16-byte fast path. Measured on this machine's CPU,
    one thread, 12 int8 experts' rows per call: 7.6 G weights/s reading bfloat16 activations,
    18-22 reading them widened here. A concatenation is a buffer inductor does not fuse into its
    readers (a plain ``.float()`` would be, and the kernel would load bfloat16 again); the values
    are the activations', exactly."""
    pad = x.new_zeros((*x.shape[:-1], 1), dtype=torch.float32)
    return torch.cat([x.float(), pad], dim=-1)[..., :-1]


def _grouped_project(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_project` of int8 rows by ``moetray::int8_experts_mm``, of 16-bit ``[out, in]`` rows by
    ``moetray::half_experts_mm``: the pairs routed to one slot are computed together, so each routed
    expert's weights are read once for all its tokens."""
    if scale is not None:
        out = torch.ops.moetray.int8_experts_mm(x, w, scale, slots)
    else:
        out = torch.ops.moetray.half_experts_mm(x, w, slots)
    return out if bias is None else out + bias[slots]


def _experts(module: ExpertsModule, states: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
             first: torch.Tensor, first_scale: torch.Tensor | None, first_bias: torch.Tensor | None,
             down: torch.Tensor, down_scale: torch.Tensor | None, down_bias: torch.Tensor | None,
             has_gate: bool, transposed: bool) -> torch.Tensor:
    """``[T, H], [T, k] slots, [T, k] weights → [T, H]``: the MoE layer's routed experts. Int8 rows
    and untransposed 16-bit rows of :data:`GROUPED_MIN_TOKENS` tokens or more go to the grouped
    kernels where they are loaded."""
    int8 = first_scale is not None and down_scale is not None
    half = not transposed and first.dtype == down.dtype == states.dtype
    if (int8 or half) and states.shape[0] >= GROUPED_MIN_TOKENS and few_rows.loaded():
        h = _grouped_project(states, first, slots, first_scale, first_bias).to(states.dtype)
        h = module._apply_gate(h) if has_gate else module.act_fn(h)
        out = _grouped_project(h, down, slots, down_scale, down_bias)
    else:
        x = states if first_scale is None else float_buffer(states)  # int8 rows: see float_buffer
        h = _project(x, first, slots, first_scale, first_bias, transposed).to(states.dtype)
        h = module._apply_gate(h) if has_gate else module.act_fn(h)
        out = _project(h, down, slots, down_scale, down_bias, transposed)
    return (out * weights.unsqueeze(-1).float()).sum(1).to(states.dtype)


GROUPED_MIN_TOKENS = 2
"""Tokens from which a layer call's int8 and untransposed 16-bit experts take the grouped kernels
(``moetray::int8_experts_mm``, ``moetray::half_experts_mm``: :mod:`~moetray.engine.models.few_rows`):
with one token each routed expert has one pair, and the compiled reduction fuses with the gate and
the sum over top-k around it; from two, pairs share experts (the demo's 12 of 16 at four tokens: 48
pairs, about 16 experts), and the kernel reads each expert once for all of them where the reduction
reads it once per pair. Measured on this project's AMD EPYC host, the demo's geometry (30 layers of
12-of-16 int8 experts, 64 neurons) in one compiled graph with the C++ wrapper and a symbolic batch,
2 threads, ms a pass: 2 tokens 5.3 against the reduction's 8.5, 4 tokens 6.6 against 11.5, 8 tokens
11.8 against 23.5 (one thread: 10.3 against 20.4 at 4). Served at four requests (int8, processes
interleaved, two rounds each): the step's graph 25.1-29.8 against 28.6-31.8 ms, the machine's speed
drifting more than that between runs. bfloat16, the same geometry, one compiled call a layer, one
thread, ms a pass: 4 tokens 8.4 against the reduction's 17.7, 8 tokens 11.0 against 31.6 (2 threads,
4 tokens: 6.3 against 10.5; float16, without the bfloat16 pair products: 12.2 against 17.8)."""

KERNEL_GRAPHS = 64
"""Graphs dynamo may compile for the kernel in one process (its default stops at 8): one per dtype,
int8 or float rows, family gate, layout and batch class (1, then symbolic). A process serving one
model needs about 4; a process serving several (the benches, the test suite) meets more, and at
the limit ``fullgraph=True`` makes compilation fail, so the grouped GEMMs would serve. A limit of
this region's own: the global one is not reliably left as set (the full test suite saw it at 8)."""
_compiled = compile_region(_experts, fullgraph=True, recompile_limit=KERNEL_GRAPHS,
                           options={"cpp.threads": 1})
"""One thread, no OpenMP region to wake: the kernel serves decode steps, which run on one intra-op
thread where it serves (:mod:`moetray.policy.step_threads`)."""


class FusedExperts:
    """The compiled kernel bound to one runtime's slot pool (rebound after a resize)."""

    def __init__(self, geometry: ExpertGeometry, int8_layout: Int8Layout | None, rows: torch.Tensor):
        self.geometry = geometry
        self.int8_layout = int8_layout
        self.transposed = geometry.is_transposed and int8_layout is None  # int8 rows are [out, in]
        few_rows.build()  # the grouped kernels of a step's experts (GROUPED_MIN_TOKENS)
        self.views = self._views(rows)
        self.calls = 0  # layer calls the kernel computed (what tests and benches count)

    def bind(self, rows: torch.Tensor) -> None:
        """Point the kernel at a new pool (after a resize)."""
        self.views = self._views(rows)

    def _views(self, rows: torch.Tensor) -> PoolViews:
        views = (PoolViews.of_int8_rows(rows, self.int8_layout) if self.int8_layout is not None
                 else PoolViews.of_float_rows(rows, self.geometry))
        for t in views.tensors():
            torch._dynamo.maybe_mark_dynamic(t, 0)  # capacity: a re-split must not recompile
        return views

    def __call__(self, module: ExpertsModule, states: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self._run(module, states, slots, weights)

    def _run(self, module: ExpertsModule, states: torch.Tensor, slots: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
        return self.traced(module, states, slots, weights, kernel=_compiled)

    def traced(self, module: ExpertsModule, states: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
               *, kernel: Callable[..., torch.Tensor] = _experts) -> torch.Tensor:
        """The kernel's arithmetic on this pool. Called from a compiled decode step's trace, it is
        part of that graph (no compiled call of its own, no guards per layer); the slots come from
        the step's slot table or ``moetray::expert_slots`` (``resident.py``), and the call is counted
        when the planner sees it."""
        v = self.views
        return kernel(module, states, slots, weights, v.first, v.first_scale, v.first_bias,
                      v.down, v.down_scale, v.down_bias, self.geometry.has_gate, self.transposed)

    def warm_up(self, module: ExpertsModule, hidden: int, dtype: torch.dtype, top_k: int) -> None:
        """Compile now (batch 1, then batch 2, after which the batch size is symbolic), so the first
        request does not wait for it; raises what compilation raised."""
        with torch.no_grad():  # as the batching loop calls it (inference mode would compile another graph)
            for tokens in (1, 2):
                states = torch.zeros(tokens, hidden, dtype=dtype)
                slots = torch.zeros(tokens, top_k, dtype=torch.long)
                weights = torch.zeros(tokens, top_k, dtype=dtype)
                self._run(module, states, slots, weights)


def compile_kernel(module: ExpertsModule, geometry: ExpertGeometry, int8_layout: Int8Layout | None,
                   rows: torch.Tensor, *, hidden: int, dtype: torch.dtype,
                   top_k: int) -> tuple[FusedExperts | None, str | None]:
    """``(kernel, None)`` compiled and warm for ``module``'s family, or ``(None, why not)``."""
    if getattr(module, "has_post_expert_norm", False):
        return None, "the experts have a post-expert norm"
    kernel = FusedExperts(geometry, int8_layout, rows)
    try:
        kernel.warm_up(module, hidden, dtype, top_k)
    except Exception as exc:  # no C++ compiler, a gate inductor cannot trace, …
        log.warning("decode kernel not compiled, the grouped GEMMs serve: %s", exc)
        return None, f"compilation failed: {type(exc).__name__}: {str(exc)[:200]}"
    return kernel, None
