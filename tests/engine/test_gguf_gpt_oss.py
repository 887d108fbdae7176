"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture) served with their experts kept in
their blocks: token identity with transformers, the expert biases in the store beside the blocks,
the attention sinks, router bias, sliding-window alternation and YaRN rope read from the file.

transformers 5.24 cannot load a gpt-oss GGUF itself (its legacy config reader fails on the
``rope.scaling.*`` keys llama.cpp writes), so the reference is transformers' model of the Hugging
Face checkpoint the file was written from, holding the weights as the file holds them: the source
as it is for F32 files, and for quantized files every tensor dequantized by gguf-py (the
reference's own reading of the file, checked against the source on the F32 file)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moetray.engine.experts import offload_loaded
from moetray.engine.experts.codecs import ggml_nbytes
from moetray.engine.models.checkpoint import CheckpointError
from moetray.engine.models.gguf import load_gguf, load_gguf_tokenizer, read_gguf
from moetray.engine.models.gguf_export import export_gguf
from tests.tiny_moe import make_tiny_moe

pytestmark = pytest.mark.engine

# Rows of 256 so every block type divides them; a sliding window shorter than prompt + output.
GEOMETRY = dict(hidden=256, expert_inter=256, num_experts=8, top_k=2)
PROMPT = torch.tensor([[5, 17, 33, 99, 120, 7, 42, 250]])
TYPES = {
    "F32": "F32",
    "F16": "F16",
    "Q8_0": "Q8_0",
    # What llama.cpp ships gpt-oss as: MXFP4 experts, the rest F16.
    "MXFP4": lambda name: "MXFP4" if "_exps.weight" in name else "F16",
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("gpt-oss-src") / "src", "gpt_oss", **GEOMETRY)


def _greedy(model, tokens: int = 10) -> list[int]:
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0].tolist()


def _source_model(source: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"attn_{g}.{p}": f"self_attn.{h}_proj.{p}" for g, h in
       (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for p in ("weight", "bias")},
}


