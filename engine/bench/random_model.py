"""Random-weight benchmark checkpoints: a real tokenizer and a real architecture, no hub.

Random weights make outputs meaningless but the work per token real; every build is seeded,
so a checkpoint generated twice is the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = (
    "Mixture of experts models route every token to a few experts chosen by a learned router. "
    "A serving engine keeps the hottest experts on the device and streams the rest over the link. "
    "The key value cache stores attention state in pages so that many requests share one pool. "
    "Prefix caching lets a follow-up turn skip the part of the prompt it has already computed. "
    "The quick brown fox jumps over the lazy dog while the tray shows tokens per second. "
)
"""The text the benches' tokenizers are trained on and their long prompts are cut from."""


def ensure_random_model(path: Path, config_class: Any, **family: Any) -> Path:
    """``path`` holding a random-weight MoE of ``config_class`` with a ChatML BPE, built once.

    The benches' shared geometry (hidden 256, 4 layers, 4 heads / 2 KV heads, 16 experts of
    256, top-2, 4096 context) plus the ``family``'s own fields; seeded, so every build is the
    same model. Written beside ``path`` and renamed into place: a half-written folder is never
    taken for a model.
    """
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    from moetray.engine.bench.tokenizer import chatml_bpe_tokenizer

    fast = chatml_bpe_tokenizer([CORPUS] * 20, vocab_size=1024)
    config = config_class(
        vocab_size=len(fast),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim: hidden_size / num_attention_heads = 64
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        **family,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    tmp.rename(path)
    return path


def ensure_random_twin(source: Path, path: Path) -> Path:
    """``path`` holding a seeded random-weight model of ``source``'s config and tokenizer, built once.

    For a machine a checkpoint cannot travel to (a lent GPU takes 64 MiB of files): the same
    architecture and geometry, so the same bytes and kernels per token, from ``source``'s
    ``config.json`` and tokenizer files alone. Renamed into place like :func:`ensure_random_model`.
    """
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    tmp.rename(path)
    return path
