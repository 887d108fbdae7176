"""The continuous-batching seam: every touch of transformers' continuous-batching internals (5.24.x).

moetray plugs into ``transformers.generation.continuous_batching`` through the narrowest
hooks the substrate offers, one module per concern:

- ``runner`` — :class:`BatchRunner`: a manager sized to a KV pool, its lifecycle (start,
  pause for an expert-pool resize, stop for a KV re-split), submit / cancel, output routing.
- ``sampling`` — the sampling stages installed as the manager's logits processors (penalties
  and bias, grammar masks, temperature / top-p, the draw, log-probabilities).
- ``grammar`` — constrained decoding: llguidance grammars and their token masks;
  ``tool_grammar`` writes the grammar of each family's tool-call format.
- ``prefix`` — which prefix policy a model gets, and the radix-decided ledger and scheduler.
- ``kv`` — KV costing from the model geometry, and the lazily zeroed CPU pool.
- ``state`` — a hybrid model's recurrent-state pool: its costing, the state allocator beside
  the KV allocators, and the snapshot-aware radix ledger.
- ``hybrid`` — the hybrid paged cache and scheduler, and the start-up swap that lets the
  substrate build them for a model with linear-attention layers.
- ``recurrent`` — the linear-attention seam: Gated DeltaNet layers computing in the state pool.
- ``compiled_step`` — decode-size steps of the whole decoder as one ``torch.compile`` graph, with
  the paged-KV access as an opaque operator (the experts are one too: ``engine/experts/opaque.py``).

May import torch, transformers (its internals included: only this package and
``engine/experts/hf.py`` do) and ``moetray.policy``; never the HTTP layer or the tray.
The names the rest of the engine uses are re-exported here.
"""

from moetray.engine.cb.grammar import Grammar, GrammarCompiler, GrammarRefused, json_item
from moetray.engine.cb.kv import kv_bytes_per_page, kv_overhead_bytes
from moetray.engine.cb.prefix import (
    PREFIX_POLICIES,
    PrefixPolicyRefused,
    RadixLedger,
    RadixScheduler,
    choose_prefix_policy,
)
from moetray.engine.cb.runner import BatchRunner, KVStats, LiveRequest, RunnerConfig, StateStats
from moetray.engine.cb.sampling import (
    Sampling,
    TokenLogprob,
    needs_processors,
    sampling_kwargs,
    seeded_uniform,
)
from moetray.engine.cb.state import StateGeometry, UnsupportedLayers, refuse_unservable_layers

__all__ = [
    "PREFIX_POLICIES",
    "PrefixPolicyRefused",
    "choose_prefix_policy",
    "BatchRunner",
    "Grammar",
    "GrammarCompiler",
    "GrammarRefused",
    "KVStats",
    "LiveRequest",
    "RadixLedger",
    "RadixScheduler",
    "RunnerConfig",
    "Sampling",
    "TokenLogprob",
    "StateGeometry",
    "StateStats",
    "UnsupportedLayers",
    "kv_bytes_per_page",
    "json_item",
    "kv_overhead_bytes",
    "needs_processors",
    "refuse_unservable_layers",
    "sampling_kwargs",
    "seeded_uniform",
]
