"""Writing a Hugging Face MoE folder as GGUF, the way llama.cpp's converter writes that architecture.

Used by ``moetray bench engine`` (the format axis: the same model in BF16, Q8_0 and Q4_K), by
``moetray bench peer`` (the file llama.cpp serves) and by the tests (tiny fixtures in every type).
gguf-py writes the file (``GGUFWriter``, split sets included) and quantizes what it can (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4); Q4_K, which it can only read, is encoded here
(min-max per 32 values, 6-bit sub-scales); other K-quants come from a ``blocks`` hook.

Tensor names and metadata keys are the converter's: ``blk.N.ffn_{gate,up,down}_exps`` stacks, the
shared expert's ``ffn_*_shexp`` and its 1-D gate ``ffn_gate_inp_shexp``, ``{arch}.expert_count``,
``expert_feed_forward_length``, ``expert_shared_feed_forward_length``, ``tokenizer.ggml.*``,
``tokenizer.chat_template``; llama (Mixtral) files permute Q and K for llama.cpp's rope. gpt-oss
files (``GptOssModel``'s names): the interleaved, transposed ``gate_up_proj`` split into gate and up
stacks with their ``.bias`` stacks, ``attn_sinks.weight``, the router's ``ffn_gate_inp.bias``,
``post_attention_norm``, ``attention.sliding_window`` and YaRN's ``rope.scaling.*``. Routers, biases
and 1-D tensors stay F32, as the converter and ``llama-quantize`` leave them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

__all__ = ["ARCH_BY_MODEL_TYPE", "encode_q4_k", "export_gguf"]

ARCH_BY_MODEL_TYPE = {
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "gpt_oss": "gpt-oss",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_5_moe_text": "qwen35moe",
}
"""The GGUF architecture llama.cpp's converter writes for each transformers model type."""

F32_LEAVES = ("ffn_gate_inp.weight", "ssm_conv1d.weight")
"""Tensors the converter always writes F32 (``llama-quantize`` leaves them so too)."""

Blocks = Callable[[str, tuple[int, ...], int], np.ndarray]
"""``(gguf name, torch-order shape, ggml type) → uint8 blocks`` for types nothing here quantizes."""


def encode_q4_k(values: np.ndarray) -> np.ndarray:
    """Rows of float32 (length a multiple of 256) → Q4_K blocks (``[..., n/256*144]`` uint8)."""
    x = values.astype(np.float32).reshape(-1, 8, 32)
    n = x.shape[0]
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dminf > 0, np.rint(mins / dminf), 0).clip(0, 63).astype(np.uint8)
        eff = (df * sc)[..., None]
        q = np.where(eff > 0, np.rint((x + (dminf * mn)[..., None]) / eff), 0).clip(0, 15).astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1
    )
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // 256 * 144)


