"""The experts-interface seam: every touch of transformers internals the experts package makes.

transformers 5 keeps a MoE layer's experts behind a pluggable interface
(``transformers.integrations.moe``); moetray registers its runtime there, recognises the
stock gate so it may take its fast path, asks whether the stock grouped path pads its output,
renames checkpoint keys by transformers' own conversion rules while it fills the store, and
decodes quantized expert rows with transformers' dequantizers (GGUF blocks, MXFP4 experts).
Only this module and ``engine/cb/`` import transformers internals (an import-linter contract),
so a new transformers minor version is checked in two places.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key
from transformers.integrations.gguf.dequant import _DEQUANT, GGML_BLOCK
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    ExpertsInterface,
    _can_use_grouped_mm,
    _default_apply_gate,
)
from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

DEFAULT_APPLY_GATE = _default_apply_gate
"""The stock ``_apply_gate`` (silu(gate) * up): a module that keeps it may take the fused path."""


class ExpertsModule(Protocol):
    """What the experts interface's function reads of transformers' fused experts module."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]
    post_expert_norm: Callable[[torch.Tensor], torch.Tensor]  # present when has_post_expert_norm

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def register_experts_function(name: str, forward: Callable[..., torch.Tensor]) -> None:
    """Register ``forward`` in the experts interface under ``name`` (idempotent)."""
    if ALL_EXPERTS_FUNCTIONS.get(name) is not forward:
        ExpertsInterface.register(name, forward)


def padded_grouped_output(device: torch.device) -> bool:
    """Whether transformers' stock grouped path runs PyTorch's grouped-mm kernel here (whose
    output rows are padded to 16 bytes) rather than its own fallback (plain rows)."""
    probe = torch.empty(1, 1, device=device)
    return bool(_can_use_grouped_mm(probe, torch.empty(1, 1, 1, device=device),
                                    torch.ones(1, dtype=torch.int32, device=device)))


def key_renamer(model: PreTrainedModel) -> Callable[[str], str]:
    """checkpoint key → model key, by transformers' renaming rules for this model."""
    meta_sd = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        renamed, _ = rename_source_key(key, renamings, [], prefix, meta_sd)
        if renamed not in meta_sd and key in meta_sd:
            return key
        return renamed

    return rename


def dequantize_ggml_blocks(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``[n_blocks, block_bytes]`` ``uint8`` GGUF blocks → ``[n_blocks, block_elems]`` float32, by
    transformers' torch dequantizer for ``ggml_type`` (Q4_0, Q4_1, Q8_0, the K- and IQ-quants).
    Raises ``KeyError`` for a type it has none for."""
    elems, _ = GGML_BLOCK[ggml_type]
    return _DEQUANT[ggml_type](blocks, torch.float32).reshape(blocks.shape[0], elems)


def dequantize_mxfp4_packed(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A Hugging Face MXFP4 tensor (``blocks`` ``[E, rows, G, 16]``, ``scales`` ``[E, rows, G]``) →
    float32 ``[E, G*32, rows]``: transformers' own unpacking (the transposed layout gpt-oss's
    experts hold)."""
    return _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
