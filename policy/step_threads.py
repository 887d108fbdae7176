"""How many intra-op threads one batch step runs on: a small step on one, a large one on all, and
every step on all while the cores are the engine's alone.

Numbers in, decision out. An OpenMP team's parallel region wakes its workers; under a passive wait
that is a futex wake of a sleeping core, ~60-80 µs a product on this 2-core machine, so a product
earns a team back only from ~40-60 M multiply-adds (:data:`ONE_THREAD_MAX_MACS`); below, one
thread is faster. Measured on the demo in bfloat16, 2 cores, served, passive waits: at batch 1 one
thread decoded 1.5-1.7x the tokens per second of two (1.4x at batch 4) at 0.6x the CPU time per
token, and a chat prompt's prefill (~45 tokens) answered its first token in ~100 ms on one thread
against ~165-185 ms on two. A long prompt's GEMMs are large enough to pay for the wake-ups and
keep the whole budget.

Workers that spin briefly after a region (:data:`TEAM_SPIN_COUNT`) catch the next one awake, and
a decode step's team then pays: measured on the demo in bfloat16, interleaved servers on a quiet
machine, batch 1 +20 % tok/s (60.2 -> 72.6), batch 4 +19 % (103.7 -> 123.8 aggregate). Spinning
cores are the other programs' loss, and theirs is the team's: with one busy program beside it a
decode team running a ~1 ms spin fell to 7.1 tok/s against one thread's 54.6. So decode steps take
the team only while the other programs leave the budget's cores free
(:func:`team_serves_decode`), re-decided on measured load; so do short prefills, whose expert
groups go to one-thread helpers meanwhile (``engine/experts/grouped.py``): a 42-token chat
prompt's prefill on the demo, 2 cores, spinning team against one thread (helpers either way),
int8 79-84 ms against 93-96, bfloat16 67-71 against 70-76. (Before the helpers took the prefill's
expert groups, one thread answered first: 114 ms against a team's 120-134.)

Measured with the decode steps' rule, interleaved against the one-thread build: quiet, bfloat16
batch 1 +9-16 %, batch 4 +7-11 %, int8 batch 4 +13 % (int8 batch 1 gained nothing: 75.5 tok/s either
way in one run, 69.9 against 75.5 in another); beside one busy program every decode step stayed on
one thread and the engine decoded as the one-thread build did (53 against 52 tok/s at batch 1, 84
against 84 aggregate at batch 4).

Only lossy formats take these rules (the engine asks for them when the compiled decode kernel
serves): float32 keeps its thread count, so its GEMMs split as they always have (the
token-identity reference).
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


def step_threads(query_tokens: int, budget: int, *, one_thread_up_to: int, on_team: bool = False) -> int:
    """Intra-op threads for a step of ``query_tokens`` tokens, of a ``budget`` of threads: the
    budget while steps are ``on_team`` (:func:`team_serves_decode`), else one up to
    ``one_thread_up_to`` tokens (:func:`one_thread_tokens`; 0 where the rule does not apply)."""
    if budget < 1:
        raise ValueError(f"a thread budget is at least 1, got {budget}")
    if on_team:
        return budget
    return 1 if query_tokens <= one_thread_up_to else budget


TEAM_SPIN_COUNT = 3000
"""Spins (libgomp's ``GOMP_SPINCOUNT``) an OpenMP worker waits awake after a parallel region before
it sleeps: ~150 µs on this machine, a decode step's gaps between regions, not the gaps between
steps. Measured on the demo in bfloat16, quiet machine, decode team against one thread at batch 1:
1,000 spins +10 %, 3,000 +20 %, 20,000 +19 %; a 2-thread product beside one busy program: 2,000
spins ~1.3x the passive team's time, 5,000 ~2x, 20,000 ~2.3x (so few spins: the regions the rule
leaves on the team whatever the load, float32 steps and long prefills, pay for them under load).
On the second host (2 vCPUs) 3,000 spins cover a 20 µs gap but not 50 µs, so the worker sleeps in
each layer's gap of a compiled int8 step (~33 sleeps a token); longer spins still lose there, the
streaming client and the event loop sharing the two cores: 8,000 spins +5 %, 30,000 +8 % ms a
token at batch 1 (interleaved servers on the Q8_0 demo, six rounds each)."""

TEAM_LEAVE_OTHERS_CORES = 0.3
"""Cores other programs keep busy (beyond those the budget leaves them) at which decode steps leave
the team for one thread: a streaming client and a desktop's idle chatter use ~0.05-0.15 of a core,
one busy program a whole one, and a team sharing a core with it loses several times over."""

TEAM_RETURN_OTHERS_CORES = 0.15
"""... and at or below which they return to it: the gap keeps a load near the limit from switching
the threads back and forth every measurement."""

TEAM_LEAVE_WINDOW_S = 0.5
"""Seconds of others' load that must have been busy for decode steps to leave the team: the kernel
counts CPU time in 10 ms ticks, so half a second resolves 0.02 of a core a counter."""

TEAM_RETURN_WINDOW_S = 0.2
"""Seconds of others' load that stand for "now" (0.05 of a core a counter, inside the limits'
gap): steps on one thread return to the team once these are free, and steps on the team leave it
only while these are busy too. Read over half a second alone, a burst of other work that had
ended held the steps on one thread for most of a short reply: ``bench peer`` turns the cores over
from llama.cpp to moetray every round, and moetray's 48-token replies (~0.6 s) decoded at 77 tok/s
against 94-96 with no turn before them (the Q8_0 demo, 2 cores). Read over the short window to
return and the long one alone to leave, the steps switched at every step after such a turn."""


def others_load(latest: float | None, lasting: float | None, *, on_team: bool) -> float | None:
    """The load of other programs a decode step's choice (:func:`team_serves_decode`) weighs:
    ``latest`` is the busy cores over :data:`TEAM_RETURN_WINDOW_S`, ``lasting`` over
    :data:`TEAM_LEAVE_WINDOW_S` (None: not measured yet). Off the team, the latest (free now: go
    back); on it, the lesser (leave for a load that has lasted and still holds, not for an ended
    burst nor a noisy moment)."""
    if on_team and latest is not None and lasting is not None:
        return min(latest, lasting)
    return latest


def openmp_defaults(wait_policy: str | None) -> dict[str, str]:
    """The OpenMP settings the engine starts with where the user set no ``OMP_WAIT_POLICY`` of
    their own: workers spin :data:`TEAM_SPIN_COUNT` times after a region, then sleep (spinning on
    and on starves the batch loop and other programs). libgomp takes an explicit
    ``GOMP_SPINCOUNT`` over the policy's own count, so ``ACTIVE`` only sets the spin used while the
    process has more OpenMP threads than cores (a second thread's team, e.g. the loader's): 1,000
    spins, where ``PASSIVE`` gives none and a decode team measured half its speed (31-37 tok/s
    against 52-60). A user's own policy is kept whole."""
    if wait_policy is not None:
        return {}
    return {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(TEAM_SPIN_COUNT)}


