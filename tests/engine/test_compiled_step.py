"""The compiled decode step (engine/cb/compiled_step.py) on a real tiny MoE through the real batcher:
decode steps take the graph (counters), prefill stays eager, tokens equal transformers', the graphs
are built at start-up and survive a KV re-split, and a failing graph falls back to eager steps.

The step is installed on a float32 model here (the engine compiles it only for lossy formats): the
graph's fused arithmetic then matches eager code to float32 rounding, so greedy tokens must be
identical, which checks the opaque experts and paged-KV operators exactly."""

from __future__ import annotations

import pytest
import torch
from test_cb_runner import greedy_reference, make_runner, prompt_ids, run_all
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM
from transformers.generation.continuous_batching.cache_allocators.full_attention import (
    FullAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
    SlidingAttentionCacheAllocator,
)

from moetray.engine.cb import Sampling
from moetray.engine.cb.compiled_step import (
    WARM_UP_STEPS,
    decode_step_of,
    decode_step_refusal,
    install_decode_step,
    keeps_step_guard,
)
from moetray.engine.experts import load_offloaded_model
from moetray.engine.experts.fused import FUSED_MAX_TOKENS


@pytest.fixture(scope="module")
def compiled(tiny_moe):
    """The tiny Qwen3-MoE (2 layers of 8 experts) on moetray's experts runtime with 8 slots (misses
    are copied in inside the opaque operator) and the compiled decode step installed."""
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.float32, capacity=8)
    install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    return off.model


async def test_decode_steps_take_the_graph_and_keep_transformers_tokens(tiny, compiled):
    """Four interleaved greedy requests: every token equals `generate` on the stock model, the
    decode steps ran as the graph and the prefill eagerly. Prevents: a wrong KV write or read-back
    in the paged operator, the experts operator reading another layer or a stale slot, or the
    step never wired in (the counter stays at the warm-up's)."""
    _, tok = tiny
    step = decode_step_of(compiled)
    prompts = [prompt_ids(tok, f"Hello number {i}, tell me about experts") for i in range(4)]
    refs = [greedy_reference(tiny[0], p, 10) for p in prompts]
    runner = make_runner(compiled, policy="stock")
    try:
        assert step.reason is None
        before_graph, before_eager = step.compiled_steps, step.eager_steps
        finals = await run_all(runner, {f"r{i}": (p, 10, Sampling(temperature=0.0))
                                        for i, p in enumerate(prompts)})
    finally:
        runner.stop()
    for i, ref in enumerate(refs):
        assert finals[f"r{i}"].generated_tokens == ref
    assert step.compiled_steps - before_graph >= 9  # the 9 steps after the prefill's first token
    assert step.eager_steps - before_eager >= 1  # the prompts' prefill


def count_updates(monkeypatch, *allocators: type) -> dict[type, int]:
    """Count each allocator class's ``update`` calls (the substrate's KV write and read-back)."""
    calls = dict.fromkeys(allocators, 0)
    for cls in allocators:
        def counted(self, *args, _cls=cls, _update=cls.update, **kwargs):
            calls[_cls] += 1
            return _update(self, *args, **kwargs)

        monkeypatch.setattr(cls, "update", counted)
    return calls


async def test_full_attention_kv_is_written_and_read_inside_the_graph(tiny, compiled, monkeypatch):
    """A full-attention layer's KV write and read-back are traced into the step's graph (the
    allocator's flat view), so the substrate's allocator is called only by eager steps, once per
    layer, and never from inside a compiled one. Prevents: the flat view unwired, every layer of
    every step calling back into Python through ``moetray::paged_kv``."""
    _, tok = tiny
    step = decode_step_of(compiled)
    calls = count_updates(monkeypatch, FullAttentionCacheAllocator)
    prompt = prompt_ids(tok, "Write keys, then read them back")
    runner = make_runner(compiled, policy="stock")
    try:
        before_graph, before_eager = step.compiled_steps, step.eager_steps
        calls[FullAttentionCacheAllocator] = 0
        finals = await run_all(runner, {"kv": (prompt, 8, Sampling(temperature=0.0))})
    finally:
        runner.stop()
    assert finals["kv"].generated_tokens == greedy_reference(tiny[0], prompt, 8)
    layers = compiled.config.num_hidden_layers
    assert step.compiled_steps - before_graph >= 7
    assert calls[FullAttentionCacheAllocator] == (step.eager_steps - before_eager) * layers


