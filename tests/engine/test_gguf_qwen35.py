"""Qwen3.5/3.6-MoE GGUF files (llama.cpp's ``qwen35moe``: Gated DeltaNet + attention) served with their
experts kept in their blocks: token identity with transformers (on the Hugging Face checkpoint the
file was written from, and on transformers' own load of the file, which undoes the converter's
transforms with its own code), the file laid out as llama.cpp's converter lays it out, the hybrid
continuous-batching path over the loaded model, and the ``moetray models`` row."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from moetray.engine.experts import offload_loaded
from moetray.engine.models.gguf import load_gguf, read_gguf
from moetray.engine.models.gguf_export import export_gguf
from tests.tiny_moe import make_tiny_moe

pytestmark = pytest.mark.engine

# Rows of 256 so Q8_0 and Q4_K blocks divide them; four layers: three Gated DeltaNet, one attention.
GEOMETRY = dict(hidden=256, expert_inter=256, num_experts=8, top_k=2, num_layers=4)
PROMPT = torch.tensor([[5, 17, 33, 99, 120, 7, 42, 250]])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # The multimodal layout real Qwen3.5/3.6-MoE checkpoints ship; the file holds the text model.
    return make_tiny_moe(tmp_path_factory.mktemp("q35-src") / "src", "qwen3_5_moe", **GEOMETRY)


@pytest.fixture(scope="module")
def source_model(source):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def files(source, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q35-gguf")
    return {q: export_gguf(source, root / f"tiny-{q}.gguf", q)[0] for q in ("F32", "F16", "Q8_0", "Q4_K")}


def _greedy(model, tokens: int = 10) -> list[int]:
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0].tolist()


def _offloaded(path: Path, capacity_fraction: float = 1.0):
    ck = read_gguf(path)
    model, store, modules = load_gguf(ck, device=torch.device("cpu"), dtype=torch.float32)
    total = store.num_layers * store.num_experts
    om = offload_loaded(
        model, store, modules, device=torch.device("cpu"), capacity=max(1, round(capacity_fraction * total))
    )
    return ck, om


def _transformers_load(path: Path):
    """transformers' own load of the file (its qwen35moe config and weight mapping, every tensor
    dequantized)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_qwen35moe_gguf_is_token_identical_at_full_and_quarter_capacity(files, source_model, qtype):
    path = files[qtype]
    ck, om = _offloaded(path)
    assert ck.arch == "qwen35moe" and ck.config.model_type == "qwen3_5_moe_text"
    assert ck.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    want = _greedy(_transformers_load(path))
    if qtype != "Q4_K":  # Q4_K is lossy enough to move a token off the source's
        assert want == _greedy(source_model), "transformers' load of the file vs its source"
    assert _greedy(om.model) == want, "100 % capacity"
    om.runtime.resize(max(1, om.store.num_layers * om.store.num_experts // 4))
    om.runtime.reset_window()
    assert _greedy(om.model) == want, "25 % capacity"
    snap = om.runtime.snapshot()
    assert snap["total_misses"] > 0 and snap["expert_store_format"] == qtype
    stored = sum(om.store.link_bytes(layer) for layer in range(om.store.num_layers)) * om.store.num_experts
    assert om.store.total_bytes == stored  # the experts as the file holds them, and only so
    om.runtime.check_integrity(deep=True)


def test_the_file_holds_the_converters_transforms(files, source_model):
    """What llama.cpp's converter writes, checked on the F32 file against the source's values (the
    value heads tiled: with 2 key heads of 2 value heads each, grouped v0k0 v1k0 v0k1 v1k1 is stored
    as v0k0 v0k1 v1k0 v1k1, i.e. head order 0 2 1 3)."""
    from gguf import GGUFReader

    stored = {t.name: np.array(t.data) for t in GGUFReader(files["F32"]).tensors}
    src = {k: v.numpy() for k, v in source_model.state_dict().items()}
    attn = "model.layers.0.linear_attn"
    heads = [0, 2, 1, 3]
    assert np.allclose(stored["blk.0.ssm_a"], -np.exp(src[f"{attn}.A_log"][heads]))
    assert np.array_equal(stored["blk.0.ssm_dt.bias"], src[f"{attn}.dt_bias"][heads])
    assert np.allclose(stored["blk.0.attn_norm.weight"], src["model.layers.0.input_layernorm.weight"] + 1)
    assert np.array_equal(stored["blk.0.ssm_norm.weight"], src[f"{attn}.norm.weight"])  # no offset
    conv = src[f"{attn}.conv1d.weight"][:, 0]  # [C, 1, K] squeezed
    qk = 2 * 2 * 16  # q and k channels stay in place; the value channels move by head (16 each)
    rows = np.concatenate([np.arange(qk)] + [qk + 16 * h + np.arange(16) for h in heads])
    assert np.array_equal(stored["blk.0.ssm_conv1d.weight"], conv[rows])
    cols = np.concatenate([16 * h + np.arange(16) for h in heads])
    assert np.array_equal(stored["blk.0.ssm_out.weight"], src[f"{attn}.out_proj.weight"][:, cols])
    assert stored["blk.0.ffn_gate_inp_shexp.weight"].shape == (256,)


def test_the_hybrid_batching_path_serves_the_file_at_a_quarter_capacity(files):
    """Continuous batching with the state pool over the GGUF-loaded model, a quarter of its experts
    resident, four requests at once: each equals transformers' generate on its own load of the file."""
    from tests.engine.test_cb_runner import greedy_reference
    from tests.engine.test_hybrid_cb import run_greedy, runner_for

    _, om = _offloaded(files["Q8_0"], 0.25)
    reference_model = _transformers_load(files["Q8_0"])
    prompts = [[5 + i, 17, 33, 99, 120, 7, 42, 250, 3 * i + 11] for i in range(4)]
    runner = runner_for(om.model)
    try:
        finals = asyncio.run(run_greedy(runner, {f"q{i}": (p, 8) for i, p in enumerate(prompts)}))
        runner.check_integrity()
    finally:
        runner.stop()
    assert om.runtime.cache.stats().misses > om.runtime.capacity
    assert [finals[f"q{i}"].generated_tokens for i in range(4)] == [
        greedy_reference(reference_model, p, 8) for p in prompts
    ]


def test_the_models_row_is_servable_with_family_qwen35moe(files, tmp_path):
    from moetray.engine.models.checkpoint import inspect_checkpoint
    from moetray.engine.models.discovery import list_models

    rows = {row["name"]: row for row in list_models({"HOME": str(tmp_path)}, recent=[files["Q8_0"]])}
    row = rows[str(files["Q8_0"])]
    assert (row["format"], row["family"], row["moe"], row["servable"], row["refusal"]) == (
        "gguf", "qwen35moe", True, True, None)
    info = inspect_checkpoint(files["Q8_0"])
    assert info.architecture == "Qwen3_5MoeForCausalLM" and info.num_experts == 8 and info.moe_layers == 4


def _with_mtp_block(path: Path, dest: Path) -> Path:
    """``path`` rewritten as the converter writes a checkpoint with a multi-token-prediction block:
    one more block (``blk.4``, the last layer's tensors again plus the ``nextn`` projection and
    norms) counted in ``block_count``, and ``nextn_predict_layers`` saying it is MTP."""
    import gguf

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(dest, "qwen35moe")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "qwen35moe.block_count":
            value += 1
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    writer.add_nextn_predict_layers(1)
    hidden = 256
    extra = {
        "blk.4.nextn.eh_proj.weight": np.full((hidden, 2 * hidden), 0.01, np.float32),
        **{f"blk.4.nextn.{norm}.weight": np.ones(hidden, np.float32)
           for norm in ("enorm", "hnorm", "shared_head_norm")},
    }
    for t in reader.tensors:
        data = np.array(t.data)
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        if t.name.startswith("blk.3."):
            extra[t.name.replace("blk.3.", "blk.4.", 1)] = data
    for name, data in extra.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def test_a_files_multi_token_prediction_block_is_left_unloaded(files, tmp_path):
    """Real Qwen3.5/3.6 files carry an MTP block as their last ``blk.N``; the decoder is the blocks
    before it (transformers' model has no MTP module), and its experts stay out of the store."""
    path = _with_mtp_block(files["F32"], tmp_path / "mtp.gguf")
    ck, om = _offloaded(path)
    assert ck.metadata["qwen35moe.block_count"] == 5 and ck.config.num_hidden_layers == 4
    assert om.store.num_layers == 4
    without = _greedy(_offloaded(files["F32"])[1].model)
    assert _greedy(om.model) == _greedy(_transformers_load(path)) == without


def test_the_tokenizer_and_chat_template_come_from_the_metadata(files, source):
    from transformers import AutoTokenizer

    from moetray.engine.models.gguf import load_gguf_tokenizer

    ours, theirs = load_gguf_tokenizer(read_gguf(files["Q8_0"])), AutoTokenizer.from_pretrained(source)
    text = "Gated DeltaNet layers keep a state; experts stay in their blocks."
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False
    )
