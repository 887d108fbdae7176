"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def tiny(tiny_moe):
    """The tiny Qwen3-MoE (per-expert layout) as transformers loads it (fp32, eval) and its tokenizer."""
    path = tiny_moe("qwen3_moe", "per_expert")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok
