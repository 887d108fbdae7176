"""The grouped compute path's own rules: general expert layouts, the thread share-out, its cost.

The runtime's default compute mode reproduces transformers' ``grouped_mm`` experts
implementation over the slot pool (see ``moetray.engine.experts.runtime``). The identity
matrix over families, layouts and capacities lives in test_expert_identity; here are the
rules that matrix cannot reach: biased, transposed experts with a custom gate (gpt-oss), a
batched step shared out over two threads, the number of GEMMs per call, autograd, refusal.
"""

from __future__ import annotations

import threading

import pytest
import torch
from expert_helpers import (  # noqa: F401 (autouse fixtures)
    assert_identical,
    isolated_profile_dir,
    one_torch_thread,
    resident,
)

from moetray.engine.experts import grouped as grouped_module
from moetray.engine.experts import load_offloaded_model
from moetray.engine.experts.hf import DEFAULT_APPLY_GATE
from moetray.engine.experts.loader import expert_modules
from moetray.engine.experts.runtime import COMPUTE_MODES, UnknownComputeMode


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny random gpt-oss checkpoint: experts with biases, transposed weights and gpt-oss's
    own clamped gate, stored as fused stacks; biases drawn non-zero so that dropping one shows."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=4, max_position_embeddings=512, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_bias"):
                param.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp("tiny-gpt-oss") / "ckpt"
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("capacity", [1, 16])
@pytest.mark.parametrize("compute", COMPUTE_MODES)
def test_biased_transposed_experts_with_a_custom_gate_match_their_stock_twin(gpt_oss, compute, capacity):
    """gpt-oss experts (gate_up and down biases, ``[in, out]`` weights, a clamped gate of its
    own) decode bit-identically to the stock implementation of the same name, at the floor
    (misses computed from the host store) and with every expert resident.
    Prevents: a dropped or misplaced bias, a transposed operand multiplied the wrong way, the
    default SwiGLU gate applied where the module defines its own."""
    module = expert_modules(resident(gpt_oss, compute))[0][1]
    assert module.has_bias and module.is_transposed
    assert type(module)._apply_gate is not DEFAULT_APPLY_GATE
    om = load_offloaded_model(gpt_oss, capacity=capacity, compute=compute)
    assert_identical(gpt_oss, om.model, compute)
    om.runtime.check_integrity(deep=True)


def _batched_call(checkpoint, tokens: int, *, seed: int = 0):
    """One layer-0 call of ``tokens`` tokens with distinct random routings, on the offloaded
    model (every expert resident) and on the stock grouped_mm model."""
    om = load_offloaded_model(checkpoint, capacity=16)
    top_k = om.runtime.top_k
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(om.runtime.num_experts, generator=generator)[:top_k]
                         for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    states = torch.randn(tokens, om.model.config.hidden_size, generator=generator)
    mine = expert_modules(om.model)[0][1]
    stock = expert_modules(resident(checkpoint, "grouped_mm"))[0][1]
    with torch.no_grad():
        want = stock(states, index, weights)
    return om, mine, (states, index, weights), want


def test_a_batched_step_shares_its_small_groups_over_the_threads(tiny_moe, monkeypatch):
    """With two torch threads, a decode step of several requests (each routed expert one or
    two rows: bandwidth-bound GEMMs the BLAS runs on one thread) has part of its groups run
    on the runtime's helper threads, each at one intra-op thread, and the output stays
    bit-identical to stock grouped_mm. Prevents: the share-out silently never happening, two
    threads writing overlapping rows, or helpers' GEMMs contending with OpenMP teams."""
    om, mine, args, _ = _batched_call(tiny_moe("qwen3_moe", "per_expert"), tokens=8)
    stock = expert_modules(resident(tiny_moe("qwen3_moe", "per_expert"), "grouped_mm"))[0][1]
    threads: list[str] = []
    real = grouped_module._gemm_many

    budgets: list[int] = []

    def spy(out, src, items):
        threads.append(threading.current_thread().name)
        budgets.append(torch.get_num_threads())
        return real(out, src, items)

    monkeypatch.setattr(grouped_module, "_gemm_many", spy)
    torch.set_num_threads(2)  # the autouse fixture restores the count
    with torch.no_grad():
        want = stock(*args)  # the BLAS may round differently at another thread count
        got = mine(*args)
    assert torch.equal(got, want)
    helper = [name for name in threads if name.startswith("moetray-gemm")]
    assert helper and len(helper) < len(threads)  # shared, not handed off whole
    # Each helper's GEMMs run on one intra-op thread (no OpenMP team per helper fighting for
    # the cores); the caller keeps its budget.
    assert [b for name, b in zip(threads, budgets, strict=True) if name in helper] == [1] * len(helper)
    assert torch.get_num_threads() == 2

    threads.clear()
    torch.set_num_threads(1)
    with torch.no_grad():
        assert torch.equal(mine(*args), stock(*args))
    assert set(threads) == {threading.current_thread().name}  # one thread: every group in place, no hand-off


