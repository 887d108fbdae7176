"""The compiled decode kernel (engine/experts/fused.py) on real tiny MoEs: close to float32 where the
grouped path is, taken by decode steps only (a counter), rebound by a resize, refused for float32,
and replaced by the grouped GEMMs when compilation fails."""

from __future__ import annotations

import pytest
import torch

from moetray.engine.experts import load_offloaded_model
from moetray.engine.experts.fused import FUSED_MAX_TOKENS

FAMILIES = [("qwen3_moe", "per_expert"), ("gpt_oss", "fused")]  # stock SwiGLU; biased, transposed, clamped


def _runtime(path, *, dtype=torch.bfloat16, capacity=16, expert_format=None, compile_decode=True):
    off = load_offloaded_model(path, dtype=dtype, capacity=capacity, expert_format=expert_format,
                               compile_decode=compile_decode)
    off.runtime.warm_up()
    return off


def _call(runtime, layer: int, tokens: int, seed: int, dtype=torch.bfloat16):
    """One layer call's inputs: random states, distinct routed experts per token, softmaxed weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden = runtime.hidden_size
    states = torch.randn(tokens, hidden, generator=gen).to(dtype)
    index = torch.stack([torch.randperm(runtime.num_experts, generator=gen)[:runtime.top_k]
                         for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, runtime.top_k, generator=gen), -1).to(dtype)
    return runtime.modules[layer], layer, states, index, weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("family", "layout"), FAMILIES)
@pytest.mark.parametrize("expert_format", [None, "int8"])
def test_the_kernel_is_as_close_to_float32_as_the_grouped_path(tiny_moe, family, layout, expert_format):
    """A layer call of 1, 3 and 8 tokens through the kernel against the float32 model's experts:
    its error is of the grouped path's size (both read the same 16-bit or int8 weights). Prevents:
    a wrong slot, gate, bias, scale or transposition in the kernel (each is far off, not close)."""
    path = tiny_moe(family, layout)
    off = _runtime(path, expert_format=expert_format)
    rt = off.runtime
    assert rt.decode_kernel == "compiled", rt.decode_kernel_reason
    ref = load_offloaded_model(path, dtype=torch.float32, capacity=16).runtime
    with torch.no_grad():
        for tokens in (1, 3, FUSED_MAX_TOKENS):
            module, layer, states, index, weights = _call(rt, 1, tokens, seed=tokens)
            before = rt.fused.calls
            fused = rt.forward(module, layer, states, index, weights)
            assert rt.fused.calls == before + 1
            grouped = rt._forward_grouped(module, layer, states, index, weights)
            exact = ref.forward(ref.modules[1], layer, states.float(), index, weights.float())
            assert fused.dtype == states.dtype and fused.shape == states.shape
            assert _rel(fused, exact) <= 2 * _rel(grouped, exact) + 0.01, (tokens, _rel(fused, exact),
                                                                          _rel(grouped, exact))


def test_decode_steps_take_the_kernel_and_prefill_the_grouped_path(tiny_moe):
    """generate(): a 12-token prompt's prefill (more than FUSED_MAX_TOKENS) runs the grouped GEMMs,
    each of the 5 decode steps runs the kernel once per MoE layer. Prevents: the kernel never
    wired in, or wired into prefill chunks it would read many times over."""
    off = _runtime(tiny_moe("qwen3_moe", "per_expert"))
    rt = off.runtime
    ids = torch.tensor([list(range(3, 15))])
    with torch.no_grad():
        out = off.model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    assert out.shape[1] == 12 + 6
    assert rt.fused.calls == 5 * rt.num_layers
    assert sum(s.hits + s.misses for s in rt.cache.per_layer_stats()) > 0  # the plan still counts


def test_a_resize_rebinds_the_kernel_without_recompiling(tiny_moe):
    """After a re-split to fewer slots (misses now copy into slots), the kernel reads the new pool:
    its output still matches the grouped path's size of error, and no new graph was compiled (the
    capacity is symbolic). Prevents: the kernel reading the freed pool, or a re-split stalling the
    next step for a compilation."""
    from torch._dynamo.utils import counters

    path = tiny_moe("qwen3_moe", "per_expert")
    off = _runtime(path)
    rt = off.runtime
    ref = load_offloaded_model(path, dtype=torch.float32, capacity=16).runtime
    graphs = counters["stats"]["unique_graphs"]
    rt.resize(5)
    with torch.no_grad():
        for seed in range(3):
            module, layer, states, index, weights = _call(rt, seed % rt.num_layers, 2, seed=seed)
            fused = rt.forward(module, layer, states, index, weights)
            grouped = rt._forward_grouped(module, layer, states, index, weights)
            exact = ref.forward(ref.modules[layer], layer, states.float(), index, weights.float())
            assert _rel(fused, exact) <= 2 * _rel(grouped, exact) + 0.01
    assert counters["stats"]["unique_graphs"] == graphs
    rt.check_integrity(deep=True)


def test_float32_stays_on_the_exact_grouped_path(tiny_moe):
    """float32 is the token-identity reference: the kernel is refused, with the reason shown."""
    rt = _runtime(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.float32).runtime
    assert rt.fused is None and rt.decode_kernel == "grouped_mm"
    assert "float32" in rt.decode_kernel_reason


def test_a_failed_compilation_leaves_the_grouped_path(tiny_moe, tmp_path):
    """No C++ compiler (inductor pointed at a missing one, with an empty cache directory so nothing
    compiled earlier is reused): warm-up logs why, and decode runs the grouped GEMMs. Prevents: an
    engine that cannot start on a machine without a compiler."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    torch._dynamo.reset()
    try:
        with (temporary_cache_dir(str(tmp_path / "inductor")),
              inductor_config.patch({"cpp.cxx": ("/nonexistent/bin/c++",), "fx_graph_cache": False})):
            off = _runtime(tiny_moe("qwen2_moe", "per_expert"))
        rt = off.runtime
        assert rt.fused is None and rt.decode_kernel == "grouped_mm"
        assert rt.decode_kernel_reason.startswith("compilation failed")
        with torch.no_grad():
            out = off.model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False,
                                     eos_token_id=-1, pad_token_id=0)
        assert out.shape[1] == 6
    finally:
        torch._dynamo.reset()  # later tests compile afresh with the real compiler



