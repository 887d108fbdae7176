"""One-row products and few-query attention (engine/cb/one_row.py): the formulas equal torch's
kernels, and a half-precision compiled decode step takes them (its decoder's linears, its LM head,
its attention) on a real tiny MoE through the real batcher."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from test_cb_runner import make_runner, prompt_ids, run_all
from torch import nn
from torch._inductor.utils import run_and_get_code
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from moetray.engine.cb import Sampling, one_row
from moetray.engine.cb.compiled_step import install_decode_step
from moetray.engine.experts import load_offloaded_model
from moetray.engine.experts.fused import FUSED_MAX_TOKENS
from moetray.engine.models import few_rows
from moetray.engine.models.precision import Int8Linear, quantize_linears


def _int8_loads(fn, *args) -> set[int]:
    """The vector widths (lanes) at which ``fn``'s compiled C++ loads int8 rows."""
    _, code = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False), *args)
    return {int(n) for n in re.findall(r"Vectorized<int8_t>::loadu\([^;]*?(\d+)\)\)", "\n".join(code))}


def test_a_one_row_product_is_the_linear_product():
    """Float32 accumulation, one rounding: float32 equal to rounding, bfloat16 within one bf16
    step of the library's product. Prevents: a transposed weight or a dropped bias."""
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 1, 96), torch.randn(40, 96), torch.randn(40)
    torch.testing.assert_close(one_row.one_row_product(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    got, want = one_row.one_row_product(xb, wb, None), F.linear(xb, wb)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


def test_an_int8_one_row_product_is_the_int8_kernels_product():
    """``Int8Linear``'s product as a multiply-and-sum over widened activations: within one bf16
    step of torch's weight-only int8 kernel. Prevents: the per-channel scale or the bias dropped."""
    torch.manual_seed(2)
    linear = Int8Linear(nn.Linear(96, 40))
    x = torch.randn(1, 1, 96).bfloat16()
    got, want = one_row.one_row_int8_product(x, linear.qweight, linear.qscale, linear.bias), linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


def test_compiled_int8_products_load_their_rows_at_float32_width():
    """The widened activations are a buffer of their own, so the compiled reduction loads int8 rows
    16 at a time (float32's lanes: the fast path measured ~3x the 32-lane one that bfloat16
    activations in the loop give). Prevents: the widening fused back into the reduction."""
    linear = Int8Linear(nn.Linear(96, 64))
    x = torch.randn(1, 96).bfloat16()
    assert _int8_loads(one_row.one_row_int8_product, x, linear.qweight, linear.qscale, linear.bias) == {16}

    def inline(x, q, scale, bias):  # the formula without the buffer: what the check must tell apart
        return ((x.unsqueeze(-2).float() * q.float()).sum(-1) * scale.float() + bias.float()).to(x.dtype)

    assert _int8_loads(inline, x, linear.qweight, linear.qscale, linear.bias) == {32}


@pytest.mark.parametrize("mask", ["none", "additive", "bool"])
def test_few_query_attention_is_sdpas_result(mask):
    """Grouped KV heads (9 query heads on 3), with and without a padding mask in either form: equal to
    torch's SDPA in float32, values as wide as the keys or narrower. Prevents: a head read from the wrong
    KV group, a mask ignored, or the values' width taken from the keys."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 9, 1, 16), torch.randn(2, 3, 11, 16), torch.randn(2, 3, 11, 16)
    keep = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    keep[0, ..., 7:] = False
    attn_mask = {"none": None, "bool": keep,
                 "additive": torch.zeros(2, 1, 1, 11).masked_fill(~keep, -math.inf)}[mask]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=0.3, enable_gqa=True)
    got = one_row.few_query_attention(q, k, v, attn_mask, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    narrow = v[..., :12]  # values narrower than keys (latent attention)
    want = F.scaled_dot_product_attention(q, k, narrow, attn_mask=attn_mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(one_row.few_query_attention(q, k, narrow, attn_mask, 0.3), want, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("mask", ["additive", "bool"])
def test_few_query_attention_of_a_batch_of_sequences_is_sdpas_result(mask):
    """Three queries of three sequences over their keys laid end to end (as a continuous batch's decode
    step reads them), each masked to its own sequence's keys, and a chunk's causal mask: equal to
    torch's SDPA. A query that attends to nothing gets finite values. Prevents: queries of one KV
    group mixed up with another's, a mask applied to the wrong query, or NaN from an empty row."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 9, 3, 16), torch.randn(1, 3, 12, 16), torch.randn(1, 3, 12, 16)
    own = torch.zeros(1, 1, 3, 12, dtype=torch.bool)
    own[..., 0, :5], own[..., 1, 5:9], own[..., 2, 9:] = True, True, True
    causal = torch.ones(3, 12, dtype=torch.bool).tril(diagonal=9)[None, None]
    for keep in (own, causal):
        attn_mask = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=0.3, enable_gqa=True)
        got = one_row.few_query_attention(q, k, v, attn_mask, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    nothing = torch.zeros(1, 1, 3, 12, dtype=torch.bool)
    assert one_row.few_query_attention(q, k, v, nothing, 0.3).isfinite().all()


def test_several_queries_without_a_mask_keep_the_causal_kernel(monkeypatch):
    """Traced, several query tokens with no mask mean causal attention: transformers' function serves
    them (the few-query formula would let each query see later keys); one token or a mask takes the
    formula. Prevents: a chunk without a mask computed without causality."""
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 3, 8)
    taken = _counting(monkeypatch, "few_query_attention")

    def attend(q, k, mask):
        out, _ = one_row.few_query_sdpa(module, q, k, k, mask, scaling=0.5)
        return out

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    want, _ = sdpa_attention_forward(module, q, k, k, None, scaling=0.5)
    torch.testing.assert_close(compiled(q, k, None), want, rtol=1e-5, atol=1e-5)
    assert taken == []
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(compiled(q, k, causal), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled(q[:, :, :1], k[:, :, :1], None), want[:, :1], rtol=1e-5, atol=1e-5)
    assert [args[0].shape[2] for args in taken] == [3, 1]


def test_compiled_few_query_attention_calls_two_batched_products():
    """Compiled with a rotary query and keys and values gathered from a paged cache (as in the decode
    step), the scores and the weighted values are library ``bmm`` calls, and the result is the eager
    one. Prevents: the multiply-and-sum form coming back, where inductor recomputed the query's
    rotary embedding for every cached key and gathered each key's values once per value column.
    Tried again for one query token only (the decode graph of one request, no extern call between
    the KV gather and the softmax): served int8 demo, 48-token replies, two processes of each form
    taking turns, 24 replies each: 82 against 88 tok/s (medians), slower still."""
    torch.manual_seed(4)
    cache_k, cache_v = torch.randn(64, 3, 16), torch.randn(64, 3, 16)
    rows, angles = torch.tensor([5, 9, 17, 33, 40]), torch.arange(16) * 0.1

    def step(q, cache_k, cache_v, rows, angles):
        q = q * angles.cos() + q.flip(-1) * angles.sin()
        k, v = (c.index_select(0, rows).transpose(0, 1)[None] for c in (cache_k, cache_v))
        return one_row.few_query_attention(q, k, v, None, None)

    q = torch.randn(1, 9, 1, 16)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    got, code = run_and_get_code(compiled, q, cache_k, cache_v, rows, angles)
    assert "\n".join(code).count("extern_kernels.bmm(") == 2
    torch.testing.assert_close(got, step(q, cache_k, cache_v, rows, angles), rtol=1e-5, atol=1e-5)


def test_eager_attention_is_transformers_own_sdpa():
    """Untraced (prefill, a refused graph), the registered ``"sdpa"`` is transformers' function."""
    one_row.install_few_query_attention()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is one_row.few_query_sdpa
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 5, 8)
    got, _ = one_row.few_query_sdpa(module, q, k, k, None, scaling=0.5)
    want, _ = sdpa_attention_forward(module, q, k, k, None, scaling=0.5)
    assert torch.equal(got, want)


def _counting(monkeypatch, name: str) -> list[tuple]:
    """Wrap ``one_row.<name>`` to record its calls' arguments (a traced call records at compile time)."""
    calls, original = [], getattr(one_row, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(one_row, name, counted)
    return calls


async def _decode_through_the_step(off, tok, traced: list[tuple]):
    """Install the compiled step on ``off``'s model, start the batcher (which compiles it) and
    decode one greedy request of 6 tokens. Asserts the start-up compilation traced what ``traced``
    records, every decode step took the graph and every decode step's LM head a one-row product:
    the few-rows kernel's where it is built (counted by ``RowsProducts``), else its compiled region."""
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    assert step.head is not None and off.model.lm_head.forward is step.head
    runner = make_runner(off.model, policy="off", one_thread_small_steps=True)  # as served (step_threads)
    try:
        assert step.reason is None and traced  # compiled at start
        before = step.head.one_row_calls, step.compiled_steps, few_rows.RowsProducts.count
        request = (prompt_ids(tok, "One row at a time"), 6, Sampling(temperature=0.0))
        finals = await run_all(runner, {"r": request})
    finally:
        runner.stop()
    assert len(finals["r"].generated_tokens) == 6
    decode_steps = step.compiled_steps - before[1]
    assert decode_steps >= 5, step.reason
    assert step.head.one_row_calls - before[0] >= decode_steps, step.head.reason
    kernel_products = few_rows.RowsProducts.count - before[2]  # eager: the head's (and a prefill's)
    assert (kernel_products >= decode_steps) == few_rows.loaded()
    return step


@pytest.fixture
def uncached_compilation():
    """Compile for real: a graph served from inductor's caches skips the post-grad passes."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("uncached_compilation")
def test_one_row_half_matmuls_become_a_multiply_and_sum(dtype):
    """The step's pass replaces a statically one-row 16-bit ``mm`` (a router's ``F.linear`` on a
    bare weight): no library call left, the value within one 16-bit step; four rows and float32
    keep the library's product. Prevents: the pattern never matching, or matching a batch."""
    torch.manual_seed(3)
    w = torch.randn(16, 96, dtype=dtype)

    def router(x, w):
        return F.linear(x, w).float().softmax(-1)

    def compiled(x, w) -> tuple[torch.Tensor, str]:
        fn = torch.compile(router, fullgraph=True, dynamic=False,
                           options={"post_grad_custom_post_pass": one_row.OneRowMatmuls()})
        out, code = run_and_get_code(fn, x, w)
        return out, "\n".join(code)

    before = one_row.OneRowMatmuls.replaced
    x = torch.randn(1, 96, dtype=dtype)
    got, code = compiled(x, w)
    assert one_row.OneRowMatmuls.replaced == before + 1 and "extern_kernels.mm" not in code
    torch.testing.assert_close(got, router(x, w), rtol=0, atol=2 ** -7)
    for rows, weight in ((torch.randn(4, 96, dtype=dtype), w), (torch.randn(1, 96), w.float())):
        _, code = compiled(rows, weight)
        assert "extern_kernels.mm" in code
    assert one_row.OneRowMatmuls.replaced == before + 1


