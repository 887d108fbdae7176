"""A GGUF file's own dtype: what its matrices' type names, read from the headers, and the format
``--dtype auto`` serves it in (the rule a config folder's ``dtype`` follows)."""

from __future__ import annotations

import pytest
import torch

from moetray.engine.models import checkpoint as loader
from moetray.engine.models.gguf_export import export_gguf
from moetray.engine.models.precision import cpu_features
from moetray.policy.precision import native_16bit
from tests.tiny_moe import make_tiny_moe


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-dtype")
    source = make_tiny_moe(root / "src", "qwen3_moe", hidden=256, expert_inter=256, num_experts=8, top_k=2)
    files = {q: export_gguf(source, root / f"tiny-{q}.gguf", q)[0]
             for q in ("F32", "F16", "BF16", "Q8_0", "Q4_K")}
    # A 4-bit file with some matrices wider (Q4_K_M puts some in Q6_K, which gguf-py cannot write).
    files["mixed"] = export_gguf(source, root / "tiny-mixed.gguf",
                                 lambda name: "Q8_0" if name.endswith("ffn_down_exps.weight") else "Q4_K")[0]
    return files


@pytest.mark.parametrize(("qtype", "named"), [("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
                                              ("Q8_0", None)])
def test_a_file_of_plain_floats_names_its_dtype_and_a_quantized_one_none(files, qtype, named):
    """The routers stay F32 in every file (as llama.cpp's converter writes them), so they do not make a
    16-bit file mixed; quantized values have no exact 16-bit form. Prevents: a BF16 file served in
    float32 (twice the memory) for want of a config naming its dtype."""
    assert loader.inspect_checkpoint(files[qtype]).gguf.float_dtype == named


@pytest.mark.parametrize(("qtype", "types"), [("F32", None), ("BF16", None), ("Q8_0", "Q8_0"),
                                              ("Q4_K", "Q4_K"), ("mixed", "Q4_K+Q8_0")])
def test_a_quantized_file_names_its_block_types(files, qtype, types):
    assert loader.inspect_checkpoint(files[qtype]).gguf.quantization == types


@pytest.mark.parametrize("qtype", ["BF16", "F16"])
def test_auto_serves_a_gguf_in_its_own_16_bit_dtype_where_the_cpu_computes_it(files, qtype):
    info = loader.inspect_checkpoint(files[qtype])
    fmt = loader.serving_format("auto", info, torch.device("cpu"))
    named = info.gguf.float_dtype
    expected = named if named in native_16bit(cpu_features()) else "float32"
    assert (fmt.weights, fmt.compute) == (expected, expected)


@pytest.mark.parametrize(("qtype", "weights"),
                         [("Q8_0", "int8"), ("Q4_K", "bfloat16"), ("mixed", "bfloat16")])
def test_auto_serves_a_quantized_gguf_in_few_bytes_where_the_cpu_computes_bfloat16(files, qtype, weights):
    """The checkpoint's block types reach the rule (``serving_format`` → ``choose_format``'s
    ``quantized``). Prevents: a Q8_0 or Q4_K file decoded to float32 (4 bytes a weight) on a CPU with
    bfloat16 arithmetic."""
    fmt = loader.serving_format("auto", loader.inspect_checkpoint(files[qtype]), torch.device("cpu"))
    bf16 = "bfloat16" in native_16bit(cpu_features())
    assert (fmt.weights, fmt.compute) == ((weights, "bfloat16") if bf16 else ("float32", "float32"))


def _as_float16_of_bfloat16_values(folder):
    """Rewrite a checkpoint folder's weights as float16 holding bfloat16 values (as a converter writes
    a model trained in bfloat16 to an F16 file), its config naming float16."""
    import json

    from safetensors.torch import load_file, save_file

    for shard in folder.glob("*.safetensors"):
        state = {k: v.to(torch.bfloat16).to(torch.float16) if v.is_floating_point() else v
                 for k, v in load_file(str(shard)).items()}
        save_file(state, str(shard), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "float16"
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def bfloat16_valued(tmp_path_factory):
    root = tmp_path_factory.mktemp("f16-of-bf16")
    folder = _as_float16_of_bfloat16_values(
        make_tiny_moe(root / "src", "qwen3_moe", hidden=256, expert_inter=256, num_experts=8, top_k=2))
    return {"folder": folder, "F16": export_gguf(folder, root / "tiny-F16.gguf", "F16")[0]}


def _float16_of_bfloat16_values_served_as() -> str:
    native = native_16bit(cpu_features())
    return "float16" if "float16" in native else "bfloat16" if "bfloat16" in native else "float32"


@pytest.mark.parametrize("kind", ["F16", "folder"])
def test_float16_of_bfloat16_values_serves_bfloat16_where_float16_is_not_computed(bfloat16_valued, kind):
    """The checkpoint's float16 values are read (a GGUF file's from its memory map, a folder's from its
    safetensors) and found to be bfloat16 values, so a CPU that computes bfloat16 and not float16 serves
    them in bfloat16, exactly, at two bytes a weight. Prevents: an F16 file of a model trained in
    bfloat16 decoded in float32 (measured 0.15× llama.cpp's tok/s on the same file)."""
    fmt = loader.serving_format("auto", loader.inspect_checkpoint(bfloat16_valued[kind]), torch.device("cpu"))
    expected = _float16_of_bfloat16_values_served_as()
    assert (fmt.weights, fmt.compute) == (expected, expected)
    if expected == "bfloat16":
        assert "every value of it is a bfloat16 value" in fmt.reason


def test_float16_values_that_are_not_bfloat16_values_are_not_rounded(files):
    """The random source's float16 values have more significant bits than bfloat16 keeps: measured,
    they are served in float32 (or float16 where the CPU computes it), never rounded to bfloat16."""
    fmt = loader.serving_format("auto", loader.inspect_checkpoint(files["F16"]), torch.device("cpu"))
    assert fmt.weights in ("float32", "float16")
    assert "bfloat16 value" not in fmt.reason