def _bfloat16_prefill_call(tiny_moe, *, tokens: int, seed: int):
    """A bfloat16 model's first experts module and a prefill-size call's arguments (random routing)."""
    om = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), capacity=16, dtype=torch.bfloat16)
    runtime = om.runtime
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(runtime.num_experts, generator=generator)[:runtime.top_k]
                         for _ in range(tokens)])
    args = (torch.randn(tokens, om.model.config.hidden_size, generator=generator).bfloat16(),
            index, torch.rand(tokens, runtime.top_k, generator=generator).bfloat16())
    return expert_modules(om.model)[0][1], args


def test_a_prefill_calls_small_gemms_on_one_thread_each(tiny_moe, monkeypatch):
    """With two torch threads, a bfloat16 prefill-size call (many rows per routed expert, each
    product far below ``ONE_THREAD_MAX_MACS``) runs every GEMM on one intra-op thread, shared
    between the caller and a helper, with the values of the same call at one thread; a product
    above the limit keeps the caller's whole budget. Prevents: a prefill paying an OpenMP team's
    wake-up per expert and projection (the time to first token at two threads was 1.6x that at one
    on the demo), or a large GEMM losing its second core."""
    mine, args = _bfloat16_prefill_call(tiny_moe, tokens=24, seed=0)
    with torch.no_grad():
        want = mine(*args)  # one thread (the autouse fixture): every GEMM in place
    calls: list[tuple[str, int, int]] = []
    real = grouped_module._gemm_into

    def spy(out, lo, hi, src, w, b):
        calls.append((threading.current_thread().name, torch.get_num_threads(), hi - lo))
        return real(out, lo, hi, src, w, b)

    monkeypatch.setattr(grouped_module, "_gemm_into", spy)
    torch.set_num_threads(2)  # the autouse fixture restores the count
    with torch.no_grad():
        got = mine(*args)
    assert torch.equal(got, want)
    assert max(rows for _, _, rows in calls) > grouped_module.FLOAT32_ONE_THREAD_MAX_ROWS  # prefill-size
    assert {threads for _, threads, _ in calls} == {1}
    names = {name for name, _, _ in calls}
    assert threading.current_thread().name in names and any(n.startswith("moetray-gemm") for n in names)
    assert torch.get_num_threads() == 2

    calls.clear()
    monkeypatch.setattr(grouped_module, "ONE_THREAD_MAX_MACS", 0)  # every product counts as large
    with torch.no_grad():
        torch.testing.assert_close(mine(*args), want)
    assert {(name, threads) for name, threads, _ in calls} == {(threading.current_thread().name, 2)}


def test_one_gemm_per_routed_expert_and_projection(tiny_moe, monkeypatch):
    """The grouped path multiplies each routed expert's rows once per projection and visits no
    expert nobody routed to (the stock kernel steps through every expert of the layer).
    Prevents: per-call work growing with the number of experts or of slots in the pool."""
    om, mine, args, want = _batched_call(tiny_moe("qwen3_moe", "per_expert", num_experts=16), tokens=3)
    calls: list[int] = []
    real = grouped_module._gemm_into

    def count(out, lo, hi, src, w, b):
        calls.append(hi - lo)
        return real(out, lo, hi, src, w, b)

    monkeypatch.setattr(grouped_module, "_gemm_into", count)
    with torch.no_grad():
        got = mine(*args)
    routed = set(args[1].flatten().tolist())
    assert torch.equal(got, want)
    assert len(calls) == 2 * len(routed) < 2 * om.runtime.num_experts
    assert sum(calls) == 2 * args[1].numel()  # every token-expert pair once per projection