async def test_sliding_window_layers_keep_the_operator_beside_traced_full_attention(tiny, tiny_moe,
                                                                                     monkeypatch):
    """gpt-oss alternates sliding-window and full-attention layers: a sliding window's allocator
    (which reads before it writes) is called through ``moetray::paged_kv`` by every step, compiled
    or not, the full-attention allocator only by eager steps (its layers are traced on the flat
    view), and greedy tokens equal transformers'. Prevents: a sliding layer traced as full
    attention (it would read rows outside its window), or the flat view taken for every layer."""
    path = tiny_moe("gpt_oss", "per_expert")
    off = load_offloaded_model(path, dtype=torch.float32, capacity=16)
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    calls = count_updates(monkeypatch, FullAttentionCacheAllocator, SlidingAttentionCacheAllocator)
    prompt = prompt_ids(tiny[1], "Slide a window over this prompt, then keep going")
    runner = make_runner(off.model, policy="off")
    try:
        assert step.reason is None
        for cls in calls:
            calls[cls] = 0
        before_graph, before_eager = step.compiled_steps, step.eager_steps
        finals = await run_all(runner, {"s": (prompt, 8, Sampling(temperature=0.0))})
    finally:
        runner.stop()
    assert finals["s"].generated_tokens == greedy_reference(stock, prompt, 8)
    kinds = off.model.config.layer_types
    sliding, full = kinds.count("sliding_attention"), kinds.count("full_attention")
    graph, eager = step.compiled_steps - before_graph, step.eager_steps - before_eager
    assert sliding and full and graph >= 7
    assert calls[SlidingAttentionCacheAllocator] == (graph + eager) * sliding
    assert calls[FullAttentionCacheAllocator] == eager * full


def test_the_graphs_are_built_at_start_and_outlive_a_kv_resplit(compiled):
    """Starting a runner runs the warm-up steps through the graph; a second runner (a KV re-split:
    a new paged cache of another size) compiles nothing new. Prevents: the first request waiting
    for a compilation, or each re-split stalling for one."""
    step = decode_step_of(compiled)
    before = step.compiled_steps
    make_runner(compiled, kv_pages=64).stop()
    assert step.reason is None and step.compiled_steps == before + len(WARM_UP_STEPS)
    graphs = counters["stats"]["unique_graphs"]
    make_runner(compiled, kv_pages=40).stop()
    assert counters["stats"]["unique_graphs"] == graphs
    assert step.compiled_steps == before + 2 * len(WARM_UP_STEPS)


def test_the_warm_up_compiles_one_graph_per_step_kind(tiny_moe):
    """A new step's warm-up on one thread compiles two graphs, one token and any token count, both
    at any KV length; the warm-up's later KV length takes the first. Prevents: a graph for the first
    warm-up step's KV length alone, compiled at every start and never serving (~8 s on the demo)."""
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.float32, capacity=8)
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    graphs = counters["stats"]["unique_graphs"]
    make_runner(off.model, kv_pages=64, thread_budget=1).stop()
    assert step.reason is None and step.compiled_steps == len(WARM_UP_STEPS)
    assert counters["stats"]["unique_graphs"] - graphs == 2


def test_a_sliding_window_models_warm_up_compiles_one_graph_per_step_kind(tiny_moe):
    """The same for gpt-oss, whose steps carry one mask per attention kind (a dict): each mask's KV
    axis is marked symbolic, not only a lone mask's. Prevents: the extra graph at every start of a
    model with sliding windows."""
    off = load_offloaded_model(tiny_moe("gpt_oss", "per_expert"), dtype=torch.float32, capacity=16)
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    graphs = counters["stats"]["unique_graphs"]
    make_runner(off.model, kv_pages=64, thread_budget=1, policy="off").stop()
    assert step.reason is None and step.compiled_steps == len(WARM_UP_STEPS)
    assert counters["stats"]["unique_graphs"] - graphs == 2


async def test_a_failing_graph_leaves_eager_steps_with_the_same_tokens(tiny, tiny_moe, monkeypatch):
    """A graph that raises (a compilation failing mid-serving) is refused with its reason and the
    step reruns eagerly: the request still gets transformers' tokens. Prevents: one failed
    compilation failing every request."""
    _, tok = tiny
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.float32, capacity=16)
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not compile this\nsecond line")

    monkeypatch.setattr(step, "graph", broken)
    prompt = prompt_ids(tok, "Fall back, please")
    runner = make_runner(off.model, policy="off")
    try:
        assert step.reason == "compilation failed (RuntimeError: inductor could not compile this)"
        finals = await run_all(runner, {"f": (prompt, 6, Sampling(temperature=0.0))})
    finally:
        runner.stop()
    assert finals["f"].generated_tokens == greedy_reference(tiny[0], prompt, 6)
    assert step.compiled_steps == 0 and step.eager_steps >= 6