def _reference_from_file(source: Path, path: Path):
    """The source model holding gguf-py's dequantization of every tensor of ``path``, put back in
    transformers' layout (experts transposed back, gate and up interleaved again)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model = _source_model(source)
    state = model.state_dict()
    filled = set()

    def put(key: str, values: np.ndarray, at=slice(None)) -> None:
        state[key][at] = torch.from_numpy(np.ascontiguousarray(values)).reshape(state[key][at].shape)
        filled.add(key)

    for t in GGUFReader(path).tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        if t.name in top:
            put(top[t.name], values)
            continue
        block, rest = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name).groups()
        prefix = f"model.layers.{block}."
        experts = prefix + "mlp.experts."
        m = re.fullmatch(r"ffn_(gate|up|down)_exps\.(weight|bias)", rest)
        if m is None:
            put(prefix + _LAYER_NAMES[rest], values)
        elif m[1] == "down":
            put(experts + ("down_proj" if m[2] == "weight" else "down_proj_bias"),
                values.transpose(0, 2, 1) if m[2] == "weight" else values)
        else:
            cut = slice(0, None, 2) if m[1] == "gate" else slice(1, None, 2)
            if m[2] == "weight":
                put(experts + "gate_up_proj", values.transpose(0, 2, 1), (slice(None), slice(None), cut))
            else:
                put(experts + "gate_up_proj_bias", values, (slice(None), cut))
    assert filled == set(state), f"the file left {set(state) - filled} unset"
    model.load_state_dict(state)
    return model


def _offloaded(path: Path, capacity_fraction: float = 1.0, **kw):
    ck = read_gguf(path)
    model, store, modules = load_gguf(ck, device=torch.device("cpu"), dtype=torch.float32)
    total = store.num_layers * store.num_experts
    om = offload_loaded(model, store, modules, device=torch.device("cpu"),
                        capacity=max(1, round(capacity_fraction * total)), **kw)
    return ck, om


def test_the_config_is_the_source_models_own(source, tmp_path):
    from transformers import AutoConfig

    ck = read_gguf(export_gguf(source, tmp_path / "f32.gguf", "F32")[0])
    want = AutoConfig.from_pretrained(source)
    assert ck.arch == "gpt-oss" and ck.config.architectures == ["GptOssForCausalLM"]
    for field in ("sliding_window", "layer_types", "rope_parameters", "head_dim", "attention_bias",
                  "num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size",
                  "num_attention_heads", "num_key_value_heads", "swiglu_alpha", "swiglu_limit",
                  "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ck.config, field) == pytest.approx(getattr(want, field)), field
    assert want.rope_parameters["rope_type"] == "yarn" and set(want.layer_types) == {
        "sliding_attention", "full_attention"}
    # The reference's own reading of the file is the source model itself for F32.
    ours, theirs = _reference_from_file(source, ck.path).state_dict(), _source_model(source).state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_gpt_oss_gguf_is_token_identical_to_transformers(source, tmp_path, qtype):
    path = export_gguf(source, tmp_path / f"gpt-oss-{qtype}.gguf", TYPES[qtype])[0]
    reference = _source_model(source) if qtype == "F32" else _reference_from_file(source, path)
    want = _greedy(reference)
    ck, om = _offloaded(path)
    assert _greedy(om.model) == want, "100 % capacity"
    om.runtime.resize(max(1, om.store.num_layers * om.store.num_experts // 4))
    om.runtime.reset_window()
    assert _greedy(om.model) == want, "25 % capacity"
    assert om.runtime.snapshot()["total_misses"] > 0
    om.runtime.check_integrity(deep=True)
    # The experts stay as the file stores them, biases (F32, as the converter writes them) included.
    assert om.store.format == ("F32" if qtype == "F32" else f"{qtype}+F32")
    expert_bytes = sum(ggml_nbytes(t.ggml_type, int(np.prod(t.shape)))
                       for t in ck.tensors.values() if "_exps." in t.name)
    assert om.store.total_bytes == expert_bytes


def test_the_cpu_path_computes_gpt_oss_experts_from_their_blocks(source, tmp_path):
    path = export_gguf(source, tmp_path / "q8.gguf", "Q8_0")[0]
    ck, om = _offloaded(path, 0.25, cpu_layers="1")
    assert _greedy(om.model) == _greedy(_reference_from_file(source, path))
    assert om.runtime._bank_mats == {}  # noqa: SLF001 - nothing decoded was kept


def test_tokenizer_and_chat_template_come_from_the_metadata(source, tmp_path):
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(read_gguf(export_gguf(source, tmp_path / "tok.gguf", "Q8_0")[0]))
    theirs = AutoTokenizer.from_pretrained(source)
    text = "Hello! Mixture of experts models route each token."
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False)


def test_models_lists_a_gpt_oss_file_as_servable(source, tmp_path):
    from moetray.engine.models.discovery import describe_gguf

    path = export_gguf(source, tmp_path / "listed.gguf", TYPES["MXFP4"])[0]
    row = describe_gguf("listed", "recent", path)
    assert (row["family"], row["moe"], row["servable"], row["refusal"]) == ("gpt-oss", True, True, None)


def test_fused_gate_up_experts_are_refused_by_name(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "fused.gguf", "gpt-oss")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    writer.add_tensor("blk.0.ffn_gate_up_exps.weight", np.zeros((4, 64, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as refused:
        read_gguf(tmp_path / "fused.gguf")
    assert refused.value.kind == "unsupported_family" and "ffn_gate_up_exps" in str(refused.value)


def test_a_gpt_oss_model_llama_cpp_would_compute_differently_is_not_written(tmp_path):
    src = make_tiny_moe(tmp_path / "src", "gpt_oss", **GEOMETRY)
    config = (src / "config.json").read_text().replace('"swiglu_limit": 7.0', '"swiglu_limit": 5.0')
    (src / "config.json").write_text(config)
    with pytest.raises(ValueError, match="swiglu_limit"):
        export_gguf(src, tmp_path / "x.gguf", "F32")
