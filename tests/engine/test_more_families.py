"""The next MoE families, end to end through the offloading runtime: token identity, or a refusal.

Each family below is built by transformers 5.24 with its experts behind the experts interface,
and each tests something the first four (tests/engine/test_expert_identity.py) do not:

- granitemoe / granitemoeshared: ``save_pretrained`` writes the legacy fused names
  (``block_sparse_moe.input_linear.weight`` → ``experts.gate_up_proj``), renamed by
  transformers' rules; embedding/residual/logit multipliers; a shared MLP beside the experts.
- gpt_oss: biased, transposed experts with interleaved gate/up and a clamped custom gate;
  a router bias; attention sinks and sliding-window layers.
- phimoe: Mixtral's legacy per-expert names plus a renamed router (``gate`` → ``router``).
- deepseek_v2 (V2-Lite's shape), deepseek_v3, glm4_moe: shared experts, a dense first layer
  (MoE layer 0 is decoder layer 1), grouped routing with a score-correction bias (v3, glm4).

The tiny checkpoints give every constant-initialised tensor (biases at 0, norms at 1) random
values, so a bias the loader dropped or misplaced changes the logits.

(DeepSeek-V2/V3 run exactly here, under ``generate``; ``moetray serve`` refuses them because
transformers' continuous batching cannot page their latent attention cache: see
tests/api/test_more_families_api.py.)

Refused, never served wrong: a family whose experts transformers computes in its own forward
(JetMoE), and any quantized checkpoint (gpt-oss's MXFP4, DeepSeek-V3's FP8 with block scales).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from expert_helpers import (  # noqa: F401 (autouse fixtures)
    assert_identical,
    isolated_profile_dir,
    one_torch_thread,
)
from safetensors import safe_open
from safetensors.torch import save_file

from moetray.engine.experts import LoaderError, load_offloaded_model
from moetray.engine.models.checkpoint import CheckpointError, inspect_checkpoint

BOTH = ("per_expert", "fused")
# family → (layouts, tiny config). gpt-oss's save_pretrained writes the fused stacks, so its
# "per_expert" folder would be the same files. DeepSeek-style models get a dense first layer.
FAMILIES = {
    "granitemoe": (BOTH, {}),
    "gpt_oss": (("fused",), {}),
    "deepseek_v2": (BOTH, {"num_layers": 3, "dense_layers": 1}),
    "granitemoeshared": (BOTH, {}),
    "phimoe": (BOTH, {}),
    "glm4_moe": (BOTH, {"num_layers": 3, "dense_layers": 1}),
    "deepseek_v3": (BOTH, {"num_layers": 3, "dense_layers": 1}),
}
CASES = [(family, layout) for family, (layouts, _) in FAMILIES.items() for layout in layouts]
MOE_LAYERS, EXPERTS = 2, 8
CAPACITIES = {"floor": 1, "full": MOE_LAYERS * EXPERTS}


def checkpoint_of(tiny_moe, family: str, layout: str):
    return tiny_moe(family, layout, **FAMILIES[family][1])


@pytest.mark.parametrize("capacity", list(CAPACITIES))
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_offloaded_equals_resident(tiny_moe, family, layout, capacity):
    """The offloaded model decodes the stock resident model's greedy tokens with bit-identical
    fp32 logits, at the one-slot floor (the pool churning: far more misses than experts) and
    with every expert resident (each fetched once). Prevents: a family's renamed or legacy
    expert tensors packed wrong (gate/up swapped, interleaving lost, biases dropped), a custom
    gate bypassed, a dense layer miscounted as a MoE layer, a stale slot served."""
    checkpoint = checkpoint_of(tiny_moe, family, layout)
    om = load_offloaded_model(checkpoint, capacity=CAPACITIES[capacity])
    assert (om.runtime.num_layers, om.runtime.num_experts) == (MOE_LAYERS, EXPERTS)
    assert inspect_checkpoint(checkpoint).moe_layers == om.runtime.num_layers  # the engine's count agrees
    assert_identical(checkpoint, om.model)
    om.runtime.check_integrity(deep=True)
    stats = om.runtime.cache.stats()
    assert stats.calls == om.runtime.calls > 0
    if capacity == "floor":
        assert stats.misses > EXPERTS  # the one slot really was refilled over and over
    else:
        assert 0 < stats.misses <= CAPACITIES["full"]  # each routed expert fetched once, never evicted


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eager_compute_equals_stock_eager_at_the_floor(tiny_moe, family):
    """The eager compute mode takes the general per-expert path for biased, transposed or
    custom-gated experts; it must equal the stock ``eager`` implementation bit for bit.
    Prevents: the general path applying bias, transpose or gate differently from the stock loop."""
    layout = FAMILIES[family][0][0]
    checkpoint = checkpoint_of(tiny_moe, family, layout)
    om = load_offloaded_model(checkpoint, capacity=CAPACITIES["floor"], compute="eager")
    assert_identical(checkpoint, om.model, "eager")
    om.runtime.check_integrity(deep=True)


@pytest.mark.parametrize("family", [f for f, (layouts, _) in FAMILIES.items() if "per_expert" in layouts])
def test_save_pretrained_layout_differs_from_the_fused_stacks(tiny_moe, family):
    """The per_expert folders are really in another layout than the model's fused parameters
    (so the identity test above covers the renaming/merging path). Prevents: a family silently
    tested in one layout twice."""
    checkpoint = checkpoint_of(tiny_moe, family, "per_expert")
    with safe_open(str(next(checkpoint.glob("*.safetensors"))), framework="pt") as fh:
        keys = list(fh.keys())
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)


def test_a_family_outside_the_experts_interface_is_refused(tiny_moe):
    """JetMoE computes its experts (and attention experts) in its own forward: the runtime would
    never be called and the model would run without expert weights. It is refused by kind before
    any weight is read. Prevents: an unsupported family served with garbage experts."""
    checkpoint = tiny_moe("jetmoe", "per_expert")
    assert inspect_checkpoint(checkpoint).num_experts == EXPERTS  # it is a MoE checkpoint
    with pytest.raises(LoaderError) as refused:
        load_offloaded_model(checkpoint, capacity=4)
    assert refused.value.kind == "unsupported_family"
    assert refused.value.model_type == "jetmoe"


def _fp8_copy(src, dest):
    """``src`` rewritten as DeepSeek-V3 ships: FP8 (e4m3) linear weights with per-block
    ``weight_scale_inv`` tensors and a ``quantization_config`` naming the method."""
    shutil.copytree(src, dest)
    for shard in dest.glob("*.safetensors"):
        tensors = {}
        with safe_open(str(shard), framework="pt") as fh:
            for key in fh.keys():
                tensor = fh.get_tensor(key)
                if key.endswith("proj.weight") and tensor.dim() == 2:
                    tensors[key] = tensor.to(torch.float8_e4m3fn)
                    tensors[key[: -len("weight")] + "weight_scale_inv"] = torch.ones(1, 1)
                else:
                    tensors[key] = tensor
        save_file(tensors, str(shard), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_quantized_checkpoint_is_refused_before_loading(tiny_moe, tmp_path):
    """An AWQ checkpoint would load without complaint (the store casts its packed bytes to floats,
    its scales have no place in the model) and compute garbage. The loader and the engine's
    inspection refuse it by kind (MXFP4 and fine-grained FP8 are served: test_quantized_hf.py).
    Prevents: silently wrong output from weights quantized for another kernel."""
    checkpoint = _fp8_copy(checkpoint_of(tiny_moe, "deepseek_v3", "per_expert"), tmp_path / "awq")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoaderError) as refused:
        load_offloaded_model(checkpoint, capacity=4)
    assert refused.value.kind == "quantized_checkpoint" and refused.value.quant_method == "awq"
    with pytest.raises(CheckpointError) as refused_early:
        inspect_checkpoint(checkpoint)
    assert refused_early.value.kind == "quantized_checkpoint"