def test_compiled_only_where_the_experts_kernel_serves_on_a_traceable_model():
    """One rule each: --no-compile, a format the kernel does not serve (float32, a GPU), a hybrid."""
    assert decode_step_refusal(wanted=True, kernel_serves=True, hybrid=False) is None
    assert decode_step_refusal(wanted=False, kernel_serves=True, hybrid=False) == "off (--no-compile)"
    assert "kernel" in decode_step_refusal(wanted=True, kernel_serves=False, hybrid=False)
    assert "hybrid" in decode_step_refusal(wanted=True, kernel_serves=True, hybrid=True)


def test_a_step_checks_moetrays_module_constants_and_the_inputs_guards():
    """One rule each: a guard on the decoder's modules is kept only for a constant of an attribute
    moetray binds (an experts runtime, its layer), not for a config number or a parameter; guards on
    inputs and global state are kept, except the kinds serving never changes (aliasing between
    inputs, attributes shadowed on an instance)."""
    runtime = "forward.__self__._modules['layers']._modules['3']._modules['mlp']._modules['experts']"
    attention = "forward.__self__._modules['layers']._modules['3']._modules['self_attn']"
    assert keeps_step_guard("ID_MATCH", name=f"{runtime}._moetray_runtime", from_module=True)
    assert keeps_step_guard("CONSTANT_MATCH", name=f"{runtime}._moetray_layer", from_module=True)
    assert keeps_step_guard("EQUALS_MATCH", name=f"{runtime}._moetray_layer", from_module=True)
    assert not keeps_step_guard("CONSTANT_MATCH", name=f"{attention}.head_dim", from_module=True)
    assert not keeps_step_guard("TENSOR_MATCH", name=f"{runtime}._moetray_runtime.views", from_module=True)
    assert not keeps_step_guard("EMPTY_NN_MODULE_HOOKS_DICT", name=attention, from_module=True)
    assert keeps_step_guard("TENSOR_MATCH", name="kwargs['input_ids']", from_module=False)
    assert keeps_step_guard("TYPE_MATCH", name="kwargs['cache'].update", from_module=False)
    assert keeps_step_guard("CONSTANT_MATCH", name="G['few_rows'].MAX_ROWS", from_module=False)
    assert not keeps_step_guard("DUPLICATE_INPUT", name="kwargs['cache'].layer_to_allocator[1]",
                                from_module=False)
    assert not keeps_step_guard("NOT_PRESENT_IN_GENERIC_DICT", name="kwargs['cache'].moetray_flat_kv[0]",
                                from_module=False)


async def test_a_bfloat16_step_filters_its_guards_and_reads_a_resized_pool(tiny, tiny_moe):
    """bfloat16, where the experts' kernel is traced into the step's graph and the pool's views are
    its inputs: the step's graphs dropped two thirds of their guards (the modules' structure and
    constants), and after a re-split of the expert pool to fewer slots the same graphs serve
    (nothing compiled) and give the tokens they gave before it. Prevents: the guard filter unwired
    (every module guard checked before each step), or the filtered graph reading the freed pool or a
    stale capacity."""
    _, tok = tiny
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.bfloat16, capacity=16,
                                compile_decode=True)
    off.runtime.warm_up()
    assert off.runtime.fused is not None
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    prompts = {f"p{i}": (prompt_ids(tok, f"Count to {i + 3}, slowly"), 8, Sampling(temperature=0.0))
               for i in range(2)}

    async def serve() -> dict[str, list[int]]:
        runner = make_runner(off.model, policy="off")
        try:
            finals = await run_all(runner, prompts)
        finally:
            runner.stop()
        return {rid: out.generated_tokens for rid, out in finals.items()}

    before = await serve()
    assert step.reason is None and step.guards_dropped > 2 * step.guards_kept > 0
    graphs, steps = counters["stats"]["unique_graphs"], step.compiled_steps
    kernel_calls = off.runtime.fused.calls
    off.runtime.resize(5)
    assert await serve() == before
    assert counters["stats"]["unique_graphs"] == graphs
    assert step.compiled_steps - steps >= 7 + len(WARM_UP_STEPS)
    assert off.runtime.fused.calls > kernel_calls
    off.runtime.check_integrity(deep=True)
