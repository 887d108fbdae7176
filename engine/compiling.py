"""``torch.compile`` for a region with a recompile limit of its own, on the torch versions users have.

The project pins torch 2.13 (this machine kind's CPU build), but a CUDA machine brings its own torch:
``torch.compile`` takes ``recompile_limit`` from 2.12 on, and an older one refuses the keyword. There
the region shares dynamo's global limit, raised to the region's if lower (never lowered: other regions
count on it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

TAKES_REGION_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters
"""Whether this torch's ``torch.compile`` takes a region's own ``recompile_limit``."""


UNCHECKED_WRAPPER = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
"""Inductor options for a region whose every call dynamo's guards admit first: without them the
generated Python wrapper asserts each input's sizes, strides and alignment, and each opaque
operator's output against its fake kernel, before it runs a kernel. On the demo's decode step
(30 layers, ~800 assertions a call) that was ~0.4 ms of a 9.5 ms int8 step (steps of one served
request, two runs each way: 9.6-11.1 ms a step with them, 9.1-9.2 without)."""


CPP_WRAPPER = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True,
               "aot_inductor.compile_wrapper_opt_level": "O0"}
"""Inductor options for a region whose generated Python wrapper costs more than its kernels' launches:
the wrapper is C++ (its entry releases the GIL while it runs), built apart from the kernels and
unoptimised (the kernels keep -O3). The demo's int8 decode step (30 layers) ran ~5,000 lines of
Python wrapper a step, ~800 of them allocations. Interleaved servers on the Q8_0 file, ms a token:
against the Python wrapper, -1.4 % at batch 1 (4/6 rounds) and -5 % at batch 4 (4/4); cold
warm-up 377 s against 381. The wrapper at -O1 gained 2-3 % more (5/6, 4/4 against -O0) but took
481 s cold: optimising one function of thousands of calls, once per graph, before serving."""


FUSED_MULTIPLY_ADD = {"cpp.enable_floating_point_contract_flag": "fast"}
"""Inductor options for every region: its C++ kernels are built with ``-ffp-contract=fast`` (inductor's
default is ``off``), so a product and the sum it feeds become one fused multiply-add, rounded once.
A one-row product's inner loop is a convert, a multiply and an add into one accumulator per 16
weights; fused, an instruction less and one rounding less. Every region compiled here serves lossy
formats only (float32, the token-identity reference, stays eager). Measured on the demo's Q8_0 file
(int8, 2 cores), two servers interleaved, ms a token at batch 1: 14 paired rounds, 11 faster, ~5 %
(medians 21.3 against 20.0 in the second run of 8); batch 4 unchanged (its products are torch's
int8 kernel, not generated code)."""


def inductor_keeping_no_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                              options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Inductor (``torch.compile``'s default backend, with :data:`FUSED_MULTIPLY_ADD` and the
    region's inductor ``options``), after which the traced graph is emptied: the compiled code never
    runs it, but the callable returned keeps the graph module alive (as a module stand-in), and with
    it every node's metadata (fake tensors, symbolic sizes, stack traces). On the demo's Q8_0 file
    served as int8 (warm compile cache), the decode step's graphs (~7,250 nodes each, 30 layers) and
    their lowered forms held ~170 MiB: the engine's RSS after three chats read 1042 MiB against 1212.
    A guard that fails later traces the function again, so the emptied graph is never needed."""
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, example_inputs, config_patches={**FUSED_MULTIPLY_ADD, **(options or {})})
    assert callable(compiled), type(compiled)  # an ahead-of-time export would return its files instead
    gm.graph = torch.fx.Graph()
    forget_cache_artifacts()
    return compiled


def forget_cache_artifacts() -> None:
    """Drop the compile caches' entries that torch keeps in memory after a compilation.

    Inductor and AOT autograd record every cache entry they load or write, as its pickled bytes, for
    ``torch.compiler.save_cache_artifacts`` (moving a cache to another machine), which moetray never
    calls: on the demo's int8 decode step (warm compile cache) they were 16 entries of 36 MiB; the
    engine (in-process, serving) read 860 MiB of RSS dropping them after each region's compilation
    against 874 keeping them. A torch without that record (older CUDA builds) has nothing to drop."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return
    CacheArtifactManager.clear()


def compile_region(fn: Callable[..., Any], *, recompile_limit: int, **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, **options)`` whose graphs are limited to ``recompile_limit`` per code object,
    compiled by :func:`inductor_keeping_no_graph`."""
    if TAKES_REGION_LIMIT:
        return torch.compile(fn, backend=inductor_keeping_no_graph,  # type: ignore[call-overload]
                             recompile_limit=recompile_limit, **options)
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, recompile_limit)
    return torch.compile(fn, backend=inductor_keeping_no_graph, **options)
