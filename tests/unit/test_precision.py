"""Rules of the serving-format choice: auto never rounds the checkpoint's weights, asks are obeyed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.precision import (
    BF16_FEATURES,
    FORMATS,
    FP16_FEATURES,
    FormatRefused,
    choose_format,
    measures_float16_values,
    native_16bit,
    widened_rows,
    widens_int8_product,
)

pytestmark = pytest.mark.unit

ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "f16c", "fma"})
OLD_X86 = frozenset({"avx2", "f16c", "fma"})
SAPPHIRE = frozenset({"avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})


def test_bfloat16_checkpoint_on_a_bf16_cpu_serves_bfloat16_and_says_why():
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype="bfloat16", cpu_features=ZEN4)
    assert (got.compute, got.weights) == ("bfloat16", "bfloat16")
    assert "avx512_bf16" in got.reason


def test_bfloat16_checkpoint_without_bf16_arithmetic_widens_to_float32():
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype="bfloat16", cpu_features=OLD_X86)
    assert got.compute == "float32"
    assert "no bfloat16 arithmetic" in got.reason


def test_float16_checkpoint_needs_float16_arithmetic_not_conversion():
    # F16C converts but does not compute: float16 products of several rows are emulated (slow).
    assert choose_format("auto", device_kind="cpu", checkpoint_dtype="float16",
                         cpu_features=ZEN4).compute == "float32"
    assert choose_format("auto", device_kind="cpu", checkpoint_dtype="float16",
                         cpu_features=SAPPHIRE).compute == "float16"


@given(st.sampled_from([None, "float32", "int8", "weird"]),
       st.frozensets(st.sampled_from(sorted(BF16_FEATURES | FP16_FEATURES | OLD_X86))))
def test_auto_on_cpu_serves_float32_unless_the_checkpoint_is_16_bit(named, features):
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype=named, cpu_features=features)
    assert (got.compute, got.weights) == ("float32", "float32")


@given(st.sampled_from(["float32", "bfloat16", "float16"]),
       st.frozensets(st.sampled_from(sorted(BF16_FEATURES | FP16_FEATURES | OLD_X86))))
def test_auto_never_rounds_the_checkpoints_weights(named, features):
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype=named, cpu_features=features)
    widths = {"float16": 16, "bfloat16": 16, "float32": 32}
    assert got.weights == got.compute
    assert got.compute in (named, "float32") and widths[got.compute] >= widths[named]


def test_cuda_keeps_the_checkpoints_dtype_or_bfloat16():
    assert choose_format("auto", device_kind="cuda", checkpoint_dtype="float16",
                         cpu_features=frozenset()).compute == "float16"
    assert choose_format("auto", device_kind="cuda", checkpoint_dtype=None,
                         cpu_features=frozenset()).compute == "bfloat16"


@pytest.mark.parametrize("asked", [f for f in FORMATS if f != "auto"])
def test_an_explicit_dtype_is_served_as_asked(asked):
    got = choose_format(asked, device_kind="cpu", checkpoint_dtype="bfloat16", cpu_features=OLD_X86)
    assert got.weights == asked
    assert got.reason.startswith(f"--dtype {asked}")


def test_int8_is_weight_only_on_bfloat16_activations():
    got = choose_format("int8", device_kind="cpu", checkpoint_dtype="float32", cpu_features=ZEN4)
    assert (got.compute, got.weights) == ("bfloat16", "int8")


def test_unknown_dtype_is_refused_by_name():
    with pytest.raises(FormatRefused) as exc:
        choose_format("fp8", device_kind="cpu", checkpoint_dtype=None, cpu_features=ZEN4)
    assert exc.value.kind == "unknown_dtype"
    with pytest.raises(FormatRefused) as exc:
        choose_format("int8", device_kind="cuda", checkpoint_dtype=None, cpu_features=frozenset())
    assert exc.value.kind == "int8_needs_cpu"


def test_native_16bit_lists_bfloat16_first():
    assert native_16bit(SAPPHIRE) == ("bfloat16", "float16")
    assert native_16bit(OLD_X86) == ()


def test_a_q8_0_file_on_a_bf16_cpu_serves_weight_only_int8():
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype=None, cpu_features=ZEN4, quantized="Q8_0")
    assert (got.compute, got.weights) == ("bfloat16", "int8")
    assert "Q8_0" in got.reason and "avx512_bf16" in got.reason


@pytest.mark.parametrize("quantized", ["Q4_K", "Q4_K+Q6_K", "Q8_0+Q4_0", "MXFP4"])
def test_another_quantized_file_on_a_bf16_cpu_serves_bfloat16(quantized):
    # int8 would read more bytes than 4-6 bit experts (they stay decoded per slot, in bfloat16).
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype=None, cpu_features=ZEN4,
                        quantized=quantized)
    assert (got.compute, got.weights) == ("bfloat16", "bfloat16")


@pytest.mark.parametrize("quantized", ["Q8_0", "Q4_K"])
def test_a_quantized_file_without_bf16_arithmetic_serves_float32(quantized):
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype=None, cpu_features=OLD_X86,
                        quantized=quantized)
    assert (got.compute, got.weights) == ("float32", "float32")


def test_a_quantized_file_on_cuda_serves_bfloat16_and_an_explicit_dtype_wins():
    assert choose_format("auto", device_kind="cuda", checkpoint_dtype=None, cpu_features=frozenset(),
                         quantized="Q8_0").weights == "bfloat16"
    assert choose_format("float32", device_kind="cpu", checkpoint_dtype=None, cpu_features=ZEN4,
                         quantized="Q8_0").weights == "float32"


# --- int8 products: the int8 kernel for a few rows, the widened weight for many -----------------

ATTENTION = 576 * 576  # the demo's q/o projections
EXPERT = 128 * 576  # one 64-neuron expert's gate and up projections


def test_a_decode_steps_rows_keep_the_int8_kernel():
    assert not any(widens_int8_product(rows, ATTENTION) for rows in range(1, 9))


def test_a_prefills_rows_widen_the_weight():
    assert widens_int8_product(27, ATTENTION)
    assert widens_int8_product(4096, EXPERT)


def test_a_small_weight_needs_more_rows_to_widen():
    assert widens_int8_product(27, ATTENTION) and not widens_int8_product(27, EXPERT)


@given(st.integers(1, 4096), st.integers(1, 1 << 26))
def test_more_rows_never_turn_a_widened_product_back(rows, weights):
    if widens_int8_product(rows, weights):
        assert widens_int8_product(rows + 1, weights)


def test_a_widened_products_rows_pad_to_a_power_of_two():
    assert [widened_rows(r) for r in (1, 16, 17, 27, 64, 1000)] == [1, 16, 32, 32, 64, 1024]


def test_past_the_step_widened_rows_pad_to_a_multiple_of_it():
    assert widened_rows(1025) == 2048 and widened_rows(3000) == 3072


@given(st.integers(1, 100_000))
def test_widened_rows_cover_the_rows_and_at_most_double_them(rows):
    assert rows <= widened_rows(rows) <= 2 * rows


def test_float16_of_bfloat16_values_on_a_bf16_cpu_serves_bfloat16_exactly():
    got = choose_format("auto", device_kind="cpu", checkpoint_dtype="float16", cpu_features=ZEN4,
                        float16_is_bfloat16=True)
    assert (got.compute, got.weights) == ("bfloat16", "bfloat16")
    assert "avx512_bf16" in got.reason and "exact" in got.reason


def test_float16_of_bfloat16_values_keeps_float16_where_the_cpu_computes_it():
    assert choose_format("auto", device_kind="cpu", checkpoint_dtype="float16", cpu_features=SAPPHIRE,
                         float16_is_bfloat16=True).compute == "float16"


def test_float16_of_bfloat16_values_without_bf16_arithmetic_widens_to_float32():
    assert choose_format("auto", device_kind="cpu", checkpoint_dtype="float16", cpu_features=OLD_X86,
                         float16_is_bfloat16=True).compute == "float32"


def test_the_float16_values_are_measured_only_where_the_rule_asks():
    def asks(requested="auto", device_kind="cpu", named="float16", features=ZEN4, quantized=None):
        return measures_float16_values(requested, device_kind=device_kind, checkpoint_dtype=named,
                                       cpu_features=features, quantized=quantized)

    assert asks()
    assert not asks(requested="float32")
    assert not asks(device_kind="cuda")
    assert not asks(named="bfloat16")
    assert not asks(features=SAPPHIRE)
    assert not asks(features=OLD_X86)
    assert not asks(quantized="Q8_0")
