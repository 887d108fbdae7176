"""Serving formats on the model: int8 weights stay close to float32, bfloat16 one-row steps skip oneDNN,
and the decode bench's step breakdown counts what a served step does."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `moetray serve` sets it (before torch loads)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from moetray.engine.experts import load_offloaded_model  # noqa: E402
from moetray.engine.models.precision import (  # noqa: E402
    Int8Embedding,
    Int8Linear,
    WidenedProducts,
    apply_format,
    float16_fits_bfloat16,
    quantize_linears,
    route_single_row_steps,
)
from moetray.policy.precision import ServingFormat  # noqa: E402

torch.set_num_threads(1)


def _load(path, dtype):
    off = load_offloaded_model(path, dtype=dtype, capacity=2 * 8)
    return off.model, off.runtime


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_int8_linear_is_the_dequantized_product():
    """One scale per output channel, round to nearest: the kernel's result equals the product
    with the dequantized weight up to bfloat16 rounding of the output."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = Int8Linear(linear)
    assert q.qweight.dtype == torch.int8 and q.qscale.shape == (48,)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    dequant = q.qweight.float() * q.qscale.float()[:, None]
    ref = x.float() @ dequant.T + q.bias.float()
    got = q(x).float()
    assert torch.allclose(got, ref, rtol=2e-2, atol=2e-2), float((got - ref).abs().max())
    # Against the float weights, the rounding error is at most half a step per weight.
    step = (linear.weight.detach() - dequant).abs() / q.qscale.float()[:, None]
    assert float(step.max()) <= 0.5 + 1e-3


def test_int8_model_stays_close_to_float32_and_reads_one_byte_per_dense_weight(tiny_moe):
    """Every dense linear becomes int8 (the LM head too, untied from the embedding), so does the
    embedding table, and the logits move by a bounded amount against the float32 model.
    Prevents: an int8 path that quietly keeps bfloat16 weights, or one that computes garbage."""
    path = tiny_moe("qwen3_moe", "per_expert")
    ids = list(range(3, 40))
    ref_model, _ = _load(path, torch.float32)
    ref = _logits(ref_model, ids)
    model, _ = _load(path, torch.bfloat16)
    count = quantize_linears(model)
    assert count > 0 and not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model.config.get_text_config().tie_word_embeddings is False
    table = model.get_input_embeddings()  # its own int8 rows (untied), a scale per row
    assert isinstance(table, Int8Embedding) and table.qweight.dtype == torch.int8
    assert table.qweight is not model.get_output_embeddings().qweight
    got = _logits(model, ids)
    spread = float(ref.std())
    assert float((got - ref).abs().max()) < 0.25 * spread + 0.05
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


def test_a_tied_int8_model_reads_its_embedding_table_from_the_heads_int8_rows(tiny_moe):
    """A table tied to the LM head is not kept a second time: each row is the head's int8 row
    times its scale, and the logits stay as close to float32 as an untied int8 model's.
    Prevents: the int8 format keeping a 16-bit table beside the head's int8 copy."""
    from moetray.engine.bench.decode import dense_bytes_per_step

    path = tiny_moe("qwen3_moe", "per_expert")
    ids = list(range(3, 40))

    def tied(dtype):
        model, _ = _load(path, dtype)
        model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True
        return model

    ref = _logits(tied(torch.float32), ids)
    model = tied(torch.bfloat16)
    vocab = model.config.vocab_size
    quantize_linears(model)
    table, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(table, Int8Embedding) and isinstance(head, Int8Linear)
    assert table.qweight is head.qweight and table.qscale is head.qscale
    assert not any(p.shape[0] == vocab for p in model.parameters())  # no 16-bit table left
    row = (head.qweight[7].float() * head.qscale[7].float()).to(torch.bfloat16)
    assert torch.equal(table(torch.tensor([[7]]))[0, 0], row)
    head_bytes = head.qweight.numel() + head.qscale.numel() * 2
    assert dense_bytes_per_step(model) > head_bytes  # the head, once, and the layers
    got = _logits(model, ids)
    assert float((got - ref).abs().max()) < 0.25 * float(ref.std()) + 0.05
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


