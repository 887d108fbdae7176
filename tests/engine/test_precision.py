"""Serving formats on the model: int8 weights stay close to float32, bfloat16 one-row steps skip oneDNN,
and the decode bench's step breakdown counts what a served step does."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `moetray serve` sets it (before torch loads)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from moetray.engine.experts import load_offloaded_model  # noqa: E402
from moetray.engine.models.precision import (  # noqa: E402
    Int8Linear,
    apply_format,
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
    """Every dense linear becomes int8 (the LM head too, untied from the embedding), and the
    logits move by a bounded amount against the float32 model. Prevents: an int8 path that
    quietly keeps bfloat16 weights, or one that computes garbage."""
    path = tiny_moe("qwen3_moe", "per_expert")
    ids = list(range(3, 40))
    ref_model, _ = _load(path, torch.float32)
    ref = _logits(ref_model, ids)
    model, _ = _load(path, torch.bfloat16)
    count = quantize_linears(model)
    assert count > 0 and not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model.config.get_text_config().tie_word_embeddings is False
    got = _logits(model, ids)
    spread = float(ref.std())
    assert float((got - ref).abs().max()) < 0.25 * spread + 0.05
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