def openmp_workers_spin(wait_policy: str | None, spin_count: str | None) -> bool:
    """Whether libgomp's workers stay awake a while between parallel regions, by its rules:
    ``GOMP_SPINCOUNT`` over ``OMP_WAIT_POLICY`` (neither: ~300,000 spins; ``PASSIVE`` alone: none)."""
    if spin_count is not None and spin_count.strip():
        return spin_count.strip().lstrip("0") != ""
    return (wait_policy or "").strip().upper() != "PASSIVE"


def team_serves_decode(others_cores: float | None, *, cores: int, budget: int, spinning: bool,
                       on_team: bool) -> bool:
    """Whether decode steps run on the whole ``budget`` (a team) rather than one thread.

    Only where OpenMP workers spin between regions (``spinning``: a passive team loses to one
    thread, see above), the budget has two threads or more, and the load of other programs is
    known (``others_cores``, :func:`others_load`; None before it is measured: one thread, the choice
    that cannot collapse). The team keeps serving up to
    :data:`TEAM_LEAVE_OTHERS_CORES` beyond the ``cores - budget`` the engine leaves free, and decode
    steps on one thread (``on_team`` False) return to it at :data:`TEAM_RETURN_OTHERS_CORES`."""
    if not spinning or budget < 2 or others_cores is None:
        return False
    spare = max(0, cores - budget)
    limit = TEAM_LEAVE_OTHERS_CORES if on_team else TEAM_RETURN_OTHERS_CORES
    return others_cores <= spare + limit