def test_an_int8_product_of_many_rows_widens_the_weight_to_the_kernels_values(monkeypatch):
    """Past the rows where the int8 kernel's per-row cost loses, the weight is widened (exact)
    and multiplied by oneDNN: the result is the kernel's up to one more bfloat16 rounding, and a
    weight larger than a block is widened block by block to the same values."""
    from moetray.engine.experts.int8 import Int8Weight, int8_gemm
    from moetray.engine.models import precision

    torch.manual_seed(0)
    q = Int8Linear(nn.Linear(512, 384, bias=True))
    x = torch.randn(300, 512, dtype=torch.bfloat16)
    kernel = torch.ops.aten._weight_int8pack_mm(x, q.qweight, q.qscale).float() + q.bias.float()
    before = WidenedProducts.count
    got = q(x).float()
    assert WidenedProducts.count == before + 1
    assert float((got - kernel).abs().max()) <= 2 ** -7 * float(kernel.abs().max())
    monkeypatch.setattr(precision, "WIDEN_BLOCK_WEIGHTS", 512 * 100)  # four blocks of output channels
    precision._WIDEN.scratch = None
    assert torch.equal(q(x).float(), got) and WidenedProducts.count == before + 2
    # The grouped experts' int8 product widens a large group the same way; a decode step's rows do not.
    weight = Int8Weight(q.qweight, q.qscale)
    assert torch.equal((int8_gemm(x, weight) + q.bias).float(), got)
    assert WidenedProducts.count == before + 3
    int8_gemm(x[:4], weight)
    assert WidenedProducts.count == before + 3


def test_an_int8_models_long_prompt_widens_its_dense_products(tiny_moe):
    """Served as int8, a long prompt's attention and LM-head products widen the weight, and the
    logits stay as close to float32 as the kernel's. Prevents: the int8 linear computing long
    prompts row after row (measured on the demo: a ~4,500-token prompt's first token 10 s so,
    5 s widened)."""
    path = tiny_moe("qwen3_moe", "per_expert")
    ids = [3 + i % 300 for i in range(700)]  # a 64×64 weight widens from ~620 rows
    ref = _logits(_load(path, torch.float32)[0], ids)
    model, _ = _load(path, torch.bfloat16)
    quantize_linears(model)
    before = WidenedProducts.count
    got = _logits(model, ids)
    assert WidenedProducts.count > before
    assert float((got - ref).abs().max()) < 0.25 * float(ref.std()) + 0.05
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


class _MkldnnProbe:
    """Records whether oneDNN was enabled each time a module ran."""

    def __init__(self, module: nn.Module) -> None:
        self.seen: list[bool] = []
        module.register_forward_pre_hook(lambda *_: self.seen.append(torch.backends.mkldnn.enabled))


def test_one_row_steps_run_with_onednn_off_and_others_untouched(tiny_moe):
    """bfloat16 on the CPU: a forward of one token runs with oneDNN off (torch's own
    matrix-vector kernel), a forward of several with it on, and the flag is restored after
    either. Sabotage: without the routing, the one-row forward sees oneDNN on."""
    path = tiny_moe("qwen3_moe", "per_expert")
    model, _ = _load(path, torch.bfloat16)
    route_single_row_steps(model)
    route_single_row_steps(model)  # idempotent
    probe = _MkldnnProbe(model.model.layers[0].self_attn.q_proj)
    assert torch.backends.mkldnn.enabled
    with torch.no_grad():
        model(torch.tensor([[5]]))
        model(torch.tensor([[5, 6, 7]]))
        model(torch.tensor([[5], [6]]))  # two requests of one token each: two rows
    assert probe.seen == [False, True, True]
    assert torch.backends.mkldnn.enabled


