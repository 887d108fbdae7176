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
    return {q: export_gguf(source, root / f"tiny-{q}.gguf", q)[0] for q in ("F32", "F16", "BF16", "Q8_0")}


@pytest.mark.parametrize(("qtype", "named"), [("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
                                              ("Q8_0", None)])
def test_a_file_of_plain_floats_names_its_dtype_and_a_quantized_one_none(files, qtype, named):
    """The routers stay F32 in every file (as llama.cpp's converter writes them), so they do not make a
    16-bit file mixed; quantized values have no exact 16-bit form. Prevents: a BF16 file served in
    float32 (twice the memory) for want of a config naming its dtype."""
    assert loader.inspect_checkpoint(files[qtype]).gguf.float_dtype == named


@pytest.mark.parametrize("qtype", ["BF16", "F16", "Q8_0"])
def test_auto_serves_a_gguf_in_its_own_16_bit_dtype_where_the_cpu_computes_it(files, qtype):
    info = loader.inspect_checkpoint(files[qtype])
    fmt = loader.serving_format("auto", info, torch.device("cpu"))
    named = info.gguf.float_dtype
    expected = named if named in native_16bit(cpu_features()) else "float32"
    assert (fmt.weights, fmt.compute) == (expected, expected)
