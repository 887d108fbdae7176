"""One-row products and one-query attention as loops the compiler writes itself.

A decode step of one request multiplies every weight matrix by a single row of activations.
torch's CPU matrix product is built for many rows: for one row of bfloat16 it runs a generic dot
kernel at ~5 G weights/s on one core of this machine, while the same product written as a
broadcast multiply and a float32 sum over the inputs compiles (inductor, C++) to a vector loop
that streams the weights at ~13-15 G weights/s. With more rows that loop reads the weights once
per row (4 rows: half the speed of the matrix product), so only one-row products take it.

Rules:
- Traced inside the compiled decode step, a decoder's plain ``nn.Linear`` with a bfloat16 or
  float16 weight takes the few-rows kernel up to eight rows (``engine/models/few_rows.py``: oneDNN
  streams a few rows at about half its speed), a bfloat16 one-row product too (its pairs multiply
  by ``vdpbf16ps``; the demo in bfloat16, one process, two pairs of runs of 384 steps, the graph's
  call against the multiply-and-sum: 10th percentiles 8.55 / 9.24 and 9.16 / 9.50 ms, medians
  9.11 / 9.72 and 9.67 / 10.8); a float16 one-row product, or one where the kernel does not serve,
  is the multiply-and-sum; more rows keep ``F.linear``.
- So is a decoder's int8 linear (the int8 format's ``Int8Linear``) with one input row, over its
  activations widened to float32 first (:func:`one_row_int8_product`): measured on this machine's
  CPU, one thread, a step's 30 layers of int8 attention and shared-expert linears took 3.3 ms that
  way against 4.3 ms as torch's weight-only int8 kernel (``_weight_int8pack_mm``, 240 calls from
  the graph) and 10.9 ms reading bfloat16 activations in the loop. Other calls keep
  ``Int8Linear``'s product: up to eight rows the few-rows kernel (``engine/models/few_rows.py``).
  That kernel at one row too, in place of this loop, measured slower in the step (demo, int8,
  2 cores, one process each, paired runs: 13.2-13.5 against 12.5-12.6 ms a token): the loop
  fuses with its neighbours, the kernel is a call of its own.
- The LM head runs after the decoder, eagerly: its one-row products are the few-rows kernel's
  where it serves (a call of its own either way; :meth:`OneRowHead.__call__` has the measurements),
  else they call a small compiled region of the same formula (the largest matrix of a small model:
  vocabulary × hidden; an int8 head too: 1.1 ms against torch's int8 kernel's 1.7-2.1 ms on the
  demo's head, one thread), at one thread or at the engine's whole budget (a decode team, a
  prefill's last-token logits), both compiled at start. At one thread a large head's rows are
  computed in blocks shared with a helper thread over the budget (:meth:`OneRowHead.__call__`;
  the kernel's call and the region's C++ entry release the GIL, so blocks run side by side).
  Other thread counts keep the library's product rather than compile again mid-request; a
  failure logs why and keeps it too. Several rows take the library's product, for a 16-bit head
  up to eight rows the few-rows kernel's (``few_rows.half_product``).
- Eager calls (prefill, a refused graph) and float32 weights (the token-identity reference) are
  untouched. The rounding is the lossy formats' own: float32 accumulation, one final rounding.

A one-row product the decoder writes as ``F.linear`` on a weight of its own (an MoE router's gate:
``Qwen2MoeTopKRouter`` and its kin keep a bare ``weight``, not an ``nn.Linear``) reaches the graph
as a matrix product; :class:`OneRowMatmuls`, an inductor pass on the compiled step's graph, turns
each statically one-row 16-bit ``mm`` into the same multiply-and-sum, which fuses into its
neighbours (the router's softmax) instead of a library call between two kernels.

Attention of a decode step is the same story: torch's CPU flash attention kernel, called per head
on a few hundred cached keys, costs more in set-up than in arithmetic. Traced in the compiled step
(at most its ``max_tokens`` query tokens), transformers' ``"sdpa"`` attention is two float32
batched products (``bmm``: scores, weighted values) around a softmax that inductor fuses
(:func:`few_query_sdpa`). Written as multiply-and-sums instead, inductor fused the query's rotary
embedding into the score loop (its sines and cosines recomputed for every cached key) and summed the
values along the keys, gathering each key's row from the paged cache once per value column: one
layer's attention on 160 cached keys took 309 µs against 69 µs as products (one thread, the demo's
9 heads on 3 KV heads), and the demo's int8 decode took 19.9 against 17.1 ms a token, interleaved
servers. Several query tokens (a batch's requests, one each, or a short chunk) take the products
under the batch's mask, which scores every query against every sequence's keys: with 4 sequences of
80 keys, one layer's gather and attention took 94-150 µs against 136-230 µs for the flash kernel
under the same mask (2 threads; 155-186 against 292-392 at one). Several tokens without a mask
(causal) and every eager call keep the kernel.
"""

