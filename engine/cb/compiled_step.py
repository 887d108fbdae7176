"""The compiled decode step: a decode-size step's whole decoder as one ``torch.compile`` graph.

On a small model a decode step is hundreds of small operators (norms, rotary, projections,
residuals, the router) per layer, and in eager mode their Python dispatch costs more than their
arithmetic. Compiled, the decoder is one graph: the elementwise work is fused into a few C++
kernels and the projections are called back to back, by a wrapper that is C++ too
(``compiling.CPP_WRAPPER``: a Python one ran ~5,000 lines a step on the demo). Two parts cannot
be traced and are opaque operators in the graph: a layer's routed experts (``moetray::experts``,
``engine/experts/opaque.py``; where the experts' kernel serves, only the planning of a call that
misses, and the planner is shown the calls that hit after the step: ``engine/experts/resident.py``)
and, for an allocator the step cannot trace, the paged KV write and read-back (``moetray::paged_kv``
below). The substrate's own ``PagedAttentionCache.update`` is ``torch.compiler.disable``-d, which
would split the graph at every layer; a full-attention layer's write and read-back are traced
instead, as index operations on its allocator's one flat KV view (:class:`FlatKV`).

Rules:
- Only steps of at most ``max_tokens`` query tokens that read cached KV (a decode step, a small
  batch of them, or a short follow-up chunk) take the graph; prefill runs eagerly (its matrix
  products dominate, and prompt lengths would each be a shape to compile).
- Compiled at start-up by :meth:`CompiledDecodeStep.warm_up` (one graph for a single token, one
  with a symbolic token count), so no request waits for a compilation; the graphs outlive a KV
  re-split (the new cache's update is installed the same way, and the sizes are symbolic).
- Lossy formats only (the caller decides): fused kernels round differently from eager code, and
  float32 stays the token-identity reference. A failed compilation logs why and leaves eager steps.
- Each step checks only the guards that can change while it serves (:func:`keeps_step_guard`):
  after install the decoder's modules are not restructured, so of theirs only constants are checked.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cache_allocators.full_attention import (
    FullAttentionCacheAllocator,
)

from moetray.engine.cb.one_row import (
    OneRowHead,
    OneRowMatmuls,
    compilation_failure,
    install_few_query_attention,
    install_one_row_products,
)
from moetray.engine.cb.state import StateGeometry
from moetray.engine.compiling import CPP_WRAPPER, UNCHECKED_WRAPPER, compile_region
from moetray.engine.experts.runtime import MODULE_ATTRIBUTE_PREFIX, runtimes_in
from moetray.policy.step_threads import step_threads

log = logging.getLogger(__name__)

_ATTR = "_moetray_decode_step"
_STEP = threading.local()  # .cache: the paged cache of the compiled step running on this thread

_LIB = torch.library.Library("moetray", "FRAGMENT")
_LIB.define("paged_kv(Tensor key, Tensor value, Tensor read_index, Tensor write_index, int layer)"
            " -> (Tensor, Tensor)")


def _paged_kv(key: torch.Tensor, value: torch.Tensor, read_index: torch.Tensor, write_index: torch.Tensor,
              layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a layer's new keys and values into the running step's paged cache, return what
    attention reads."""
    allocator = _STEP.cache.layer_to_allocator[layer]
    keys, values = allocator.update(key, value, layer, read_index, write_index)
    if keys is key:  # nothing cached to read: the substrate hands the inputs back; an op may not alias
        return key.clone(), value.clone()
    return keys, values