def test_apply_format_installs_what_the_format_asks(tiny_moe):
    """The engine's one entry point: int8 quantizes, bfloat16 on the CPU routes one-row steps,
    float32 changes nothing."""
    path = tiny_moe("qwen3_moe", "per_expert")
    cpu = torch.device("cpu")
    fp32, _ = _load(path, torch.float32)
    apply_format(ServingFormat("float32", "float32", "test"), fp32, cpu)
    assert not getattr(fp32, "_moetray_single_row_routing", False)
    assert any(type(m) is nn.Linear for m in fp32.modules())
    i8, _ = _load(path, torch.bfloat16)
    apply_format(ServingFormat("bfloat16", "int8", "test"), i8, cpu)
    assert getattr(i8, "_moetray_single_row_routing", False)
    assert not any(type(m) is nn.Linear for m in i8.modules())


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_dense_bytes_per_step_counts_what_a_step_reads(tiny_moe, fmt):
    """The decode bench's bytes per step: every non-expert weight once, the embedding table
    only where it is the LM head, int8 weights at one byte."""
    from moetray.engine.bench.decode import dense_bytes_per_step

    path = tiny_moe("qwen3_moe", "per_expert")
    model, _ = _load(path, torch.bfloat16)
    embed = model.get_input_embeddings().weight
    before = dense_bytes_per_step(model)
    params = sum(p.numel() * 2 for p in model.parameters() if p is not embed)
    assert before == params  # untied: the table is skipped
    if fmt == "int8":
        quantize_linears(model)
        after = dense_bytes_per_step(model)
        assert after < 0.6 * before


@pytest.mark.parametrize(("family", "layout"), [("qwen3_moe", "per_expert"), ("gpt_oss", "fused")])
@pytest.mark.parametrize("capacity", [16, 5])
def test_int8_experts_stay_close_to_float32_at_any_capacity(tiny_moe, family, layout, capacity):
    """Experts kept as int8 rows (one byte per weight in the store and the slots) and computed
    by the weight-only int8 kernel: the logits stay within a bound of the float32 model's, with
    every expert resident and with misses (5 slots of 16), for a plain SwiGLU family and a
    biased, transposed one (gpt-oss). The slots hold what the store holds, byte for byte."""
    from moetray.engine.experts.int8 import Int8ExpertStore

    path = tiny_moe(family, layout)
    ids = list(range(3, 30))
    ref = _logits(_load(path, torch.float32)[0], ids)
    off = load_offloaded_model(path, dtype=torch.bfloat16, capacity=capacity, expert_format="int8")
    assert isinstance(off.store, Int8ExpertStore) and off.store.format == "INT8"
    bf16 = load_offloaded_model(path, dtype=torch.bfloat16, capacity=capacity)
    assert off.runtime.bytes_per_slot < 0.6 * bf16.runtime.bytes_per_slot
    got = _logits(off.model, ids)
    assert float((got - ref).abs().max()) < 0.25 * float(ref.std()) + 0.05
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8
    off.runtime.check_integrity(deep=True)


def test_int8_experts_dequantize_to_their_rounding():
    """A row's int8 values times its scales give back the weights within half a step."""
    from moetray.engine.experts.int8 import Int8Layout
    from moetray.engine.experts.store import ExpertGeometry, Segment

    torch.manual_seed(0)
    geo = ExpertGeometry((Segment("gate_up_proj", (16, 8), 0, 128), Segment("down_proj", (8, 8), 128, 64)),
                         has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True)
    layout = Int8Layout.from_geometry(geo)
    weights = {"gate_up_proj": torch.randn(16, 8), "down_proj": torch.randn(8, 8)}
    row = torch.empty(layout.row_bytes, dtype=torch.uint8)
    layout.quantize(weights, geo, row)
    first, _, down, _ = layout.operands(row)
    for w, name in ((first, "gate_up_proj"), (down, "down_proj")):
        back = w.qweight.float() * w.scale.float()[:, None]
        assert float(((back - weights[name]).abs() / w.scale.float()[:, None]).max()) <= 0.5 + 1e-3


