"""The next MoE families served end to end: HTTP → continuous batching → offloaded experts.

For each family tests/engine/test_more_families.py proves token-identical under ``generate``,
a real engine (``moetray serve``'s code path, on a loopback port) with its expert pool at the
engine's floor (one layer's worth of slots: half the tiny model's experts, so it churns)
answers a greedy ``/v1/completions`` with the stock resident model's greedy continuation.
A family whose experts are outside the experts interface (JetMoE), or whose attention the
paged KV pool cannot hold (DeepSeek's multi-head latent attention), ends the load ``failed``
with the reason, instead of serving.
"""

from __future__ import annotations

import httpx
import pytest
import torch

FAMILIES = {
    "granitemoe": {},
    "gpt_oss": {},
    "granitemoeshared": {},
    "phimoe": {},
    "glm4_moe": {"num_layers": 3, "dense_layers": 1},
}
# The experts runtime computes these exactly (tests/engine/test_more_families.py), but their
# multi-head latent attention cannot be paged by transformers' continuous batching.
MLA_FAMILIES = {"deepseek_v2": {"num_layers": 3, "dense_layers": 1},
                "deepseek_v3": {"num_layers": 3, "dense_layers": 1}}
LAYOUT = {"gpt_oss": "fused"}  # the others: what save_pretrained writes
NEW_TOKENS = 12
FLOOR = 8  # the engine's floor: one MoE layer's experts (of 2 × 8)


def stock_greedy(checkpoint, prompt: list[int]) -> list[int]:
    """The resident model's argmax continuation, EOS included (the request ignores EOS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_completion_equals_the_stock_model(tiny_moe, start_engine, family):
    """Prevents: a family that loads and decodes under ``generate`` but not under the engine's
    continuous batching (paged KV with MLA, sliding windows or sinks; the engine's own layer and
    pool arithmetic), or an expert pool at the floor serving stale slots to batched steps."""
    from transformers import AutoTokenizer

    checkpoint = tiny_moe(family, LAYOUT.get(family, "per_expert"), **FAMILIES[family])
    tok = AutoTokenizer.from_pretrained(checkpoint)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. Mixture of experts")
    want = stock_greedy(checkpoint, prompt)
    engine = start_engine(checkpoint, moe_capacity=FLOOR)
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30).json()
    assert out["usage"]["completion_tokens"] == NEW_TOKENS
    assert out["choices"][0]["text"] == tok.decode(want, skip_special_tokens=False)
    runtime = engine.engine.pools.runtime
    assert runtime.capacity == FLOOR < runtime.num_layers * runtime.num_experts
    assert runtime.cache.stats().misses > FLOOR  # the pool refilled slots while serving


def test_a_family_outside_the_experts_interface_fails_the_load(tiny_moe, start_engine):
    """JetMoE is a MoE checkpoint transformers builds, but its experts never reach the experts
    interface: the engine must end ``failed`` naming why, never ``serving``."""
    engine = start_engine(tiny_moe("jetmoe", "per_expert"), wait=False)
    health = engine.wait_state({"failed", "serving"})
    assert health["state"] == "failed"
    assert health["error_kind"] == "unsupported_family" and "experts interface" in health["error"]


@pytest.mark.parametrize("family", list(MLA_FAMILIES))
def test_multi_head_latent_attention_fails_the_load_by_name(tiny_moe, start_engine, family):
    """DeepSeek-V2/V3 load and decode offloaded under ``generate``, but the engine's paged KV
    pool cannot hold their latent cache: the load must end ``failed`` naming it, before the
    weights are read, instead of serving and crashing the batch loop on the first request."""
    engine = start_engine(tiny_moe(family, "per_expert", **MLA_FAMILIES[family]), wait=False)
    health = engine.wait_state({"failed", "serving"})
    assert health["state"] == "failed"
    assert health["error_kind"] == "unsupported_attention"
    assert "multi-head latent attention" in health["error"]
    assert health["load_progress"]["stage"] == "reading config"  # refused before any weight moved


def test_sliding_window_layers_get_the_stock_prefix_cache_unless_radix_is_named(tiny_moe, start_engine):
    """radix owns full-attention blocks only; gpt-oss alternates sliding-window layers, whose
    blocks the substrate keeps in per-request rings. Left unset, the prefix policy follows the
    model (gpt-oss serves above with the stock cache); named, radix is refused by kind while
    the config is read, never after every weight has loaded."""
    assert start_engine(tiny_moe("qwen3_moe", "per_expert")).engine.served.prefix_policy == "radix"
    checkpoint = tiny_moe("gpt_oss", "fused")
    assert start_engine(checkpoint).engine.served.prefix_policy == "stock"
    engine = start_engine(checkpoint, prefix_policy="radix", wait=False)
    health = engine.wait_state({"failed", "serving"})
    assert (health["state"], health["error_kind"]) == ("failed", "radix_needs_full_attention")
    assert health["load_progress"]["stage"] == "reading config"