def _paged_kv_shape(key: torch.Tensor, value: torch.Tensor, read_index: torch.Tensor,
                    write_index: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = read_index.shape[0]
    return key.new_empty((tokens, *key.shape[1:])), value.new_empty((tokens, *value.shape[1:]))


_LIB.impl("paged_kv", _paged_kv, "CompositeExplicitAutograd")
torch.library.register_fake("moetray::paged_kv", _paged_kv_shape, lib=_LIB)


@dataclass(frozen=True)
class FlatKV:
    """A full-attention allocator's KV cache as one tensor ``[rows, heads, dim]``, and where each of
    its layers' keys and values start in it: the substrate's per-layer views are shifted views of
    this one, so a layer's token ``i`` is row ``start + i``.

    One graph input per allocator, its row count symbolic (a KV re-split makes a bigger or smaller
    one and must not recompile). Per-layer views would be thirty overlapping inputs, each mutated,
    which the compiler can only serve by rebuilding them from a common base every step. The starts
    are graph inputs too, one-element tensors: as Python ints they were compiled into each layer's
    kernels as constants, so no two layers shared a kernel (the demo's one-token graph: 61 kernel
    sources for its 61 kernel calls, against 35 with tensors)."""

    flat: torch.Tensor
    starts: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer → (first key row, first value row)

    @classmethod
    def of(cls, allocator: Any) -> FlatKV | None:
        """The allocator's flat view, or None where it is not a full-attention allocator whose views
        are the layout described (sliding windows read before they write; another substrate
        version may lay its views out otherwise: those keep ``moetray::paged_kv``)."""
        if type(allocator) is not FullAttentionCacheAllocator:
            return None
        views = getattr(allocator, "_kv_token_views", None)
        if not views:
            return None
        first = next(iter(views.values()))[0]
        flat = allocator.cache_tensor.view(-1, *first.shape[1:])
        row_bytes = flat.stride(0) * flat.element_size()
        starts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, pair in views.items():
            rows = []
            for view in pair:
                start, rest = divmod(view.data_ptr() - flat.data_ptr(), row_bytes)
                if rest or view.stride() != flat.stride() or view.shape[1:] != flat.shape[1:] \
                        or view.shape[0] != flat.shape[0] - start:
                    return None
                rows.append(torch.tensor(start, dtype=torch.long, device=flat.device))
            starts[layer] = (rows[0], rows[1])
        torch._dynamo.maybe_mark_dynamic(flat, 0)  # a re-split's cache has another size
        return cls(flat, starts)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, read_index: torch.Tensor,
               write_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The substrate's full-attention update on the flat view: write the new keys and values,
        then read every row attention needs."""
        key_start, value_start = self.starts[layer]
        self.flat.index_copy_(0, write_index + key_start, key)
        self.flat.index_copy_(0, write_index + value_start, value)
        return (self.flat.index_select(0, read_index + key_start),
                self.flat.index_select(0, read_index + value_start))


def _traceable_update(cache, key_states, value_states, layer_idx, kwargs):  # noqa: ANN001 - the substrate's signature
    """``PagedAttentionCache.update`` (index-based path), traced on a full-attention allocator's flat
    view or else as ``moetray::paged_kv``; eager calls keep the substrate's own method."""
    if not torch.compiler.is_compiling():
        return type(cache).update(cache, key_states, value_states, layer_idx, kwargs)
    allocator = cache.layer_to_allocator[layer_idx]
    kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
    kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    read_index = kwargs["read_index"][allocator.index]
    write_index = kwargs["write_index"][allocator.index]
    key, value = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))  # [T, heads, dim]
    flat_kv = cache.moetray_flat_kv.get(allocator.index)
    if flat_kv is not None:
        key, value = flat_kv.update(key, value, layer_idx, read_index, write_index)
    else:
        key, value = torch.ops.moetray.paged_kv.default(key, value, read_index, write_index, layer_idx)
    return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)


WARM_UP_STEPS = ((1, 2), (1, 1), (2, 1))
"""(query tokens, 1/share of a page cached) of the warm-up steps, which build the two graphs serving
uses: one token at any KV length (a batch of one), and any token count (a batch, a short chunk).
Their KV-length sizes are symbolic from the first (:func:`mark_kv_lengths_symbolic`), so a changed
KV length takes the same graph and a changed token count compiles the second (dynamo makes a size
symbolic once it varies). The first step caches half a page, the sizes dynamo traced the one-token
graph at when it made them symbolic itself (the second step): a warm compile cache then held every
graph already (no new entry), the same code as before the marking."""


def mark_kv_lengths_symbolic(kwargs: dict[str, Any]) -> None:
    """Mark a step's sizes that follow the KV length (the attention mask's key axis, each allocator's
    read index) symbolic before dynamo first traces the step. Left to dynamo, the first warm-up step
    compiled a graph for its own KV length only and the second compiled the symbolic one: on the
    demo (bfloat16, 2 cores, warm compile cache) the first graph took ~8 s of a 54 s warm-up and
    served no step after it. A model with sliding windows passes one mask per attention kind."""
    masks = kwargs.get("attention_mask")
    for mask in masks.values() if isinstance(masks, dict) else [masks]:
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            torch._dynamo.maybe_mark_dynamic(mask, 3)
    for read_index in kwargs.get("read_index") or []:
        torch._dynamo.maybe_mark_dynamic(read_index, 0)


STEP_GRAPHS = 64
"""Graphs the step may compile: the warm-up's (three, the first soon replaced) and any a different
thread count or a new kind of step needs. Dynamo counts them per code object, and each step has a
code object of its own (:func:`_own_code`). At the limit a step fails and runs eagerly."""

MODULE_GUARDS_KEPT = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "ID_MATCH"})
"""The guards on the decoder's modules that a step's graph keeps, on the attributes moetray binds to
them (``MODULE_ATTRIBUTE_PREFIX``): an experts runtime and its layer, which a rebuild may rebind."""