def _encode(name: str, array: np.ndarray, qtype: GGMLQuantizationType,
            blocks: Blocks | None) -> tuple[np.ndarray, GGMLQuantizationType]:
    """``(stored array, ggml type)`` for one tensor written as ``qtype`` (with the converter's fallbacks)."""
    from gguf import GGML_QUANT_SIZES, quants
    from gguf import GGMLQuantizationType as Q

    if array.ndim < 2 or name.endswith(F32_LEAVES) or not name.endswith(".weight"):
        return array.astype(np.float32), Q.F32  # the converter keeps routers, convolutions, biases F32
    elems, _ = GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % elems:
        # llama.cpp's fallback for rows a block does not divide: Q8_0 where it can, else F16.
        qtype = Q.Q8_0 if array.shape[-1] % 32 == 0 else Q.F16
    if qtype == Q.F32:
        return array.astype(np.float32), qtype
    if qtype == Q.F16:
        return array.astype(np.float16), qtype
    if blocks is not None and qtype not in (Q.BF16,):
        made = blocks(name, tuple(array.shape), int(qtype))
        if made is not None:
            return made, qtype
    if qtype == Q.Q4_K:
        return encode_q4_k(array), qtype
    return quants.quantize(array.astype(np.float32), qtype), qtype


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's converter's Q/K permutation (its rope pairs dimensions differently)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tensors(model, config, arch: str):
    """``(gguf name, float32 array)`` for every tensor of ``model``, in the converter's names."""
    import gguf

    from moetray.engine.models import gguf_qwen35 as qwen35
    from moetray.engine.models.gguf import GGUF_ARCH, tensor_name

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    config = config.get_text_config()
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[GGUF_ARCH[arch]], config.num_hidden_layers
    )
    out: list[tuple[str, np.ndarray]] = []
    for key, value in sd.items():
        if config.tie_word_embeddings and key == "lm_head.weight":
            continue
        base, _, suffix = key.rpartition(".")
        if base.endswith(".experts") and arch == "gpt-oss":
            out.extend(_gpt_oss_expert_tensors(base.split(".")[2], suffix, value))
            continue
        if base.endswith(".experts"):
            layer = base.split(".")[2]
            if suffix == "gate_up_proj":
                half = value.shape[1] // 2
                out.append((f"blk.{layer}.ffn_gate_exps.weight", value[:, :half]))
                out.append((f"blk.{layer}.ffn_up_exps.weight", value[:, half:]))
            elif suffix == "down_proj":
                out.append((f"blk.{layer}.ffn_down_exps.weight", value))
            else:
                raise ValueError(f"no GGUF name for {key}")
            continue
        name = tensor_name(names, key, arch)
        if name is None:
            raise ValueError(f"no GGUF name for {key}")
        if "ffn_gate_inp_shexp." in name:
            value = value.reshape(-1)
        if arch == "llama" and name.endswith(".attn_q.weight"):
            value = _permute(value, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and name.endswith(".attn_k.weight"):
            value = _permute(value, config.num_attention_heads, config.num_key_value_heads)
        elif arch == qwen35.ARCH:
            value = qwen35.to_file(name, torch.from_numpy(value), config).numpy()
        out.append((name, value))
    return out


def _gpt_oss_expert_tensors(layer: str, param: str, value: np.ndarray):
    """gpt-oss's expert stacks as the converter splits them: ``gate_up_proj`` ``[E, H, 2I]`` holds
    gate and up interleaved along its last dim (gate even, up odd) and is stored transposed, so
    ``ffn_gate_exps``/``ffn_up_exps`` are ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``; each
    has its ``.bias`` (``[E, I]`` / ``[E, H]``)."""
    stem = f"blk.{layer}"
    if param == "gate_up_proj":
        rows = value.transpose(0, 2, 1)
        return [
            (f"{stem}.ffn_gate_exps.weight", rows[:, 0::2]),
            (f"{stem}.ffn_up_exps.weight", rows[:, 1::2]),
        ]
    if param == "gate_up_proj_bias":
        return [(f"{stem}.ffn_gate_exps.bias", value[:, 0::2]), (f"{stem}.ffn_up_exps.bias", value[:, 1::2])]
    if param == "down_proj":
        return [(f"{stem}.ffn_down_exps.weight", value.transpose(0, 2, 1))]
    if param == "down_proj_bias":
        return [(f"{stem}.ffn_down_exps.bias", value)]
    raise ValueError(f"no GGUF name for experts parameter {param}")


def _write_rope_scaling(writer, rope: dict) -> None:
    """YaRN as the converter writes it: type, factor, original context, and the betas it names."""
    from gguf import RopeScalingType

    if rope.get("rope_type") != "yarn" or rope.get("factor") is None:
        return
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if rope.get("attention_factor") is not None:
        writer.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))
    if rope.get("beta_fast") is not None:
        writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
    if rope.get("beta_slow") is not None:
        writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))