@pytest.mark.parametrize(("family", "layout"), FAMILIES)
def test_traced_the_kernel_computes_in_the_callers_graph_after_the_opaque_plan(tiny_moe, family, layout):
    """As in a compiled decode step: a traced layer call plans through ``moetray::expert_slots``
    (misses copied in, the call counted) and the kernel's arithmetic is part of the caller's graph;
    its result is the eager kernel call's. Prevents: the graph reading a slot before the plan filled
    it, another layer's slots, or the plan never counted."""
    from moetray.engine.experts.runtime import moetray_experts_forward

    off = _runtime(tiny_moe(family, layout), capacity=8)
    rt = off.runtime
    ops = set()

    def recording(graph, example_inputs):  # what the caller's graph holds, then run it as traced
        ops.update(node.target for node in graph.graph.nodes if node.op == "call_function")
        return graph

    traced = torch.compile(moetray_experts_forward, backend=recording, fullgraph=True, dynamic=False)
    copied = rt.pool.bytes_copied
    with torch.no_grad():
        for seed, tokens in enumerate((1, 2, 1, 2)):
            module, layer, states, index, weights = _call(rt, seed % rt.num_layers, tokens, seed)
            before = rt.fused.calls
            got = traced(module, states, index, weights)
            assert rt.fused.calls == before + 1
            want = rt.forward(module, layer, states, index, weights)
            assert _rel(got, want) < 1e-2, (tokens, _rel(got, want))  # bf16 rounding; a wrong slot: ~1
    assert rt.pool.bytes_copied > copied  # the traced calls' plans copied their misses in
    assert torch.ops.moetray.expert_slots.default in ops and torch.ops.moetray.experts.default not in ops