@pytest.mark.usefixtures("uncached_compilation")
async def test_a_half_precision_decode_step_takes_the_one_row_paths(tiny, tiny_moe, monkeypatch):
    """bfloat16 tiny MoE with the compiled step: the start-up compilation traces few-query
    attention in both graphs (one token, a symbolic count) and turns each layer's router product
    into a multiply-and-sum (the step's post-grad pass), the decoder's linears are routed (one-row
    products to the few-rows kernel where it is built), and every decode step's LM head takes a
    one-row product. Prevents: the attention, the routers' pass, the linears' routing or the head's
    router never wired (each is a counter or a check that stays put)."""
    traced = _counting(monkeypatch, "few_query_attention")
    one_row_kernel: list[bool] = []  # traced few-rows products of a statically one-row input
    half_product = few_rows.half_product

    def counted(x, weight, bias):
        if torch.compiler.is_compiling():
            one_row_kernel.append(isinstance(x.shape[0], int) and x.numel() == x.shape[-1])
        return half_product(x, weight, bias)

    monkeypatch.setattr(few_rows, "half_product", counted)
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.bfloat16, capacity=8)
    off.runtime.warm_up()  # the experts' kernel serves, as where the engine installs the step
    routers = one_row.OneRowMatmuls.replaced
    step = await _decode_through_the_step(off, tiny[1], traced)
    layers = off.model.config.num_hidden_layers
    one_token = [args for args in traced if isinstance(args[0].shape[2], int) and args[0].shape[2] == 1]
    assert len(one_token) >= layers and len(traced) - len(one_token) >= layers  # both graphs: 1 and N tokens
    assert one_row.OneRowMatmuls.replaced - routers >= layers
    linears = [m for m in off.model.model.modules() if type(m) is nn.Linear]
    assert linears and all(m.forward.__func__ is one_row._traced_linear for m in linears)
    assert not step.head.int8
    # The one-token graph's bfloat16 linears are the few-rows kernel's where it is built.
    assert (sum(one_row_kernel) >= len(linears)) == few_rows.loaded()