def _write_metadata(writer, config, arch: str, tokenizer, file_type: int) -> None:
    text = config.get_text_config()
    writer.add_name(getattr(text, "_name_or_path", None) or "moetray export")
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    rope = (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
    if rope is not None:
        writer.add_rope_freq_base(float(rope))
    writer.add_file_type(file_type)
    if arch == "llama":
        writer.add_feed_forward_length(text.intermediate_size)
        writer.add_expert_count(text.num_local_experts)
        writer.add_rope_dimension_count(text.hidden_size // text.num_attention_heads)
        writer.add_vocab_size(text.vocab_size)
    elif arch == "gpt-oss":
        writer.add_feed_forward_length(text.intermediate_size)
        writer.add_expert_count(text.num_local_experts)
        writer.add_expert_feed_forward_length(text.intermediate_size)
        writer.add_key_length(text.head_dim)
        writer.add_value_length(text.head_dim)
        writer.add_sliding_window(text.sliding_window)
        _write_rope_scaling(writer, text.rope_parameters or {})
    elif arch == "qwen35moe":
        _write_qwen35moe(writer, text)
    else:
        writer.add_feed_forward_length(text.intermediate_size)
        writer.add_expert_count(text.num_experts)
        writer.add_expert_feed_forward_length(text.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(text.shared_expert_intermediate_size)
        if arch == "qwen3moe":
            writer.add_key_length(text.head_dim)
            writer.add_value_length(text.head_dim)
    writer.add_expert_used_count(text.num_experts_per_tok)
    _write_tokenizer(writer, tokenizer, text, arch)


def _write_qwen35moe(writer, text) -> None:
    """The keys ``Qwen3NextModel``/``Qwen3_5MoeTextModel`` add: experts, the Gated DeltaNet's
    ``ssm.*`` sizes, the full-attention interval and the partial, sectioned (mrope) rotary width."""
    from moetray.engine.models.gguf_qwen35 import full_attention_interval

    writer.add_expert_count(text.num_experts)
    writer.add_expert_feed_forward_length(text.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(text.shared_expert_intermediate_size)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_ssm_conv_kernel(text.linear_conv_kernel_dim)
    writer.add_ssm_state_size(text.linear_key_head_dim)
    writer.add_ssm_group_count(text.linear_num_key_heads)
    writer.add_ssm_time_step_rank(text.linear_num_value_heads)
    writer.add_ssm_inner_size(text.linear_value_head_dim * text.linear_num_value_heads)
    writer.add_full_attention_interval(full_attention_interval(list(text.layer_types)))
    rope = text.rope_parameters or {}
    writer.add_rope_dimension_count(int(text.head_dim * rope.get("partial_rotary_factor", 0.25)))
    # llama.cpp requires the sections; the converter writes its default where a config has none
    sections = list(rope.get("mrope_section") or [11, 11, 10])
    writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))


def _write_tokenizer(writer, tokenizer, text, arch: str) -> None:
    """A byte-level BPE tokenizer as the converter writes one (``gpt2`` model, merges, token types)."""
    from gguf import TokenType

    vocab = tokenizer.get_vocab()
    size = max(text.vocab_size, max(vocab.values()) + 1)
    by_id = {i: t for t, i in vocab.items()}
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(TokenType.CONTROL if i in special else TokenType.NORMAL)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, value in (
        (writer.add_bos_token_id, text.bos_token_id),
        (writer.add_eos_token_id, text.eos_token_id),
        (writer.add_pad_token_id, text.pad_token_id),
    ):
        if isinstance(value, int):
            setter(value)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _check_gpt_oss_writable(config) -> None:
    """A gpt-oss model llama.cpp's graph computes as transformers does: its SwiGLU constants, and
    sliding and full attention alternating from a sliding layer 0 (llama.cpp's fixed pattern)."""
    from moetray.engine.models.gguf import GPT_OSS_SWIGLU, gpt_oss_layer_types

    for field, value in GPT_OSS_SWIGLU.items():
        if getattr(config, field) != value:
            raise ValueError(f"gpt-oss {field}={getattr(config, field)}: GGUF files assume {value}")
    if list(config.layer_types) != gpt_oss_layer_types(config.num_hidden_layers):
        raise ValueError("gpt-oss layer_types must alternate sliding/full from layer 0 to be written as GGUF")


def export_gguf(
    model_dir: str | Path,
    dest: str | Path,
    qtype: str | Callable[[str], str] = "F16",
    *,
    split_max_tensors: int = 0,
    blocks: Blocks | None = None,
    output_weight: bool = False,
    gate_floor: float | None = None,
) -> list[Path]:
    """Write the Hugging Face MoE folder ``model_dir`` as GGUF at ``dest`` in ``qtype`` (a ggml type
    name, or ``gguf name → type name`` for a mix such as Q4_K_M's); returns the files written
    (several with ``split_max_tensors``: ``…-00001-of-0000N.gguf``).

    ``output_weight`` writes ``output.weight`` even for tied embeddings (llama.cpp's qwen2moe
    loader needs it); ``gate_floor`` replaces exactly-zero shared-expert gate weights with that tiny
    value (llama.cpp computes the gate's sigmoid as ``silu(x)/x``, NaN at exactly 0).
    """
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, dest = Path(model_dir), Path(dest)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    arch = ARCH_BY_MODEL_TYPE.get(config.model_type)
    if arch is None:
        raise ValueError(f"no GGUF export for model type {config.model_type!r}")
    if arch == "gpt-oss":
        _check_gpt_oss_writable(config)
    type_of = qtype if callable(qtype) else (lambda name: qtype)
    tensors = _tensors(model, config, arch)
    if output_weight and config.tie_word_embeddings:
        embed = next(v for n, v in tensors if n == "token_embd.weight")
        tensors.append(("output.weight", embed))
    if gate_floor is not None:
        tensors = [
            (n, np.where(v == 0, np.float32(gate_floor), v) if "ffn_gate_inp_shexp" in n else v)
            for n, v in tensors
        ]
    file_type = {
        "F32": 0,
        "F16": 1,
        "BF16": 32,
        "Q8_0": 7,
        "Q4_0": 2,
        "Q4_1": 3,
        "Q5_0": 8,
        "Q5_1": 9,
        "Q4_K": 15,
        "MXFP4": 38,
    }.get(type_of("blk.0.ffn_up_exps.weight"), 1)
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dest, arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, config, arch, tokenizer, file_type)
    for name, value in tensors:
        target = gguf.GGMLQuantizationType[type_of(name)]
        stored, stored_type = _encode(name, np.ascontiguousarray(value), target, blocks)
        writer.add_tensor(name, stored, raw_dtype=stored_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    files = writer.format_shard_names(dest)
    writer.close()
    return files