def test_the_int8_kernel_loads_its_rows_at_float32_width(tiny_moe):
    """int8 rows: the kernel widens the activations into a buffer of their own
    (``fused.float_buffer``), so its compiled reductions load the rows 16 at a time (float32's
    lanes), not 32 (bfloat16's: measured ~3x slower). Prevents: the widening removed or fused back."""
    import re

    from torch._inductor.utils import run_and_get_code

    from moetray.engine.experts import fused

    rt = _runtime(tiny_moe("qwen3_moe", "per_expert"), capacity=8, expert_format="int8").runtime
    module, layer, states, index, weights = _call(rt, 0, 1, seed=3)
    slots = rt.fused_slots(layer, index)
    kernel = torch.compile(fused._experts, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got, code = run_and_get_code(rt.fused.traced, module, states, slots, weights, kernel=kernel)
        want = rt.fused.traced(module, states, slots, weights)  # the eager formula, same rounding budget
    lanes = {int(n) for n in re.findall(r"Vectorized<int8_t>::loadu\([^;]*?(\d+)\)\)", "\n".join(code))}
    assert lanes == {16}, lanes
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize(("expert_format", "op"), [("int8", "int8_experts_mm"), (None, "half_experts_mm")])
def test_experts_of_several_tokens_are_read_once_per_step_by_the_grouped_kernel(tiny_moe, expert_format, op):
    """int8 rows and bfloat16 rows, two or more tokens: the compiled kernel calls the grouped kernel
    (``moetray::int8_experts_mm``, ``moetray::half_experts_mm``), which computes every pair routed to
    one slot together (the expert's rows read once for all its tokens), with the per-pair reduction's
    values; one token keeps the reduction (it fuses with its neighbours). Prevents: the grouped
    kernel unwired from the decode steps of several requests."""
    from torch._inductor.utils import run_and_get_code

    from moetray.engine.experts import fused
    from moetray.engine.models import few_rows

    rt = _runtime(tiny_moe("qwen3_moe", "per_expert"), capacity=8, expert_format=expert_format).runtime
    if not few_rows.loaded():
        pytest.skip(f"the few-rows kernels do not serve here: {few_rows.refusal()}")
    for tokens, grouped in ((1, False), (4, True)):
        module, layer, states, index, weights = _call(rt, 0, tokens, seed=tokens)
        slots = rt.fused_slots(layer, index)
        kernel = torch.compile(fused._experts, fullgraph=True, dynamic=False)
        with torch.no_grad():
            got, code = run_and_get_code(rt.fused.traced, module, states, slots, weights, kernel=kernel)
            v = rt.fused.views
            x = states if v.first_scale is None else fused.float_buffer(states)
            h = fused._project(x, v.first, slots, v.first_scale, v.first_bias, False).to(states.dtype)
            h = module._apply_gate(h)
            out = fused._project(h, v.down, slots, v.down_scale, v.down_bias, False)
            want = (out * weights.unsqueeze(-1).float()).sum(1).to(states.dtype)
        assert (op in "\n".join(code)) is grouped, tokens
        assert _rel(got, want) < 1e-2, (tokens, _rel(got, want))


@pytest.mark.parametrize("per_pair", [False, True])
def test_the_grouped_kernel_computes_each_pair_from_its_slot_in_groups_of_up_to_eight(per_pair):
    """``moetray::int8_experts_mm`` against the dequantized formula, for the first projection's
    shared rows (``[T, K]``) and the down projection's rows per pair (``[T, k, K]``), on a strided pool
    (the slot rows' layout), with ten tokens on one slot (groups of eight, then two) and an input width
    with a tail past 32. Prevents: a pair computed from another's row, slot or scale."""
    from moetray.engine.models import few_rows

    if few_rows.build() is not None:
        pytest.skip(f"the few-rows kernels do not serve here: {few_rows.refusal()}")
    gen = torch.Generator().manual_seed(5)
    capacity, out_f, width, tokens, top = 6, 48, 72, 10, 3
    rows = torch.randint(-127, 128, (capacity, out_f * width + 256), generator=gen, dtype=torch.int8)
    qweight = rows[:, :out_f * width].view(capacity, out_f, width)
    qscale = torch.rand(capacity, out_f + 8, generator=gen).to(torch.bfloat16)[:, :out_f]
    slots = torch.stack([torch.randperm(capacity, generator=gen)[:top] for _ in range(tokens)])
    slots[:, 0] = 2  # every token on slot 2
    x = torch.randn((tokens, top, width) if per_pair else (tokens, width), generator=gen)
    got = torch.ops.moetray.int8_experts_mm(x.to(torch.bfloat16), qweight, qscale, slots)
    xs = x.to(torch.bfloat16).float()
    xs = xs if per_pair else xs[:, None, :].expand(tokens, top, width)
    want = (xs.unsqueeze(-2) * qweight[slots].float()).sum(-1) * qscale[slots].float()
    assert got.dtype == torch.float32 and got.shape == (tokens, top, out_f)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("per_pair", [False, True])
@pytest.mark.parametrize(("dtype", "width"),
                         [(torch.bfloat16, 96), (torch.bfloat16, 72), (torch.float16, 72)])
def test_the_half_grouped_kernel_computes_each_pair_from_its_slot(per_pair, dtype, width):
    """``moetray::half_experts_mm`` against the float32 formula on the same 16-bit values, for shared
    rows (``[T, K]``) and rows per pair (``[T, k, K]``), on a strided pool, ten tokens on one slot
    (groups of eight, then two): bfloat16 at a width of whole 32-value blocks (the bfloat16 pair
    products where the CPU has them) and with a tail (widened to float32), float16 widened. Prevents:
    a pair computed from another's row or slot, a block or the tail skipped, float16 read as
    bfloat16."""
    from moetray.engine.models import few_rows

    if few_rows.build() is not None:
        pytest.skip(f"the few-rows kernels do not serve here: {few_rows.refusal()}")
    gen = torch.Generator().manual_seed(6)
    capacity, out_f, tokens, top = 6, 40, 10, 3
    rows = torch.randn(capacity, out_f * width + 64, generator=gen).to(dtype)
    weight = rows[:, :out_f * width].view(capacity, out_f, width)
    slots = torch.stack([torch.randperm(capacity, generator=gen)[:top] for _ in range(tokens)])
    slots[:, 0] = 2  # every token on slot 2
    x = torch.randn((tokens, top, width) if per_pair else (tokens, width), generator=gen).to(dtype)
    got = torch.ops.moetray.half_experts_mm(x, weight, slots)
    xs = x.float() if per_pair else x.float()[:, None, :].expand(tokens, top, width)
    want = (xs.unsqueeze(-2) * weight[slots].float()).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (tokens, top, out_f)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.moetray.half_experts_mm(x.float(), weight, slots)