async def test_an_int8_decode_step_takes_the_int8_one_row_product(tiny, tiny_moe, monkeypatch):
    """int8 tiny MoE (int8 experts and linears) with the compiled step: the decoder's int8 linears
    are routed, the start-up compilation traced their one-row product, requests decode through the
    graph and every decode step's int8 LM head takes the compiled region. Prevents: the int8
    linears left on the kernel's extern calls, or the int8 head never routed."""
    traced = _counting(monkeypatch, "one_row_int8_product")
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.bfloat16, capacity=8,
                               expert_format="int8")
    assert quantize_linears(off.model) > 0  # every linear, the LM head too, as the int8 format has them
    off.runtime.warm_up()
    step = await _decode_through_the_step(off, tiny[1], traced)
    linears = [m for m in off.model.model.modules() if type(m) is Int8Linear]
    assert linears and all(m.forward.__func__ is one_row._traced_int8_linear for m in linears)
    assert step.head.int8 and len(traced) >= len(linears)  # every layer's linears were traced


@pytest.mark.parametrize("int8", [False, True])
def test_a_small_steps_head_is_shared_out_in_row_blocks_with_the_same_values(monkeypatch, int8):
    """At one intra-op thread with a budget of two, a large head computes its output rows in blocks
    handed to :func:`share_out` over two threads; one row or several, the values equal the head
    computed whole. Below the size limit, or at more threads (a prefill), it is not shared.
    Prevents: a block written to the wrong columns, or the sharing never wired (a counter)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 1000, bias=True).to(torch.bfloat16)
    head = one_row.OneRowHead(Int8Linear(linear) if int8 else linear)
    shared: list[int] = []
    real = one_row.share_out
    monkeypatch.setattr(one_row, "share_out",
                        lambda tasks, threads: (shared.append(threads), real(tasks, threads)))
    monkeypatch.setattr(one_row, "SHARED_HEAD_MIN_WEIGHTS", 64 * 1000)
    torch.set_num_threads(1)  # a small step's thread (the autouse fixture restores the count)
    with torch.no_grad():
        for x in (torch.randn(1, 1, 64).bfloat16(), torch.randn(1, 3, 64).bfloat16()):
            whole = head(x)
            head.warm_up(2)
            assert torch.equal(head(x), whole)
            head.thread_budget = 1
        assert head.shared_calls == 2 and shared == [2, 2]
        head.thread_budget = 2
        monkeypatch.setattr(one_row, "SHARED_HEAD_MIN_WEIGHTS", 64 * 1000 + 1)
        head(torch.randn(1, 1, 64).bfloat16())
        monkeypatch.setattr(one_row, "SHARED_HEAD_MIN_WEIGHTS", 0)
        torch.set_num_threads(2)
        head(torch.randn(1, 1, 64).bfloat16())
    assert head.shared_calls == 2


async def test_a_served_small_steps_head_is_shared_and_compiled_at_start(tiny, tiny_moe, monkeypatch):
    """bfloat16 tiny MoE with the compiled step and a budget of two threads (its head counted as
    large): every decode step's head is shared out, its blocks' compiled products were built at
    start (no graph compiled while serving) and the tokens equal those at a budget of one.
    Prevents: the budget never handed to the head, or a helper compiling mid-request."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(one_row, "SHARED_HEAD_MIN_WEIGHTS", 0)
    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.bfloat16, capacity=8)
    off.runtime.warm_up()
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    request = {"r": (prompt_ids(tiny[1], "Share the head"), 6, Sampling(temperature=0.0))}
    tokens = {}
    for budget in (1, 2):
        runner = make_runner(off.model, policy="off", one_thread_small_steps=True, thread_budget=budget)
        try:
            graphs, steps = counters["stats"]["unique_graphs"], step.compiled_steps
            shared = step.head.shared_calls
            tokens[budget] = (await run_all(runner, {**request}))["r"].generated_tokens
        finally:
            runner.stop()
        if budget == 2:
            assert step.compiled_steps - steps >= 5
            assert step.head.shared_calls - shared >= step.compiled_steps - steps
            assert counters["stats"]["unique_graphs"] == graphs
    assert tokens[2] == tokens[1] and len(tokens[1]) == 6