def test_with_autograd_on_the_values_are_the_same_and_gradients_flow(tiny_moe):
    """The engine runs without gradients, but a caller with autograd on gets the same values
    (not an error from ``mm(out=…)``) and gradients for the hidden states.
    Prevents: the grouped path only working under ``no_grad``."""
    om, mine, (states, index, weights), want = _batched_call(tiny_moe("qwen3_moe", "per_expert"), tokens=5)
    states = states.clone().requires_grad_()
    got = mine(states, index, weights)
    assert torch.equal(got.detach(), want)
    got.sum().backward()
    assert states.grad is not None and torch.isfinite(states.grad).all() and states.grad.abs().sum() > 0


def test_an_unknown_compute_mode_is_refused_before_loading(tiny_moe, monkeypatch):
    """A misspelt compute mode is refused by name before any weight is read."""
    import moetray.engine.experts as experts

    reads: list[int] = []
    real = experts.load_skeleton_and_store
    monkeypatch.setattr(experts, "load_skeleton_and_store", lambda *a, **k: reads.append(1) or real(*a, **k))
    with pytest.raises(UnknownComputeMode) as err:
        load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), capacity=4, compute="grouped")
    assert err.value.kind == "unknown_compute_mode" and reads == []


def test_a_helper_keeps_one_thread_when_the_caller_sets_its_count_after_the_helper_started():
    """A helper thread starts at one intra-op thread and stays there although the caller sets two
    between the helper's start and its first product. torch gives a thread its count lazily, at the
    first read, from the count any thread set last. Prevents: a helper's first GEMMs running an
    OpenMP team of their own (it made the share-out test above fail about one run in three)."""
    from moetray.engine.helpers import _one_thread

    started, go = threading.Event(), threading.Event()
    seen: list[int] = []

    def helper() -> None:
        _one_thread()  # the helper pool's initializer
        started.set()
        go.wait(timeout=60)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=helper)
    thread.start()
    assert started.wait(timeout=60), "the helper thread never ran its initializer"
    torch.set_num_threads(2)  # the autouse fixture restores the count
    go.set()
    thread.join(timeout=60)
    assert seen == [1]


def test_a_16_bit_prefills_expert_products_reach_onednn_at_few_row_counts(tiny_moe, monkeypatch):
    """oneDNN builds a kernel per product shape and keeps a bounded number of them
    (``serve.ONEDNN_CACHED_SHAPES``); each routed expert's group has its own row count, so a bfloat16
    prefill's groups go to the library padded to ``policy.precision.widened_rows`` (powers of two),
    and their rows are the unpadded products' within bfloat16 rounding. Prevents: every prompt
    building (and, past the bound, rebuilding) a kernel per expert and row count (the F16 demo's
    600-word prompt: TTFT 4.3-4.6 s unpadded against 2.6-3.0 s padded, in one process)."""
    from moetray.engine.models import precision as precision_module
    from moetray.policy.precision import widened_rows

    mine, args = _bfloat16_prefill_call(tiny_moe, tokens=37, seed=1)
    groups: list[int] = []
    library_rows: list[int] = []
    real_gemm, real_linear = grouped_module._gemm_into, torch.nn.functional.linear

    def gemm(out, lo, hi, src, w, b):
        groups.append(hi - lo)
        return real_gemm(out, lo, hi, src, w, b)

    def linear(x, w, b=None):
        library_rows.append(x.shape[0])
        return real_linear(x, w, b)

    monkeypatch.setattr(grouped_module, "_gemm_into", gemm)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    with torch.no_grad():
        got = mine(*args)
    assert any(rows != widened_rows(rows) for rows in groups)  # some group needs padding
    assert sorted(library_rows) == sorted(widened_rows(rows) for rows in groups)
    monkeypatch.setattr(precision_module, "widened_rows", lambda rows: rows)
    with torch.no_grad():
        unpadded = mine(*args)
    torch.testing.assert_close(got, unpadded, rtol=1.6e-2, atol=1e-2)