def test_int8_experts_refuse_the_eager_compute_mode(tiny_moe):
    from moetray.engine.experts import UnknownComputeMode

    with pytest.raises(UnknownComputeMode):
        load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.bfloat16, capacity=16,
                             expert_format="int8", compute="eager")


def test_an_int8_product_of_a_few_rows_reads_each_weight_row_once_for_all_of_them():
    """1 to 8 rows (a decode step of up to eight requests) take ``moetray::int8_rows_mm`` where it
    builds: the float32 product with the dequantized weight, scaled and rounded to bfloat16 once,
    for input widths with and without a tail past 32; nine rows take torch's kernel. Prevents: the
    kernel unwired from the int8 linears (the counter stays), or a wrong tail, row or scale."""
    from moetray.engine.models import few_rows

    if few_rows.build() is not None:
        pytest.skip(f"the few-rows kernel does not serve here: {few_rows.refusal()}")
    torch.manual_seed(0)
    for width in (40, 80, 576):
        q = Int8Linear(nn.Linear(width, 96, bias=True))
        for rows in range(1, few_rows.MAX_ROWS + (2 if width == 576 else 1)):
            x = torch.randn(rows, width, dtype=torch.bfloat16)
            ref = (x.float() @ (q.qweight.float() * q.qscale.float()[:, None]).T).to(torch.bfloat16).float()
            before = few_rows.RowsProducts.count
            got = q(x).float() - q.bias.float()
            assert few_rows.RowsProducts.count == before + (rows <= few_rows.MAX_ROWS)
            assert float((got - ref).abs().max()) <= 2 ** -6 * float(ref.abs().max()), (width, rows)


def test_the_few_rows_kernel_rounds_activations_finer_than_bfloat16_at_any_width():
    """Where the CPU has VNNI the kernel multiplies in integers, each activation row rounded to int16
    with one scale: a row whose one input is 100× its others (an outlier channel) still gives the
    float32 product of its bfloat16 values to bfloat16 rounding, for rows of up to 8,192 inputs and
    past them (the float32 loop); a NaN input makes its row's outputs NaN, as float32 would. Prevents:
    activations rounded coarser than they arrive, an int32 sum that overflows on a wide row, or a
    NaN hidden as a finite number."""
    from moetray.engine.models import few_rows

    if few_rows.build() is not None:
        pytest.skip(f"the few-rows kernel does not serve here: {few_rows.refusal()}")
    gen = torch.Generator().manual_seed(3)
    for width in (576, 8192, 8224):
        qweight = torch.full((8, width), 127, dtype=torch.int8)  # the widest sum an int32 lane holds
        qweight[1::2] = torch.randint(-127, 128, (4, width), generator=gen, dtype=torch.int8)
        qscale = torch.full((8,), 1e-3, dtype=torch.bfloat16)
        x = torch.rand(3, width, generator=gen)
        x[:, 5] = 100.0
        x[2] = -100.0  # every input at the row's largest: 32767 · 127 in each product
        x = x.to(torch.bfloat16)
        got = torch.ops.moetray.int8_rows_mm(x, qweight, qscale).float()
        want = x.float() @ (qweight.float() * qscale.float()[:, None]).T
        assert float(((got - want).abs() / want.abs().clamp_min(1.0)).max()) <= 2 ** -8, width
        x[1, 7] = float("nan")
        got = torch.ops.moetray.int8_rows_mm(x, qweight, qscale).float()
        assert got[1].isnan().all() and not got[[0, 2]].isnan().any(), width  # not rounded away


