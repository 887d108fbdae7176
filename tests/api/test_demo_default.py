"""With no ``--model`` the engine serves the embedded demo model (built once, cached), labelled as such.

Slow tier: the first run builds the demo (the embedded-model issue's build); later runs reuse
the cache. The demo is a real 135M chat model converted to a MoE, so its reply is checked to
be non-empty English-ish text, and its label must say it is a converted dense model.
"""

from __future__ import annotations

import httpx
import pytest
from engine_harness import LiveEngine

pytestmark = pytest.mark.slow


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
