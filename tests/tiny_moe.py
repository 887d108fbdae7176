"""Tiny random-init MoE checkpoints, written the way real ones are, for engine and API tests.

``make_tiny_moe(dest, family, layout)`` saves a standard Hugging Face folder (safetensors,
config, generation config, tokenizer with a ChatML chat template) that
``AutoModelForCausalLM.from_pretrained`` loads offline. ``layout="per_expert"`` is what
``save_pretrained`` writes (``experts.N.gate_proj`` / Mixtral ``w1 w3 w2``);
``layout="fused"`` stores the transformers-5 stacks (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]) as some hub checkpoints do. Random routing is fine for
plumbing and token identity, useless for judging cache policies.

Families: qwen3_moe, qwen2_moe, mixtral, olmoe; and granitemoe, granitemoeshared (whose
``save_pretrained`` writes the legacy ``input_linear``/``output_linear`` stacks), gpt_oss
(biased, transposed, interleaved gate/up: ``save_pretrained`` writes the fused stacks, so
its two layouts are the same files), phimoe (Mixtral's legacy names), deepseek_v2,
deepseek_v3 and glm4_moe (shared experts; ``dense_layers`` puts dense MLP layers first).
jetmoe is here only to be refused: transformers computes its experts in its own forward.

Hybrids (Gated DeltaNet linear attention, one full-attention layer in every four):
qwen3_5_moe_text (the text-only layout), qwen3_5_moe (the layout real Qwen3.5/3.6-MoE
checkpoints ship: ``Qwen3_5MoeForConditionalGeneration``, a small vision tower beside the
text weights under ``model.language_model.*``) and qwen3_next.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    JetMoeConfig,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
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
                hidden: int = 64, expert_inter: int = 32, vocab: int = 384, dense_layers: int = 0):
    """A tiny config of ``family``. ``dense_layers`` (DeepSeek-style families only) makes the
    first that many decoder layers dense MLPs (``first_k_dense_replace``)."""
    if dense_layers and family not in _DEEPSEEK_STYLE:
        raise ValueError(f"{family!r} has no dense-layer prefix")
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
    if family == "jetmoe":  # an MoE family whose experts are NOT behind the experts interface
        return JetMoeConfig(**{k: v for k, v in common.items() if k != "num_attention_heads"},
                            kv_channels=hidden // 4, intermediate_size=expert_inter,
                            num_local_experts=num_experts, num_experts_per_tok=top_k)
    if family in ("granitemoe", "granitemoeshared"):
        granite = dict(intermediate_size=expert_inter, num_local_experts=num_experts,
                       num_experts_per_tok=top_k, embedding_multiplier=2.0, logits_scaling=4.0,
                       residual_multiplier=0.5, attention_multiplier=1.0 / 16)
        if family == "granitemoe":
            return GraniteMoeConfig(**common, **granite)
        return GraniteMoeSharedConfig(**common, **granite, shared_intermediate_size=expert_inter * 2)
    if family == "gpt_oss":
        return GptOssConfig(**common, head_dim=hidden // 4, intermediate_size=expert_inter,
                            num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=8,
                            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(num_layers)])
    if family == "phimoe":
        return PhimoeConfig(**common, intermediate_size=expert_inter, num_local_experts=num_experts,
                            num_experts_per_tok=top_k, sliding_window=None)
    deepseek = dict(moe_intermediate_size=expert_inter, intermediate_size=expert_inter * 2,
                    n_routed_experts=num_experts, num_experts_per_tok=top_k, n_shared_experts=1,
                    first_k_dense_replace=dense_layers)
    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    if family == "deepseek_v2":  # V2-Lite's shape: greedy top-k, no query compression
        return DeepseekV2Config(**common, **deepseek, **mla, topk_method="greedy", norm_topk_prob=False)
    if family == "deepseek_v3":  # grouped routing with a score-correction bias, scaled weights
        return DeepseekV3Config(**common, **deepseek, **mla, n_group=2, topk_group=1,
                                routed_scaling_factor=2.5, norm_topk_prob=True)
    if family in HYBRID_FAMILIES:
        linear = dict(head_dim=hidden // 4, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                      moe_intermediate_size=expert_inter, shared_expert_intermediate_size=expert_inter,
                      num_experts=num_experts, num_experts_per_tok=top_k,
                      # a full-attention layer every fourth (the real models' interval), and
                      # the last one when there are fewer than four
                      layer_types=["full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 < 3
                                   else "linear_attention" for i in range(num_layers)])
        if family == "qwen3_next":
            return Qwen3NextConfig(**common, **linear, intermediate_size=expert_inter * 2)
        text = Qwen3_5MoeTextConfig(**common, **linear)
        if family == "qwen3_5_moe_text":
            return text
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=hidden)
        return Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False)
    if family == "glm4_moe":
        return Glm4MoeConfig(**common, **deepseek, head_dim=hidden // 4, n_group=1, topk_group=1,
                             norm_topk_prob=True)
    raise ValueError(f"unknown tiny family {family!r}")


_DEEPSEEK_STYLE = ("deepseek_v2", "deepseek_v3", "glm4_moe")
HYBRID_FAMILIES = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
_CONSTANT_INIT_FAMILIES = ("granitemoe", "granitemoeshared", "gpt_oss", "phimoe", *_DEEPSEEK_STYLE,
                           *HYBRID_FAMILIES)


def _jitter_constants(model: torch.nn.Module) -> None:
    """Give every tensor that initialises to a constant (norm weights at 1, gpt-oss's expert and
    attention biases and DeepSeek's routing-correction bias at 0) random values around it, so an
    identity test notices a loader that drops or misplaces one. (The older families' tiny
    checkpoints keep their stock init.)"""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if not tensor.is_floating_point() or tensor.numel() < 2:
                continue
            value = tensor.flatten()[0].item()
            if bool((tensor == value).all()):
                # Around a non-zero value, 10 %; around zero, about a router logit's spread, so a
                # routing bias does not pin every token to the same few experts.
                tensor.add_((0.1 * abs(value) if value else 0.01) * torch.randn_like(tensor))


def _long_memory(model: torch.nn.Module) -> None:
    """Give every Gated DeltaNet layer a slow decay and a strong output, as trained ones have.

    At random init the recurrence forgets within a few tokens and its output is small beside
    the residual stream, so a wrong or stale state would barely move a token; with a decay near 1
    the state carries the whole prompt, and a state error changes the greedy tokens."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("GatedDeltaNet"):
                module.A_log.copy_(torch.log(torch.empty_like(module.A_log).uniform_(0.02, 0.08)))
                module.dt_bias.copy_(torch.empty_like(module.dt_bias).uniform_(-4.0, -3.0))
                module.out_proj.weight.mul_(6.0)


def make_tiny_moe(dest: Path, family: str = "qwen3_moe", layout: str = "per_expert",
                  seed: int = 0, **config_kw) -> Path:
    """Write a tiny random MoE checkpoint folder to ``dest`` and return it."""
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"unknown layout {layout!r}")
    dest = Path(dest)
    config = tiny_config(family, **config_kw)
    torch.manual_seed(seed)
    if family == "qwen3_5_moe":  # the multimodal class real checkpoints are saved from
        model = Qwen3_5MoeForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in _CONSTANT_INIT_FAMILIES:
        _jitter_constants(model)
    if family in HYBRID_FAMILIES:
        _long_memory(model)
    model.generation_config.eos_token_id = config.get_text_config().eos_token_id
    model.generation_config.pad_token_id = config.get_text_config().pad_token_id
    model.save_pretrained(dest)
    if layout == "fused":
        # The module state dict already holds the fused stacks; write it verbatim.
        for shard in dest.glob("*.safetensors"):
            shard.unlink()
        (dest / "model.safetensors.index.json").unlink(missing_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer(config.get_text_config().vocab_size).save_pretrained(dest)
    return dest