def test_a_compiled_int8_linear_of_a_few_rows_calls_the_few_rows_kernel():
    """Traced in a compiled step (a decode step of four requests), an int8 linear's product is the
    few-rows kernel's call in the generated code, with its eager values. Prevents: the compiled
    step keeping torch's kernel for its small batches."""
    from torch._inductor.utils import run_and_get_code

    from moetray.engine.models import few_rows

    if few_rows.build() is not None:
        pytest.skip(f"the few-rows kernel does not serve here: {few_rows.refusal()}")
    torch.manual_seed(1)
    q = Int8Linear(nn.Linear(96, 64, bias=True))
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        got, code = run_and_get_code(torch.compile(q, fullgraph=True, dynamic=False), x)
        assert "int8_rows_mm" in "\n".join(code) and "_weight_int8pack_mm" not in "\n".join(code)
        assert torch.equal(got, q(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_product_of_a_few_rows_reads_each_weight_row_once_for_all_of_them(dtype):
    """1 to 8 rows of a 16-bit linear take ``moetray::half_rows_mm`` where it builds: the float32
    product of the same 16-bit values, the bias added before one rounding, for input widths of whole
    32-value blocks and with a tail; nine rows, or a weight that is not contiguous, take ``F.linear``.
    Prevents: the kernel unwired from ``half_product`` (the counter stays), a tail or a row skipped,
    float16 read as bfloat16."""
    from moetray.engine.models import few_rows

    if few_rows.build() is not None:
        pytest.skip(f"the few-rows kernel does not serve here: {few_rows.refusal()}")
    torch.manual_seed(2)
    for width in (40, 96, 576):
        linear = nn.Linear(width, 72, bias=True).to(dtype)
        for rows in range(1, few_rows.MAX_ROWS + 2):
            x = torch.randn(1, rows, width, dtype=dtype)
            want = (x.float() @ linear.weight.float().T + linear.bias.float()).to(dtype)
            before = few_rows.RowsProducts.count
            got = few_rows.half_product(x, linear.weight, linear.bias)
            assert few_rows.RowsProducts.count == before + (rows <= few_rows.MAX_ROWS)
            assert got.shape == want.shape and got.dtype == dtype
            err = float((got.float() - want.float()).abs().max())
            assert err <= 2 ** -7 * float(want.abs().max()), (width, rows)
    before = few_rows.RowsProducts.count
    strided = torch.randn(96, 8, dtype=dtype).t()  # not contiguous: the library's product
    x = torch.randn(2, 96, dtype=dtype)
    torch.testing.assert_close(few_rows.half_product(x, strided, None), x @ strided.t())
    assert few_rows.RowsProducts.count == before


def test_a_compiled_half_linear_of_a_few_rows_calls_the_few_rows_kernel():
    """Traced in a compiled step (a decode step of four requests), a bfloat16 linear routed by the
    compiled step's rules is the few-rows kernel's call in the generated code, with its eager values.
    Prevents: the compiled step keeping the library's product for its small batches."""
    from torch._inductor.utils import run_and_get_code

    from moetray.engine.cb import one_row
    from moetray.engine.models import few_rows

    if few_rows.build() is not None:
        pytest.skip(f"the few-rows kernel does not serve here: {few_rows.refusal()}")
    torch.manual_seed(3)
    linear = nn.Linear(96, 64, bias=True).to(torch.bfloat16)
    x = torch.randn(1, 4, 96, dtype=torch.bfloat16)
    routed = functools.partial(one_row._traced_linear, linear)
    with torch.no_grad():
        got, code = run_and_get_code(torch.compile(routed, fullgraph=True, dynamic=False), x)
        assert "half_rows_mm" in "\n".join(code)
        want = few_rows.half_product(x, linear.weight, linear.bias)
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -6)


def test_float16_values_fit_bfloat16_exactly_when_their_low_mantissa_bits_are_zero():
    """bfloat16 keeps 8 significant bits, float16 11: a float16 value is a bfloat16 value when its last
    three are zero, subnormals included (bfloat16's exponent reaches far below them); the read stops at
    the first that is not."""
    fits = torch.tensor([0.0, -0.0, 1.0, -2.5, 1 + 2**-7, 2**-24, 3 * 2**-24, 65280.0, float("inf")])
    assert float16_fits_bfloat16([fits.to(torch.float16)])
    for value in (1 + 2**-10, 1 + 2**-8, 257 * 2**-24):
        assert not float16_fits_bfloat16([fits.to(torch.float16), torch.tensor([value], dtype=torch.float16)])
    assert float16_fits_bfloat16([])
