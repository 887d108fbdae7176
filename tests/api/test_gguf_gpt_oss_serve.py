"""A gpt-oss GGUF (MXFP4 experts, as llama.cpp ships gpt-oss) served by a live engine: the tokenizer
and chat template from the file's metadata, chat through the OpenAI routes, the experts offloaded
as the file's blocks with their biases."""

from __future__ import annotations

import pytest
from engine_harness import ADMIN, LiveEngine

from moetray.engine.models.gguf_export import export_gguf


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory):
    from tiny_moe import make_tiny_moe

    root = tmp_path_factory.mktemp("gguf-gpt-oss-serve")
    src = make_tiny_moe(root / "src", "gpt_oss", hidden=256, expert_inter=256)
    experts_mxfp4 = lambda name: "MXFP4" if "_exps.weight" in name else "F16"  # noqa: E731
    return export_gguf(src, root / "tiny-gpt-oss-MXFP4.gguf", experts_mxfp4)[0]


def test_a_live_engine_serves_a_gpt_oss_gguf_with_its_experts_in_blocks(gpt_oss_gguf, tmp_path):
    engine = LiveEngine(gpt_oss_gguf, tmp_path, moe_capacity=8)
    try:
        with engine.client() as client:
            reply = client.post(
                "/v1/chat/completions",
                json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                      "temperature": 0},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] >= 1
            status = client.get("/admin/status", headers=ADMIN).json()
        assert status["model"]["architecture"] == "GptOssForCausalLM"
        assert status["experts"]["expert_store_format"] == "MXFP4+F32"
        assert status["experts"]["total_misses"] > 0
        engine.engine.pools.runtime.check_integrity(deep=True)
    finally:
        engine.close()
