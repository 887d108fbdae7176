"""A compiled step's slot table (engine/experts/resident.py) on a real tiny MoE through the real batcher:
calls whose experts are all resident take their slots from the table inside the graph, the planner
still sees every call in layer order, misses are still planned by the operator, and the table stays
the planner's residency map through copies, evictions and resizes."""

from __future__ import annotations

import pytest
import torch
from test_cb_runner import make_runner, prompt_ids, run_all

from moetray.engine.cb import Sampling
from moetray.engine.cb.compiled_step import install_decode_step
from moetray.engine.experts import load_offloaded_model
from moetray.engine.experts.fused import FUSED_MAX_TOKENS
from moetray.engine.experts.resident import read_served_calls
from moetray.engine.models import few_rows
from moetray.policy.moe.expert_cache import CacheIntegrityError

LAYERS, EXPERTS = 2, 8  # the tiny Qwen3-MoE's


@pytest.fixture(scope="module")
def served(tiny_moe):
    """The tiny Qwen3-MoE in bfloat16 with every expert's slot (16) and the compiled step; the
    runtime's ``planned_slots`` (the operator's planning) counts its calls."""
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.bfloat16,
                                capacity=LAYERS * EXPERTS, compile_decode=True)
    off.runtime.warm_up()
    assert off.runtime.fused is not None
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    runtime = off.runtime
    planned = runtime.planned_slots
    runtime.operator_calls = 0

    def counted(*args, **kwargs):
        runtime.operator_calls += 1
        return planned(*args, **kwargs)

    runtime.planned_slots = counted
    resident, python_served = runtime.resident, runtime.resident.served
    resident.python_calls = 0

    def served_in_python(*args, **kwargs):
        resident.python_calls += 1
        return python_served(*args, **kwargs)

    resident.served = served_in_python
    return off, step


async def _serve(model, tok, n: int = 2, tokens: int = 8) -> dict[str, list[int]]:
    runner = make_runner(model, policy="off")
    prompts = {f"p{i}": (prompt_ids(tok, f"Name {i + 2} rivers"), tokens, Sampling(temperature=0.0))
               for i in range(n)}
    try:
        finals = await run_all(runner, prompts)
    finally:
        runner.stop()
    return {rid: out.generated_tokens for rid, out in finals.items()}


