"""A GGUF served by name: `moetray serve --model ollama:NAME:TAG` (a real child process) reads the
Ollama blob in place, serves chat, and reports its quantized expert store; a live engine over a
GGUF file answers through the OpenAI routes; a name whose blob is gone is refused before serving."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from bounded import COLD_START_S
from engine_harness import ADMIN, LiveEngine
from test_serve_cli import child_env, free_port

from moetray.engine.models.gguf_export import export_gguf
from moetray.engine.models.precision import cpu_features
from moetray.policy.precision import native_16bit


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_moe import make_tiny_moe

    root = tmp_path_factory.mktemp("gguf-serve")
    return export_gguf(make_tiny_moe(root / "src", "qwen3_moe"), root / "tiny-Q8_0.gguf", "Q8_0")[0]


def _ollama_home(home: Path, gguf: Path | None, name: str = "tiny", tag: str = "q8") -> None:
    models = home / ".ollama" / "models"
    data = gguf.read_bytes() if gguf else b"missing"
    digest = hashlib.sha256(data).hexdigest()
    (models / "blobs").mkdir(parents=True, exist_ok=True)
    if gguf:
        (models / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "layers": [
                    {
                        "mediaType": "application/vnd.ollama.image.model",
                        "digest": f"sha256:{digest}",
                        "size": len(data),
                    }
                ],
            }
        )
    )


def _serve_cmd(model: str, port: int, tmp_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moetray.app.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--budget-bytes",
        "256M",
        "--kv-tokens",
        "1024",
        "--threads",
        "1",
        "--moe-capacity",
        "50%",
        "--outbox-dir",
        str(tmp_path / "out"),
        "--dtype",  # the file's own Q8_0 blocks in the store (auto would re-round them to int8)
        "float32",
    ]


def test_serve_by_ollama_name_reads_the_blob_in_place(tiny_gguf, tmp_path):
    _ollama_home(tmp_path / "home", tiny_gguf)
    env = {**child_env(tmp_path), "HOME": str(tmp_path / "home"), "MOETRAY_ADMIN_TOKEN": "t0ken"}
    env.pop("OLLAMA_MODELS", None)
    port = free_port()
    proc = subprocess.Popen(
        _serve_cmd("ollama:tiny:q8", port, tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        health, deadline = {}, time.monotonic() + COLD_START_S
        while time.monotonic() < deadline and health.get("state") not in ("serving", "failed"):
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        assert health.get("state") == "serving", f"engine never served the Ollama blob: {health}"
        status = httpx.get(
            f"http://127.0.0.1:{port}/admin/status", headers={"Authorization": "Bearer t0ken"}
        ).json()
        experts = status["experts"]
        assert experts["expert_store_format"] == "Q8_0"
        assert 0 < experts["expert_store_bytes"] < os.path.getsize(tiny_gguf)
        assert status["model"]["path"].startswith(str(tmp_path / "home" / ".ollama" / "models" / "blobs"))
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=60,
            json={
                "model": status["model"]["id"],
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)


def test_serve_refuses_a_name_whose_blob_is_gone(tmp_path):
    _ollama_home(tmp_path / "home", None, "gone", "latest")
    env = {**child_env(tmp_path), "HOME": str(tmp_path / "home")}
    env.pop("OLLAMA_MODELS", None)
    done = subprocess.run(
        _serve_cmd("ollama:gone:latest", free_port(), tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "unreadable_checkpoint" in done.stderr and "sha256-" in done.stderr


def test_a_live_engine_over_a_gguf_serves_openai_routes_with_experts_offloaded(tiny_gguf, tmp_path):
    """``--dtype auto`` on a Q8_0 file: weight-only int8 on bfloat16 activations where the CPU computes
    bfloat16 (the experts' blocks re-rounded per channel, about a byte a weight as in the file), else
    float32 with the blocks decoded per slot. Prevents: a quantized file served in float32, four bytes
    a weight, on a CPU that has the int8 kernel's arithmetic."""
    engine = LiveEngine(tiny_gguf, tmp_path, moe_capacity=8)
    int8 = "bfloat16" in native_16bit(cpu_features())
    try:
        with engine.client() as client:
            body = {"model": "default", "prompt": "Hello", "max_tokens": 6, "temperature": 0}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            status = client.get("/admin/status", headers=ADMIN).json()
        assert status["pools"]["moe_slots"] == 8
        served = status["model"]
        expected = ("int8", "bfloat16") if int8 else ("float32", "float32")
        assert (served["weights"], served["dtype"]) == expected
        assert status["experts"]["total_misses"] > 0
        assert status["experts"]["expert_store_format"] == ("INT8" if int8 else "Q8_0")
        assert status["model"]["architecture"] == "Qwen3MoeForCausalLM"
        engine.engine.pools.runtime.check_integrity(deep=True)
    finally:
        engine.close()


def test_a_live_engine_serves_a_qwen35moe_gguf_through_the_hybrid_path(tmp_path):
    """A Qwen3.5-MoE GGUF (Gated DeltaNet + attention) served over HTTP: its recurrent layers in the
    state pool, its experts quantized and a quarter resident; greedy completions, alone and four at
    once, equal transformers' generate on its own load of the file."""
    import concurrent.futures

    import torch
    from tiny_moe import make_tiny_moe
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = make_tiny_moe(tmp_path / "src", "qwen3_5_moe", num_layers=4)
    gguf = export_gguf(source, tmp_path / "q35.gguf", "Q8_0")[0]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    prompts = [tok.encode(f"Experts number {i} route tokens through the state pool.") for i in range(4)]

    def want(prompt: list[int]) -> str:
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        return tok.decode(out[0, len(prompt) :], skip_special_tokens=True)  # as the engine renders text

    engine = LiveEngine(gguf, tmp_path / "engine", moe_capacity=8, dtype="float32")  # the reference's
    try:
        def complete(prompt: list[int]) -> str:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            with engine.client() as client:
                reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        assert complete(prompts[0]) == want(prompts[0])
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, prompts)) == [want(p) for p in prompts]
        status = engine.wait_idle()
        assert status["model"]["architecture"] == "Qwen3_5MoeForCausalLM"
        assert status["pools"]["state_slots"] > 0 and status["pools"]["moe_slots"] == 8
        assert status["experts"]["expert_store_format"] == "Q8_0" and status["experts"]["total_misses"] > 0
        engine.engine.pools.runner.check_integrity()
    finally:
        engine.close()
