"""Tiny random-init MoE checkpoints, written the way real ones are, for engine and API tests.

``make_tiny_moe(dest, family, layout)`` saves a standard Hugging Face folder (safetensors,
config, generation config, tokenizer with a ChatML chat template) that
``AutoModelForCausalLM.from_pretrained`` loads offline. ``layout="per_expert"`` is what
``save_pretrained`` writes (``experts.N.gate_proj`` / Mixtral ``w1 w3 w2``);
``layout="fused"`` stores the transformers-5 stacks (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]) as some hub checkpoints do. Random routing is fine for
plumbing and token identity, useless for judging cache policies.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from moetray.engine.bench.tokenizer import chatml_bpe_tokenizer

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route each token to a few experts.",
    "Hello! How can I help you today? What is the capital of France? Paris.",
    "Tool calls, reasoning, caches, memory, slots, pages, tokens and layers.",
    "0123456789 + - * / = ( ) [ ] { } < > : ; , . ! ? ' \" _ | \\ ~ @ # $ % ^ &",
]


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer small enough for a tiny model, with a ChatML template."""
    return chatml_bpe_tokenizer(_CORPUS * 4, vocab_size)


def tiny_config(family: str, *, num_layers: int = 2, num_experts: int = 8, top_k: int = 2,
                hidden: int = 64, expert_inter: int = 32, vocab: int = 384):
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=hidden // 4, moe_intermediate_size=expert_inter,
                              intermediate_size=expert_inter * 2, num_experts=num_experts,
                              num_experts_per_tok=top_k, norm_topk_prob=True)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**common, moe_intermediate_size=expert_inter,
                              intermediate_size=expert_inter * 2, num_experts=num_experts,
                              num_experts_per_tok=top_k,
                              shared_expert_intermediate_size=expert_inter * 2)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=expert_inter,
                             num_local_experts=num_experts, num_experts_per_tok=top_k,
                             sliding_window=None)
    if family == "olmoe":
        return OlmoeConfig(**common, intermediate_size=expert_inter, num_experts=num_experts,
                           num_experts_per_tok=top_k)
    raise ValueError(f"unknown tiny family {family!r}")


def make_tiny_moe(dest: Path, family: str = "qwen3_moe", layout: str = "per_expert",
                  seed: int = 0, **config_kw) -> Path:
    """Write a tiny random MoE checkpoint folder to ``dest`` and return it."""
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"unknown layout {layout!r}")
    dest = Path(dest)
    config = tiny_config(family, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(dest)
    if layout == "fused":
        # The module state dict already holds the fused stacks; write it verbatim.
        for shard in dest.glob("*.safetensors"):
            shard.unlink()
        (dest / "model.safetensors.index.json").unlink(missing_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer(config.vocab_size).save_pretrained(dest)
    return dest
