"""How many intra-op threads one batch step runs on: a decode step on one, a prefill chunk on all.

Numbers in, decision out. The engine waits for OpenMP work passively (spinning workers starve the
batch loop on a shared machine), so every parallel region of a step wakes the other threads: on a
decode step of a few tokens, whose ops are small matrix-vector products, the wake-ups cost more
than the second core gives. Measured on the demo in bfloat16 with the compiled decode kernel, 2
cores under load, served: one thread decoded 1.5-1.7x the tokens per second of two at batch 1 and
1.4x at batch 4, at 0.6x the CPU time per token. A prefill chunk's GEMMs are large enough to pay
for the wake-ups and keep the whole budget (the time to first token).

Only lossy formats take the rule (the engine asks for it when the compiled decode kernel serves):
float32 keeps its thread count, so its GEMMs split as they always have (the token-identity reference).
"""

from __future__ import annotations

DECODE_STEP_TOKENS = 8
"""Query tokens up to which a step counts as a decode step (one token per request, up to 8
requests), the batch the compiled decode kernel serves."""


def step_threads(query_tokens: int, budget: int, *, single_thread_decode: bool) -> int:
    """Intra-op threads for a step of ``query_tokens`` tokens, of a ``budget`` of threads."""
    if budget < 1:
        raise ValueError(f"a thread budget is at least 1, got {budget}")
    if single_thread_decode and query_tokens <= DECODE_STEP_TOKENS:
        return 1
    return budget