async def test_resident_calls_skip_the_operator_and_the_planner_sees_every_call_in_order(tiny, served):
    """With every expert resident (after a first request loads them), the decode steps' layer calls
    take their slots from the table: the operator plans none of them, yet the planner's trace has
    every call, layer 0 then 1 in each step, and the kernel counts them all. Prevents: the table
    unwired (the operator plans every call), the settling unwired (the planner misses the calls, so
    recency, counts and the policy's order go stale), calls settled out of layer order, settled
    hits planned and validated as slot plans (``ExpertCache.record_hits`` is their verb), or, where
    ``served_calls.cpp`` is built, the calls served by the Python operator (its C++ kernel unwired)."""
    off, step = served
    runtime = off.runtime
    routes = torch.arange(EXPERTS).view(-1, runtime.top_k)  # every expert, a few tokens
    for layer in range(LAYERS):  # load them all, so no call can miss
        runtime.forward(runtime.modules[layer], layer,
                        torch.zeros(len(routes), runtime.hidden_size, dtype=torch.bfloat16), routes,
                        torch.ones(routes.shape, dtype=torch.bfloat16))
    assert runtime.cache.resident_count == LAYERS * EXPERTS
    calls, kernel, operator = runtime.cache.stats().calls, runtime.fused.calls, runtime.operator_calls
    in_python = runtime.resident.python_calls
    plans = runtime.slots.stats().plans
    steps = step.compiled_steps
    runtime.start_trace()
    await _serve(off.model, tiny[1])
    trace = runtime.stop_trace()
    served_steps = step.compiled_steps - steps
    assert served_steps >= 7 + 2  # decode steps, and the warm-up's
    assert runtime.operator_calls == operator  # every call hit: the table served them all
    assert (runtime.resident.python_calls == in_python) == few_rows.loaded()
    assert [layer for layer, _ in trace] == [0, 1] * (len(trace) // 2)
    assert runtime.cache.stats().calls - calls == len(trace) >= LAYERS * served_steps
    assert runtime.fused.calls - kernel >= LAYERS * served_steps
    # Only the eager calls (the prefill's) build slot plans; the settled ones are counted hits.
    assert runtime.slots.stats().plans - plans <= len(trace) - LAYERS * served_steps
    runtime.check_integrity(deep=True)


async def test_misses_are_planned_by_the_operator_with_the_tokens_the_table_gives(tiny, served):
    """Shrunk to 5 slots, calls miss: the operator plans them (and settles the calls before them),
    every call is still seen once, the table follows each copy and eviction, and greedy tokens equal
    those served with every expert resident. Prevents: a stale table entry read as a slot (another
    expert's weights), or a miss served without its copy."""
    off, step = served
    runtime = off.runtime
    runtime.resize(LAYERS * EXPERTS)
    full = await _serve(off.model, tiny[1])
    runtime.resize(5)
    operator = runtime.operator_calls
    runtime.start_trace()
    assert await _serve(off.model, tiny[1]) == full
    trace = runtime.stop_trace()
    assert runtime.operator_calls > operator
    assert [layer for layer, _ in trace] == [0, 1] * (len(trace) // 2)
    runtime.check_integrity(deep=True)
    runtime.resize(LAYERS * EXPERTS)  # growing keeps every entry
    runtime.check_integrity(deep=True)


def test_a_table_that_disagrees_with_the_planner_is_an_integrity_error(served):
    """An entry the planner does not hold fails the integrity check, and a call the table
    served from it fails when settled. Prevents: a lying table going unnoticed."""
    off, _ = served
    runtime = off.runtime
    runtime.resize(1)  # at most one expert resident
    resident = runtime.resident
    missing = next(e for e in range(EXPERTS) if runtime.cache.slot_of(1, e) is None)
    resident.admit(1, missing, 0)
    try:
        with pytest.raises(CacheIntegrityError, match="slot table"):
            runtime.check_integrity()
        resident.served(1, torch.full((1, runtime.top_k), missing), torch.zeros(1, runtime.top_k))
        with pytest.raises(CacheIntegrityError, match="slot table served"):
            runtime.settle_step()
        assert not resident.pending
    finally:
        resident.rebuild(runtime.cache.residency_map())
        resident.forget_step(runtime.op_key)
    runtime.check_integrity()


def test_the_cpu_operator_keeps_each_served_call_for_the_planner_in_order():
    """Where ``served_calls.cpp`` is built, ``moetray::expert_slots`` answers a call whose experts
    all have slots in C++ (a copy of the looked-up slots) and logs it per runtime key; the log is
    read back in order, each call's distinct experts ascending with its tokens, and taken once.
    Prevents: a served call lost or counted twice, or the log's format drifting from its reader."""
    if few_rows.build() is not None:
        pytest.skip(f"the C++ kernels are not built here: {few_rows.refusal()}")
    key = 10**9  # no runtime: a served call never reaches Python
    routed, looked = torch.tensor([[3, 1], [1, 5]]), torch.tensor([[7, 2], [2, 9]])
    out = torch.ops.moetray.expert_slots(routed, looked, torch.tensor(True), key, 4)
    assert torch.equal(out, looked) and out.data_ptr() != looked.data_ptr()
    torch.ops.moetray.expert_slots(routed[:1], looked[:1], torch.tensor(True), key, 5)
    assert read_served_calls(torch.ops.moetray.take_served_calls(key).tolist()) == [(4, [1, 3, 5], 2),
                                                                                 (5, [1, 3], 1)]
    assert torch.ops.moetray.take_served_calls(key).numel() == 0