UNCHANGING_GUARDS = frozenset({"DUPLICATE_INPUT", "NOT_PRESENT_IN_GENERIC_DICT"})
"""Guards on an input or a global that serving never changes: two inputs being one object (the
runner makes a step's index tensors; the paged cache's parts are its own) and an attribute being
shadowed on an instance (the library's registries, the cache's allocators; the cache's one
shadowed method is installed before its first step and checked by its type and closure)."""


def keeps_step_guard(guard_type: str, *, name: str, from_module: bool) -> bool:
    """Whether a compiled step checks this guard before every step. Pure.

    Dynamo guards everything the trace read: on the demo (30 layers) that is ~9,700 guards for the
    one-token graph, ~8,400 of them on the decoder's modules (hook dicts empty, attributes not
    shadowed, types, every parameter's metadata, every config number), checked before each step.
    Installed once and never restructured while serving (formats convert at load, hooks are not
    added, a re-split rebinds the expert pool's views at a symbolic capacity), the modules only need
    moetray's own attributes checked; of the rest, :data:`UNCHANGING_GUARDS` go too; inputs, global
    state and shapes keep every other guard. Measured, demo in int8 at batch 1 (one process,
    rounds interleaved): keeping every module constant (1,372 guards) cost ~1 ms of a ~14 ms step
    against checking none (dynamo's ``skip_guard_eval_unsafe``); this rule (365) matched checking
    none. A graph never serves another decoder: each step's code object is its own (:func:`_own_code`)."""
    if from_module:
        return guard_type in MODULE_GUARDS_KEPT and MODULE_ATTRIBUTE_PREFIX in name
    return guard_type not in UNCHANGING_GUARDS


_STEP_CODES = itertools.count()