from __future__ import annotations

import itertools
import logging
import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from moetray.engine.compiling import CPP_WRAPPER, compile_region
from moetray.engine.experts.fused import float_buffer
from moetray.engine.helpers import share_out
from moetray.engine.models import few_rows
from moetray.engine.models.precision import Int8Linear, half_linear, int8_product

log = logging.getLogger(__name__)

HALF_DTYPES = (torch.bfloat16, torch.float16)

HEAD_GRAPHS = 64
"""Graphs the LM head's region may compile per process: one per head shape (a serving process has
one; the test suite and the benches meet many). At the limit the head keeps ``F.linear``."""


def compilation_failure(exc: BaseException) -> str:
    """A compiled region's refusal reason: the exception's type and first line."""
    return f"compilation failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"


def one_row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as a broadcast multiply and a float32 sum over the inputs."""
    out = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def one_row_int8_product(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """:class:`~moetray.engine.models.precision.Int8Linear`'s product (``x @ (qweight · scale)ᵀ``) as
    a multiply-and-sum over float32 activations in a buffer of their own (:func:`float_buffer`:
    the int8 rows then load at float32's vector width)."""
    out = (float_buffer(x).unsqueeze(-2) * qweight.float()).sum(-1) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _one_row(x: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1]


def _traced_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        if _one_row(x) and not (x.dtype == torch.bfloat16 and few_rows.serves(1)):
            return one_row_product(x, self.weight, self.bias)
        return few_rows.half_product(x, self.weight, self.bias)
    return half_linear(x, self.weight, self.bias)


def _traced_int8_linear(self: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() and _one_row(x):
        return one_row_int8_product(x, self.qweight, self.qscale, self.bias)
    return Int8Linear.forward(self, x)


_ONE_ROW_MATMULS = PatternMatcherPass(pass_name="moetray_one_row_matmuls")


def _one_row_half(match: Match) -> bool:
    """The matched ``mm(a, b)`` has one row, known at compile time, of 16-bit activations."""
    a, b = (node.meta.get("val") for node in match.args)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype in HALF_DTYPES
            and b.dtype == a.dtype and statically_known_true(a.shape[0] == 1))


@register_graph_pattern(CallFunction(torch.ops.aten.mm.default, Arg(), Arg()), extra_check=_one_row_half,
                        pass_dict=_ONE_ROW_MATMULS)
def _one_row_matmul(match: Match, a: torch.fx.Node, b: torch.fx.Node) -> None:
    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.float().unsqueeze(-2) * b.t().float()).sum(-1).to(a.dtype)

    match.replace_by_example(product, [a, b])
    OneRowMatmuls.replaced += 1