def test_shared_out_tasks_run_under_the_callers_grad_mode():
    """Grad mode is per thread and a compiled task's graph guards on it: a helper taking a task
    runs it under the caller's mode, not its thread's default (else it compiled again, mid-request;
    a fresh-clone CI run saw one graph more while serving). The caller's first task waits until a
    helper has taken one. Prevents: a helper computing under grad mode in an inference step."""
    import threading

    from moetray.engine.helpers import share_out

    caller, helper_started = threading.get_ident(), threading.Event()
    seen: list[tuple[int, bool]] = []

    def task() -> None:
        seen.append((threading.get_ident(), torch.is_grad_enabled()))
        if threading.get_ident() == caller:
            assert helper_started.wait(30), "no helper took a task within 30 s"
        else:
            helper_started.set()

    with torch.no_grad():
        share_out([task] * 4, 2)
    assert len(seen) == 4 and not any(grad for _, grad in seen)
    assert len({ident for ident, _ in seen}) == 2


def test_an_eager_16_bit_linear_of_many_rows_reaches_onednn_at_a_padded_row_count(monkeypatch):
    """A decoder's 16-bit linear run eagerly (a prefill chunk: as many rows as the prompt has
    tokens) multiplies ``policy.precision.widened_rows`` rows, so prompts of every length share a few
    oneDNN kernels; the rows it returns are the unpadded product's within bfloat16 rounding."""
    from moetray.policy.precision import widened_rows

    lin = nn.Linear(96, 40).bfloat16()
    x = torch.randn(2, 23, 96).bfloat16()
    rows: list[int] = []
    real = F.linear

    def spy(a, w, b=None):
        rows.append(a.shape[0])
        return real(a, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    with torch.no_grad():
        got = one_row._traced_linear(lin, x)
    assert rows == [widened_rows(46)] != [46]
    torch.testing.assert_close(got, real(x, lin.weight, lin.bias), rtol=1.6e-2, atol=1e-2)