def _own_code(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` behind a function whose code object belongs to one step: dynamo keeps graphs and
    their guards per code object, and with the modules' guards filtered a graph of one decoder
    must never be tried on another of the same class."""
    def step(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)
    code = step.__code__.replace(co_name=f"decode_step_{next(_STEP_CODES)}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


class CompiledDecodeStep:
    """The decoder's forward, compiled for decode-size steps; counts which steps took the graph."""

    def __init__(self, decoder: torch.nn.Module, *, max_tokens: int, head: OneRowHead | None = None) -> None:
        self.max_tokens = max_tokens
        self.head = head  # the LM head's one-row products (engine/cb/one_row.py): half precision or int8
        self.eager = decoder.forward
        # The experts runtimes whose slot tables the graph reads: each settles a step's calls after it.
        self.runtimes = runtimes_in(decoder)
        # Sizes turn symbolic as they vary; a few graphs per thread count (the limit is this region's).
        self.graph = compile_region(
            _own_code(self.eager), fullgraph=True, recompile_limit=STEP_GRAPHS,
            options={"guard_filter_fn": self._filter_guards, **UNCHECKED_WRAPPER, **CPP_WRAPPER,
                     "post_grad_custom_post_pass": OneRowMatmuls()})
        self.reason: str | None = None  # why steps run eagerly; None while the graph serves
        self.compiled_steps = 0
        self.eager_steps = 0
        self.guards_kept = 0  # the newest graph's guards, checked before every step it serves
        self.guards_dropped = 0
        self.warming = False  # the warm-up's steps run: their KV lengths are marked symbolic
        decoder.forward = self.forward
        setattr(decoder, _ATTR, self)

    def serves(self, kwargs: dict[str, Any]) -> bool:
        """A step of at most ``max_tokens`` query tokens that reads cached KV, through a cache whose
        update is traceable, without autograd."""
        ids = kwargs.get("input_ids")
        reads = kwargs.get("read_index") or []
        return (
            self.reason is None
            and ids is not None
            and ids.shape[-1] <= self.max_tokens
            and len(reads) > 0
            and all(r.numel() > 0 for r in reads)
            and getattr(kwargs.get("cache"), "moetray_traceable", False)
            and not torch.is_grad_enabled()
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.serves(kwargs):
            self.eager_steps += 1
            return self.eager(*args, **kwargs)
        _STEP.cache = kwargs["cache"]
        if self.warming:
            mark_kv_lengths_symbolic(kwargs)
        try:
            out = self.graph(*args, **kwargs)
        except Exception as exc:  # a compilation failing now: serve eagerly from here on
            for runtime in self.runtimes:
                runtime.resident.forget_step(runtime.op_key)
            self._refuse(exc)
            self.eager_steps += 1
            return self.eager(*args, **kwargs)
        finally:
            _STEP.cache = None
        for runtime in self.runtimes:
            runtime.settle_step()
        self.compiled_steps += 1
        return out

    def _filter_guards(self, entries: list[Any]) -> list[bool]:
        keep = [keeps_step_guard(e.guard_type, name=e.name,
                                 from_module=e.orig_guard.source.is_unspecialized_nn_module())
                for e in entries]
        self.guards_kept = sum(keep)
        self.guards_dropped = len(keep) - self.guards_kept
        return keep

    def _refuse(self, exc: BaseException) -> None:
        self.reason = compilation_failure(exc)
        log.warning("the decode step runs eagerly: %s", self.reason, exc_info=exc)

    def install(self, cache) -> None:  # noqa: ANN001 - the substrate's PagedAttentionCache
        """Make ``cache``'s update traceable (each new KV pool): full-attention allocators through
        their :class:`FlatKV`, others through ``moetray::paged_kv``."""
        flat = {a.index: FlatKV.of(a) for a in cache.cache_allocators.values()}
        cache.moetray_flat_kv = {index: f for index, f in flat.items() if f is not None}
        cache.moetray_traceable = True
        cache.update = types.MethodType(_traceable_update, cache)

    def warm_up(self, model_runner, model, *, page_size: int, thread_budget: int,  # noqa: ANN001
                one_thread_up_to: int, team: bool = False) -> None:
        """Compile the graphs decode steps take (1 token, and a symbolic 2..max_tokens) on the
        substrate's warm-up batches, on each thread count those steps may run on (dynamo guards on
        the thread count): :func:`step_threads`'s, and the whole budget too where a ``team`` may
        take them (``engine.cores.DecodeTeam``). Cheap once compiled: a new KV pool reuses the graphs."""
        if self.reason is not None:
            return
        started = time.perf_counter()
        before = self.compiled_steps
        if self.head is not None:
            self.head.warm_up(thread_budget)
        counts = sorted({step_threads(tokens, thread_budget, one_thread_up_to=one_thread_up_to,
                                      on_team=on_team)
                         for tokens, _ in WARM_UP_STEPS for on_team in {False, team}})
        self.warming = True
        try:
            with torch.no_grad():
                for threads in counts:
                    if threads != torch.get_num_threads():
                        torch.set_num_threads(threads)
                    for tokens, cached in WARM_UP_STEPS:
                        cached_tokens = max(1, page_size // cached)
                        model_runner.run_one_warmup(model, num_q_tokens=tokens, max_kv_read=cached_tokens)
        finally:
            self.warming = False
            torch.set_num_threads(thread_budget)
        if self.reason is None and self.compiled_steps != before + len(WARM_UP_STEPS) * len(counts):
            self.reason = "the warm-up steps did not take the graph"
        log.info("decode step warm-up on %s thread(s): %.1f s, %s", "/".join(map(str, counts)),
                 time.perf_counter() - started, "compiled" if self.reason is None else self.reason)


def decode_step_of(model: torch.nn.Module) -> CompiledDecodeStep | None:
    """The compiled decode step installed on ``model``'s decoder, if any."""
    decoder = getattr(model, "model", None)
    return getattr(decoder, _ATTR, None)


def decode_step_refusal(*, wanted: bool, kernel_serves: bool, hybrid: bool) -> str | None:
    """Why a model's decode steps stay eager, or None where they are compiled.

    Compiled where the experts' decode kernel serves (a lossy format on the CPU: the same rounding
    budget, and float32 stays the eager token-identity reference) on a model whose layers all
    trace (a hybrid's linear-attention layers keep recurrent state in Python)."""
    if not wanted:
        return "off (--no-compile)"
    if not kernel_serves:
        return "the experts' decode kernel does not serve this format or device"
    if hybrid:
        return "a hybrid model's linear-attention layers are not traced"
    return None


def install_decode_step(model: torch.nn.Module, *, max_tokens: int) -> CompiledDecodeStep:
    """Compile ``model``'s decoder for decode-size steps, its one-row products as a multiply-and-sum
    (graphs are built by the first runner's warm-up)."""
    decoder = model.model
    assert isinstance(decoder, torch.nn.Module), "a causal LM keeps its decoder as .model"
    head = install_one_row_products(model)
    install_few_query_attention()
    return CompiledDecodeStep(decoder, max_tokens=max_tokens, head=head)


def install_decode_step_where_served(model: torch.nn.Module, *, wanted: bool, kernel_serves: bool,
                                     max_tokens: int) -> str | None:
    """Install the compiled decode step where :func:`decode_step_refusal` allows it (the engine's
    load, and the benches that measure what it serves); returns the refusal (None: installed)."""
    hybrid = StateGeometry.from_config(model.config, next(model.parameters()).dtype) is not None
    refused = decode_step_refusal(wanted=wanted, kernel_serves=kernel_serves, hybrid=hybrid)
    if refused is None:  # the graphs are built by the first runner's start
        install_decode_step(model, max_tokens=max_tokens)
    return refused
