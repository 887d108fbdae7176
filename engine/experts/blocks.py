"""The compiled decode step around the experts: each MoE block and its layer's norms through inductor.

With the experts on the compiled kernel (:mod:`moetray.engine.experts.fused`), most of a batch-1
step is small eager ops around them: per layer, the router (linear, softmax, top-k, normalise),
the shared expert (three linears, an activation), its sigmoid gate, the residual sums and two
RMSNorms, each a separate ATen call of ~10-20 µs (the demo: ~25 a layer, 30 layers). Compiling
each MoE block's ``forward`` and its decoder layer's norms fuses them into a few kernels; the
experts call itself stays outside the graphs (:func:`~moetray.engine.experts.runtime.moetray_experts_forward`
is ``torch.compiler.disable``-d: dynamo breaks the graph there and resumes after it). Every layer
shares the same code, so the graphs compile once for all layers (the modules are graph inputs).
Measured on the demo in bfloat16, 2 cores, one process: a batch-1 forward 0.77× the time with the
kernel alone.

Applied only where the kernel serves (a lossy format on the CPU): float32 stays eager and exact.
Compiled at load by one quiet call of the first block at batch 1 and 2 (its routing is not
counted: :meth:`~moetray.engine.experts.runtime.ExpertRuntime.forget_warm_up`); a failure puts
every block back to eager and says why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moetray.engine.experts.fused import compile_failure

__all__ = ["NORM_NAMES", "compile_blocks"]

log = logging.getLogger(__name__)

NORM_NAMES = ("input_layernorm", "post_attention_layernorm")
"""A decoder layer's norms compiled with its block (the names transformers' decoder layers use)."""


def _parents(model: torch.nn.Module, modules: list[Any]) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """Each Experts module's ``(MoE block, decoder layer)``: its parent and grandparent."""
    names = {id(m): name for name, m in model.named_modules()}
    out = []
    for experts in modules:
        name = names[id(experts)]
        block_name = name.rsplit(".", 1)[0]
        layer_name = block_name.rsplit(".", 1)[0]
        out.append((model.get_submodule(block_name), model.get_submodule(layer_name)))
    return out


def compile_blocks(model: torch.nn.Module, runtime: Any, hidden: int) -> str | None:
    """Compile every MoE block and its layer's norms where the runtime's kernel serves; warm them up.

    Returns None when compiled, else why not (the blocks are then eager, as loaded).
    """
    if runtime.fused is None:
        return "the experts are not on the compiled kernel"
    compiled: list[torch.nn.Module] = []
    for block, layer in _parents(model, runtime.modules):
        for module in (block, *(getattr(layer, n, None) for n in NORM_NAMES)):
            if isinstance(module, torch.nn.Module) and module not in compiled:
                module.forward = torch.compile(module.forward)
                compiled.append(module)
    first_block = _parents(model, runtime.modules[:1])[0][0]
    dtype = runtime.store.dtype
    try:
        with torch.no_grad():  # as the batching loop calls them
            for tokens in (1, 2):
                first_block(torch.zeros(1, tokens, hidden, dtype=dtype))
    except Exception as exc:  # an op inductor cannot lower, a compiler that fails, …
        for module in compiled:
            del module.forward
        log.warning("MoE blocks not compiled, they run eager: %s", exc)
        return compile_failure(exc)
    finally:
        runtime.forget_warm_up()
    log.info("compiled %d MoE blocks and norms", len(compiled))
    return None
