"""Qwen3.5/3.6-MoE GGUF files (llama.cpp's ``qwen35moe``): the config from the metadata and the
five value/layout transforms llama.cpp's converter applies, each in both directions.

The reader (:mod:`moetray.engine.models.gguf`) undoes them on the dequantized non-expert
weights; the writer (:mod:`moetray.engine.models.gguf_export`) applies them as the converter
(``Qwen3NextModel`` and ``_LinearAttentionVReorderBase`` under ``Qwen3_5MoeTextModel``) does:

1. names: ``blk.N.*`` leaves; ``A_log`` is the bare ``ssm_a`` and ``dt_bias`` is ``ssm_dt.bias``;
2. the zero-centred RMSNorms (``1 + w``) are stored as ``w + 1``, all but the Gated DeltaNet's
   own ``ssm_norm``;
3. ``ssm_a`` holds ``-exp(A_log)``;
4. ``ssm_conv1d`` is squeezed from ``[C, 1, K]`` to ``[C, K]``;
5. value heads are tiled (``v0k0 v0k1 v1k0 …``, for ggml's broadcast) where transformers groups
   them by key head (``v0k0 v1k0 v0k1 …``): the rows of every tensor that produces the value
   dimension (``attn_qkv``'s and ``ssm_conv1d``'s value part, ``attn_gate``, ``ssm_alpha``,
   ``ssm_beta``, ``ssm_a``, ``ssm_dt``) and the columns of the one that consumes it (``ssm_out``).

The experts (``ffn_{gate,up,down}_exps``) and the shared expert are stored as qwen3moe's; the
multi-token-prediction block, when the file has one, is the last ``nextn_predict_layers`` blocks
and is not loaded (transformers' model has no MTP module).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ARCH",
    "from_file",
    "full_attention_interval",
    "qwen35moe_config",
    "tensor_name",
    "to_file",
]

ARCH = "qwen35moe"
OFFSET_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")
"""The norms stored as ``w + 1`` (every ``*norm.weight`` the converter sees but ``ssm_norm``)."""
BARE_PARAMETERS = {"A_log": "ssm_a", "dt_bias": "ssm_dt.bias"}
"""The Gated DeltaNet's bare parameters → their GGUF leaf (``ssm_a`` has no ``.weight``)."""


def tensor_name(key: str) -> str | None:
    """The GGUF name of a bare Gated DeltaNet parameter (``model.layers.N.linear_attn.A_log``), or None
    for every other key (gguf-py's tensor-name map names those)."""
    parts = key.split(".")
    if len(parts) >= 4 and parts[-2] == "linear_attn" and parts[-1] in BARE_PARAMETERS:
        return f"blk.{parts[-3]}.{BARE_PARAMETERS[parts[-1]]}"
    return None


def full_attention_interval(layer_types: list[str]) -> int:
    """The ``full_attention_interval`` that yields ``layer_types`` (a full-attention layer every
    n-th, as llama.cpp lays them out); ``ValueError`` for a pattern no interval yields."""
    for n in range(1, len(layer_types) + 1):
        if layer_types == _layer_types(n, len(layer_types)):
            return n
    raise ValueError(f"layer_types {layer_types} are not a full-attention layer every n-th layer")


def _layer_types(interval: int, layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def qwen35moe_config(metadata: dict, tensors: dict, mapped: dict):
    """transformers' ``Qwen3_5MoeTextConfig`` of a qwen35moe file: transformers' own reading of the
    metadata (``mapped``, from ``integrations.gguf``'s config mapping), tensor shapes winning where
    they say the same thing, and ``layer_types`` spelled out from ``full_attention_interval``."""
    from transformers import Qwen3_5MoeTextConfig

    fields = {k: v for k, v in mapped.items() if k not in ("model_type", "architectures")}
    layers = fields["num_hidden_layers"]
    first = next(i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in tensors)
    experts, inter, _ = tensors[f"blk.{first}.ffn_gate_exps.weight"].shape
    fields.update(
        vocab_size=tensors["token_embd.weight"].shape[0],
        num_experts=experts,
        moe_intermediate_size=inter,
        layer_types=_layer_types(fields.pop("full_attention_interval"), layers),
    )
    fields.pop("intermediate_size", None)  # a dense width: the MoE text config has none
    rope = dict(fields["rope_parameters"])
    rope.setdefault("rope_type", "default")
    fields["rope_parameters"] = rope
    return Qwen3_5MoeTextConfig(**fields)


def _tiled_from_grouped(text: Any, head_dim: int) -> torch.Tensor:
    """``tiled[i] = grouped[order[i]]`` over ``num_v_heads * head_dim`` rows."""
    k = text.linear_num_key_heads
    per_k = text.linear_num_value_heads // k
    return torch.arange(k * per_k * head_dim).reshape(k, per_k, head_dim).transpose(0, 1).reshape(-1)


def _value_rows(text: Any, leaf: str) -> tuple[int, int] | None:
    """``(first row, head_dim)`` of the value-head rows a tensor produces, None if it has none."""
    qk = 2 * text.linear_key_head_dim * text.linear_num_key_heads
    return {
        "attn_qkv.weight": (qk, text.linear_value_head_dim),
        "ssm_conv1d.weight": (qk, text.linear_value_head_dim),
        "attn_gate.weight": (0, text.linear_value_head_dim),
        "ssm_alpha.weight": (0, 1),
        "ssm_beta.weight": (0, 1),
        "ssm_a": (0, 1),
        "ssm_dt.bias": (0, 1),
    }.get(leaf)


def _leaf(name: str) -> str:
    """``blk.3.attn_qkv.weight`` → ``attn_qkv.weight``; ``output_norm.weight`` stays."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def _reorder(values: torch.Tensor, name: str, text: Any, to_tiled: bool) -> torch.Tensor:
    leaf = _leaf(name)
    rows = _value_rows(text, leaf)
    if rows is not None:
        start, head_dim = rows
        order = _tiled_from_grouped(text, head_dim)
        order = order if to_tiled else torch.argsort(order)
        return torch.cat([values[:start], values[start:][order]])
    if leaf == "ssm_out.weight":
        order = _tiled_from_grouped(text, text.linear_value_head_dim)
        return values[:, order if to_tiled else torch.argsort(order)]
    return values


def _is_offset_norm(name: str) -> bool:
    return _leaf(name).removesuffix(".weight") in OFFSET_NORMS


def to_file(name: str, values: torch.Tensor, text: Any) -> torch.Tensor:
    """A tensor as transformers holds it (float32) → as the converter writes ``name``."""
    values = _reorder(values, name, text, to_tiled=True)
    leaf = _leaf(name)
    if _is_offset_norm(name):
        return values + 1
    if leaf == "ssm_a":
        return -torch.exp(values)
    if leaf == "ssm_conv1d.weight":
        return values.squeeze(1)
    return values


def from_file(name: str, values: torch.Tensor, text: Any) -> torch.Tensor:
    """The inverse of :func:`to_file`: the file's (dequantized, float32) tensor → transformers'."""
    leaf = _leaf(name)
    if _is_offset_norm(name):
        values = values - 1
    elif leaf == "ssm_a":
        values = torch.log(-values)
    elif leaf == "ssm_conv1d.weight":
        values = values.unsqueeze(1)
    return _reorder(values, name, text, to_tiled=False)
