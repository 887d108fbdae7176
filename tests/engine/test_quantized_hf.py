"""Hugging Face checkpoints with quantized experts: fine-grained FP8 (Qwen3-…-FP8's layout) and MXFP4
(gpt-oss's) load with their experts quantized in the store and decode on fill, token-identical to
transformers' own load of the same folder (which dequantizes everything on a CPU); GPTQ, AWQ and
bitsandbytes stay refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetray.engine.experts import LoaderError, load_offloaded_model
from moetray.engine.models.checkpoint import CheckpointError, inspect_checkpoint

pytestmark = pytest.mark.engine
PROMPT = torch.tensor([[5, 17, 33, 99, 120, 7, 42, 250]])
FP4 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def _rewrite(src: Path, dest: Path, convert, quantization_config: dict) -> Path:
    shutil.copytree(src, dest)
    for shard in dest.glob("*.safetensors"):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), framework="pt") as fh:
            for key in fh.keys():
                tensors.update(convert(key, fh.get_tensor(key)))
        save_file(tensors, str(shard), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _fp8(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every projection weight as FP8 e4m3 with one float32 scale per 128×128 tile."""
    if not (key.endswith("proj.weight") and tensor.dim() == 2):
        return {key: tensor}
    rows, cols = tensor.shape
    tiles = tensor.reshape(-1, 128, cols // 128, 128).abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    scaled = tensor / tiles.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return {key: scaled.to(torch.float8_e4m3fn), key[: -len("weight")] + "weight_scale_inv": tiles.float()}


def _mxfp4(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss's expert stacks as blocks + E8M0 scales over the stored [E, out, in] layout."""
    if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return {key: tensor}
    stored = tensor.transpose(1, 2).float().numpy()  # the module holds [E, in, out]
    e, rows, cols = stored.shape
    groups = stored.reshape(e, rows, cols // 32, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).clip(-127, 127)
    scaled = groups / np.exp2(exp)
    nibble = np.abs(scaled[..., None] - FP4).argmin(axis=-1).astype(np.uint8)
    blocks = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    scales = np.ascontiguousarray((exp[..., 0] + 127).astype(np.uint8))
    return {
        key + "_blocks": torch.from_numpy(np.ascontiguousarray(blocks)),
        key + "_scales": torch.from_numpy(scales),
    }


def _reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _greedy(model, tokens: int = 10) -> list[int]:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)[
            0
        ].tolist()


def _identical_at_full_and_quarter(folder: Path, expected_format: str):
    om = load_offloaded_model(folder, capacity=1)
    total = om.store.num_layers * om.store.num_experts
    om.runtime.resize(total)
    want = _greedy(_reference(folder))
    assert _greedy(om.model) == want
    om.runtime.resize(max(1, total // 4))
    assert _greedy(om.model) == want
    assert om.store.quantized and om.store.format.startswith(expected_format)
    assert om.runtime.snapshot()["total_misses"] > 0
    om.runtime.check_integrity(deep=True)
    return om


def test_fine_grained_fp8_experts_stay_fp8_in_the_store(tiny_moe, tmp_path):
    src = tiny_moe("qwen3_moe", "per_expert", hidden=256, expert_inter=256)
    folder = _rewrite(
        src,
        tmp_path / "fp8",
        _fp8,
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    om = _identical_at_full_and_quarter(folder, "FP8")
    per_expert = 3 * 256 * 256 + 3 * 4 * 4  # FP8 bytes + float32 scales (2×2 tiles per projection)
    assert om.store.link_bytes(0) == per_expert and om.store.slot_bytes == 3 * 256 * 256 * 4


def test_gpt_oss_mxfp4_experts_stay_mxfp4_in_the_store(tiny_moe, tmp_path):
    src = tiny_moe("gpt_oss", "fused")
    folder = _rewrite(src, tmp_path / "mxfp4", _mxfp4, {"quant_method": "mxfp4"})
    om = _identical_at_full_and_quarter(folder, "MXFP4")
    assert om.store.total_bytes < om.store.num_layers * om.store.num_experts * om.store.slot_bytes / 4


def test_gptq_stays_refused_by_name(tiny_moe, tmp_path):
    src = tiny_moe("qwen3_moe", "per_expert")
    folder = _rewrite(src, tmp_path / "gptq", lambda k, t: {k: t}, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(LoaderError) as refused:
        load_offloaded_model(folder, capacity=4)
    assert refused.value.kind == "quantized_checkpoint" and refused.value.quant_method == "gptq"
    with pytest.raises(CheckpointError) as early:
        inspect_checkpoint(folder)
    assert early.value.kind == "quantized_checkpoint"