class OneRowMatmuls(CustomGraphPass):
    """The compiled decode step's post-grad pass: every one-row 16-bit ``aten.mm`` left in its graph
    (``F.linear`` on a bare weight: an MoE router's gate) becomes a float32 multiply-and-sum.
    Measured on the demo (int8, batch 1, 2 cores): the router's product was a library call of
    ~35-40 µs between two kernels (4 µs when repeated back to back: the cost is the boundary, with
    caches cold after a layer's kernels), ~1.1 ms of a ~19 ms step over 30 layers; fused into the
    router's softmax kernel, two servers in one process, interleaved: 24.5 against 26.8 ms a token
    (medians of 6 paired rounds, every round faster). Counts the products it replaced (at compile
    time: a graph from inductor's cache is not passed again)."""

    replaced = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        _ONE_ROW_MATMULS.apply(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


SHARED_HEAD_MIN_WEIGHTS = 4 << 20
"""LM heads of at least this many weights share a small step's rows out over the thread budget
(the demo's: 49152 × 576 = 28 M): below it one thread streams the head in ~0.25 ms or less, and
the hand-off and the parts' calls would eat what a second core saves."""

HEAD_PARTS_PER_THREAD = 2
"""Row blocks of a shared head per thread of the budget: a helper starting late leaves the caller
at most one block to wait for. Measured on the demo's head at a budget of two, bfloat16, one row:
1, 2, 4, 8 blocks a thread took 1.25, 1.25-1.28, 1.35-1.73, 1.8 ms (unshared 1.85); four rows
1.85, 1.7-1.8, 2.0, 2.15 ms (unshared 3.5)."""


class OneRowHead:
    """The LM head's forward: one-row products by the few-rows kernel where it serves, else through
    a compiled multiply-and-sum (a half-precision ``nn.Linear``'s or an ``Int8Linear``'s formula),
    and a small step's head shared over the cores; counts both."""

    def __init__(self, head: nn.Linear | Int8Linear) -> None:
        self.head = head
        self.graph = compile_region(
            one_row_int8_product if self.int8 else one_row_product,
            fullgraph=True, dynamic=False, recompile_limit=HEAD_GRAPHS,
            options=CPP_WRAPPER)  # its C++ entry releases the GIL: blocks run side by side
        self.reason: str | None = None  # why the head keeps the library's product; None while serving
        self.one_row_calls = 0  # one-row products (the kernel's or the compiled region's)
        self.thread_budget = 1  # the engine's threads (the compiled step's warm-up sets it)
        self.shared_calls = 0  # calls whose rows were shared out over the budget

    @property
    def int8(self) -> bool:
        """Whether the head is an ``Int8Linear`` (its formula is :func:`one_row_int8_product`)."""
        return isinstance(self.head, Int8Linear)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rules: at one intra-op thread (a small step: decode, a short prefill), a head of at least
        :data:`SHARED_HEAD_MIN_WEIGHTS` weights computes its output rows in blocks shared between
        this thread and one-thread helpers up to :attr:`thread_budget` (the step leaves the other
        cores idle: measured on the demo, the head was ~1.7 ms of a ~16 ms step at batch 1 and
        ~3.7 of ~35 at batch 4, streaming 56 MB of bfloat16 on one core); one-row products, at one
        thread or at the whole budget (a decode team's step, a prefill's last-token logits), take
        the few-rows kernel where it serves (``few_rows``; the demo's head, one row, ms, the
        compiled multiply-and-sum against the kernel, 3 rounds: int8 at two threads 0.88-1.04 /
        0.47-0.67, shared at one 1.36-1.68 / 0.91-1.04; bfloat16 1.67-1.76 / 1.31-1.42 and
        1.99-2.22 / 1.65-1.79), else the compiled multiply-and-sum; other shapes and other thread
        counts the library's product (a few rows: the few-rows kernel's)."""
        threads = torch.get_num_threads()
        compiled = threads in (1, self.thread_budget) and not torch.is_grad_enabled()
        weight = self.head.qweight if isinstance(self.head, Int8Linear) else self.head.weight
        if compiled and threads == 1 and self.thread_budget > 1 and weight.numel() >= SHARED_HEAD_MIN_WEIGHTS:
            return self._shared(x, weight.shape[0])
        return self._rows(x, 0, weight.shape[0], compiled=compiled)

    def warm_up(self, thread_budget: int) -> None:
        """Share small steps' heads over ``thread_budget`` threads from now on, and compile here the
        one-row products they take (dynamo guards on the thread count): the whole head at the
        budget's threads, and the row blocks one after another at one thread, so no request (and
        no helper) waits for a compilation."""
        self.thread_budget = thread_budget
        if few_rows.serves(1):  # its one-row products are the kernel's: nothing to compile
            return
        head = self.head
        weight = head.qweight if isinstance(head, Int8Linear) else head.weight
        dtype = head.qscale.dtype if isinstance(head, Int8Linear) else weight.dtype
        x = torch.zeros(1, 1, weight.shape[1], dtype=dtype)
        before = torch.get_num_threads()
        try:
            with torch.no_grad():
                if thread_budget > 1:
                    torch.set_num_threads(thread_budget)
                    self._rows(x, 0, weight.shape[0], compiled=True)
                    if weight.numel() >= SHARED_HEAD_MIN_WEIGHTS:
                        torch.set_num_threads(1)
                        for lo, hi in self._blocks(weight.shape[0]):
                            self._rows(x, lo, hi, compiled=True)
        finally:
            torch.set_num_threads(before)

    def _blocks(self, rows: int) -> list[tuple[int, int]]:
        parts = HEAD_PARTS_PER_THREAD * self.thread_budget
        return list(itertools.pairwise(rows * i // parts for i in range(parts + 1)))

    def _shared(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        out = x.new_empty((*x.shape[:-1], rows))

        def block(lo: int, hi: int) -> Callable[[], None]:
            def run() -> None:
                out[..., lo:hi].copy_(self._rows(x, lo, hi, compiled=True))
            return run

        share_out([block(lo, hi) for lo, hi in self._blocks(rows)], self.thread_budget)
        self.shared_calls += 1
        return out

    def _rows(self, x: torch.Tensor, lo: int, hi: int, *, compiled: bool) -> torch.Tensor:
        """Output rows ``lo:hi`` of the head's product (all of them: ``0:out_features``)."""
        head = self.head
        bias = None if head.bias is None else head.bias[lo:hi]
        if isinstance(head, Int8Linear):
            args: tuple[Any, ...] = (x, head.qweight[lo:hi], head.qscale[lo:hi], bias)
            library: Callable[..., torch.Tensor] = int8_product
        else:
            args, library = (x, head.weight[lo:hi], bias), few_rows.half_product
        if compiled and _one_row(x) and few_rows.serves(1):
            self.one_row_calls += 1
            return library(*args)  # the few-rows kernel's one-row product
        if compiled and self.reason is None and _one_row(x):
            try:
                out = self.graph(*args)
            except Exception as exc:  # noqa: BLE001 - a compilation failing: keep the library's product
                self.reason = compilation_failure(exc)
                log.warning("the LM head's one-row products use the library's: %s", self.reason, exc_info=exc)
            else:
                self.one_row_calls += 1
                return out
        return library(*args)


