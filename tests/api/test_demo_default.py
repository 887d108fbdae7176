"""With no ``--model`` the engine serves the embedded demo model (built once, cached), labelled as such.

Slow tier: the first run builds the demo (the embedded-model issue's build); later runs reuse
the cache. The demo is a real 135M chat model converted to a MoE, so its reply is checked to
be non-empty English-ish text, and its label must say it is a converted dense model.
"""

from __future__ import annotations

import httpx
import pytest
from bounded import COLD_START_S
from engine_harness import LiveEngine

pytestmark = pytest.mark.slow


@pytest.mark.timeout(COLD_START_S + 300)  # a cold start compiles the demo's decode step, then it answers
def test_no_model_serves_the_embedded_demo_with_its_label(tmp_path):
    from moetray.engine.demo import demo_model_path, ensure_demo_model, read_sidecar

    folder = ensure_demo_model()
    sidecar = read_sidecar(folder)
    engine = LiveEngine(None, tmp_path, budget_bytes=2 << 30, kv_tokens=4096, max_batch_tokens=128)
    try:
        model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]
        assert model["label"] == sidecar["label"]
        assert "not a trained MoE" in model["label"]
        status = engine.status()
        assert status["model"]["path"] == str(demo_model_path())
        assert status["model"]["top_k"] == sidecar["default_top_k"]
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
                "temperature": 0}
        reply = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=300).json()
        text = reply["choices"][0]["message"]["content"]
        assert text.strip() and sum(c.isalpha() for c in text) >= 3
    finally:
        engine.close()


def test_demo_served_offloaded_equals_the_same_checkpoint_fully_resident(tmp_path):
    """Issue 6's end-to-end fixture: the demo model through the engine with a small expert
    cache (most experts offloaded, misses copied in per step) gives exactly the greedy tokens
    of the same checkpoint fully resident with the stock experts, in fp32.

    A wrong slot, a stale row or a mis-ordered expert sum shows up here as a diverging token
    on real hidden states and real routing, which random-init checkpoints cannot exercise.
    """
    import torch
    from transformers import AutoTokenizer

    from moetray.engine.demo import ensure_demo_model, read_sidecar
    from moetray.engine.experts import load_resident_model

    folder = ensure_demo_model()
    top_k = read_sidecar(folder)["default_top_k"]
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                add_generation_prompt=True, tokenize=False),
        "The history of the printing press begins",
    ]
    resident = load_resident_model(folder, dtype=torch.float32)
    assert resident.config.num_experts_per_tok == top_k
    expected = []
    for text in prompts:
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        out = resident.generate(ids, max_new_tokens=16, do_sample=False,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        expected.append(out[0, ids.shape[1]:].tolist())
    del resident

    # 48 of 480 slots: each step's 30 layers x 12 routed experts cannot all stay resident.
    engine = LiveEngine(folder, tmp_path, dtype="float32", moe_capacity=48,
                        budget_bytes=2 << 30, kv_tokens=4096, max_batch_tokens=128)
    try:
        for text, ref in zip(prompts, expected, strict=True):
            ids = tok(text, add_special_tokens=False).input_ids
            body = {"prompt": ids, "max_tokens": 16, "temperature": 0}
            out = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300).json()
            shown = [t for t in ref if t != tok.eos_token_id]
            assert out["choices"][0]["text"] == tok.decode(shown, skip_special_tokens=False)
            assert out["usage"]["completion_tokens"] == len(ref)
        experts = engine.status()["experts"]
        assert experts["total_misses"] > 48  # the cache really churned: copies beyond the first fill
    finally:
        engine.close()
