"""How many intra-op threads one batch step runs on: a small step on one, a large one on all.

Numbers in, decision out. The engine waits for OpenMP work passively (spinning workers starve the
batch loop on a shared machine), so every parallel region of a step wakes the other threads, at
~60-80 µs a product on this 2-core machine. A product earns that back only from ~40-60 M
multiply-adds (:data:`ONE_THREAD_MAX_MACS`); below, one thread is faster. Measured on the demo in
bfloat16, 2 cores, served: at batch 1 one thread decoded 1.5-1.7x the tokens per second of two
(1.4x at batch 4) at 0.6x the CPU time per token, and a chat prompt's prefill (~45 tokens)
answered its first token in ~100 ms on one thread against ~165-185 ms on two. A long prompt's
GEMMs are large enough to pay for the wake-ups and keep the whole budget.

Only lossy formats take the rule (the engine asks for it when the compiled decode kernel serves):
float32 keeps its thread count, so its GEMMs split as they always have (the token-identity reference).
"""

from __future__ import annotations

DECODE_STEP_TOKENS = 8
"""Query tokens up to which a step counts as a decode step (one token per request, up to 8
requests), the batch the compiled decode kernel serves; such a step always takes the rule."""

ONE_THREAD_MAX_MACS = 32_000_000
"""Multiply-adds up to which one product runs faster on one thread than on a team of two under
passive waiting. Measured on this machine, bfloat16, one thread against two: 34 rows × 576 → 128
(2.5 M, a prefill's expert group) 25 µs against 93; 128 × 576 → 1024 (75 M) 343 against 298;
1024 × 576 → 1024 (604 M) 2.6 ms against 1.4."""


def one_thread_tokens(hidden_size: int) -> int:
    """The largest step, in query tokens, that runs on one thread for a model of ``hidden_size``:
    every decode step, and more while the step's square projection (tokens × hidden²
    multiply-adds, its attention's query and output products) stays within
    :data:`ONE_THREAD_MAX_MACS` (the demo's 576: 96 tokens; 2048: decode steps only)."""
    if hidden_size < 1:
        raise ValueError(f"a hidden size is at least 1, got {hidden_size}")
    return max(DECODE_STEP_TOKENS, ONE_THREAD_MAX_MACS // hidden_size**2)


def step_threads(query_tokens: int, budget: int, *, one_thread_up_to: int) -> int:
    """Intra-op threads for a step of ``query_tokens`` tokens, of a ``budget`` of threads: one up
    to ``one_thread_up_to`` tokens (:func:`one_thread_tokens`; 0 where the rule does not apply)."""
    if budget < 1:
        raise ValueError(f"a thread budget is at least 1, got {budget}")
    return 1 if query_tokens <= one_thread_up_to else budget