def install_one_row_products(model: nn.Module) -> OneRowHead | None:
    """Route ``model``'s one-row products as the rules say: the decoder's half-precision and int8
    linears when traced, the LM head eagerly (building the few-rows kernels their few-row products
    take). Returns the head's router (None: the head is neither a half-precision ``nn.Linear`` nor
    an ``Int8Linear``)."""
    decoder = model.model
    assert isinstance(decoder, nn.Module), "a causal LM keeps its decoder as .model"
    few_rows.build()
    for module in decoder.modules():
        if type(module) is nn.Linear and module.weight.dtype in HALF_DTYPES:
            module.forward = types.MethodType(_traced_linear, module)  # type: ignore[method-assign]
        elif type(module) is Int8Linear:
            module.forward = types.MethodType(_traced_int8_linear, module)  # type: ignore[method-assign]
    head = getattr(model, "lm_head", None)
    if not (type(head) is Int8Linear or type(head) is nn.Linear and head.weight.dtype in HALF_DTYPES):
        return None
    router = OneRowHead(head)
    head.forward = router  # type: ignore[method-assign]
    return router


def few_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Attention of a few query tokens, ``[B, heads, N, D]``, in float32: two batched matrix products
    (scores, then the weighted values) around a softmax that inductor fuses. Grouped KV heads are
    read in place (each KV head's queries are the rows of its product); ``mask`` is boolean (True
    attends) or additive, broadcast over batch/heads. A masked-out score is float32's lowest, not
    -inf: a query that attends to nothing gets finite values, never NaN."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q = query.float().reshape(batch * kv_heads, group * queries, dim) * scale
    k = key.float().reshape(batch * kv_heads, keys, dim)
    scores = torch.bmm(q, k.transpose(1, 2)).reshape(batch, kv_heads, group, queries, keys)
    if mask is not None:
        mask = mask.expand(batch, heads, queries, keys).reshape(batch, kv_heads, group, queries, keys)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        else:
            scores = (scores + mask.float()).clamp_min(torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1).reshape(batch * kv_heads, group * queries, keys)
    value_dim = value.shape[-1]  # a latent-attention model's values are narrower than its keys
    out = torch.bmm(weights, value.float().reshape(batch * kv_heads, keys, value_dim))
    return out.reshape(batch, heads, queries, value_dim).to(query.dtype)


def few_query_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``"sdpa"`` attention (``sdpa_attention_forward``), except traced in a compiled
    step (at most its ``max_tokens`` query tokens): :func:`few_query_attention` instead of the flash
    kernel, for one query token or for several under the batch's mask (no mask would mean causal)."""
    plain = not any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux"))
    one_or_masked = statically_known_true(query.shape[2] == 1) or attention_mask is not None
    if (torch.compiler.is_compiling() and one_or_masked and dropout == 0.0 and plain
            and not kwargs.get("output_attentions", False)):
        out = few_query_attention(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def install_few_query_attention() -> None:
    """Serve transformers' ``"sdpa"`` name with :func:`few_query_sdpa` (process-wide, idempotent:
    continuous batching accepts only its own attention names, and eager calls are unchanged)."""
    AttentionInterface.register("sdpa", few_query_sdpa)
