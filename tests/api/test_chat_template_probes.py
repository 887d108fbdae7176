"""What the engine learns from a checkpoint's chat template and sidecar reaches the live chat path.

A copy of the tiny checkpoint is given (1) a ``moetray.json`` sidecar (label, default top-k),
(2) an EOS that is *not* the turn terminator (the Yi / Gemma-2 shape: ``<|im_end|>`` ends a
turn, ``<|endoftext|>`` is EOS), and (3) a template with a validated ``reasoning_effort``.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from transformers import AutoTokenizer

EFFORT_TEMPLATE = (
    "{%- if reasoning_effort is defined and reasoning_effort %}"
    "{%- if reasoning_effort not in ['low', 'medium', 'high'] %}"
    "{{ raise_exception('unsupported reasoning effort') }}{%- endif %}"
    "{{ '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LABEL = "converted dense model (MoEfied), not a trained MoE"


@pytest.fixture(scope="module")
def probed(tiny_qwen3, tmp_path_factory):
    from engine_harness import LiveEngine

    folder = tmp_path_factory.mktemp("probed-ckpt") / "ckpt"
    shutil.copytree(tiny_qwen3, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.eos_token = "<|endoftext|>"
    tok.chat_template = EFFORT_TEMPLATE
    tok.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((folder / name).read_text())
        data["eos_token_id"] = tok.eos_token_id
        (folder / name).write_text(json.dumps(data))
    (folder / "moetray.json").write_text(json.dumps({"label": LABEL, "default_top_k": 1}))
    engine = LiveEngine(folder, tmp_path_factory.mktemp("probed"))
    yield engine, tok
    engine.close()


def chat(engine, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 4)
    body.setdefault("temperature", 0)
    return httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=60)


def test_sidecar_label_and_default_top_k_are_applied(probed):
    engine, _ = probed
    model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]
    assert model["label"] == LABEL
    status = engine.status()["model"]
    assert status["label"] == LABEL and status["top_k"] == 1
    runtime = engine.engine.pools.runtime
    assert runtime.top_k == 1
    routers = [m for m in engine.engine.served.loaded.model.modules() if type(m).__name__.endswith("Router")]
    assert routers and all(r.top_k == 1 for r in routers)


def test_a_single_token_turn_terminator_ends_the_reply_like_eos(probed):
    """The probed end of turn (<|im_end|>, not EOS here) stops generation; without it the model talks on."""
    engine, tok = probed
    assert engine.engine.served.chat.end_of_turn == "<|im_end|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in engine.engine.served.eos_ids
    forced = [
        *tok.encode("Hi there", add_special_tokens=False),
        im_end,
        *tok.encode(" and a tail", add_special_tokens=False),
    ]
    r = chat(engine, max_tokens=40, moetray_test_forced_tokens=forced)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hi there"
    assert choice["finish_reason"] == "stop"


def test_reasoning_effort_is_snapped_to_what_the_template_accepts(probed):
    engine, _ = probed
    assert [e.value for e in engine.engine.served.chat.effort.supported] == ["low", "medium", "high"]

    def prompt_tokens(**extra) -> int:
        r = chat(engine, **extra)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    bare = prompt_tokens()
    high = prompt_tokens(reasoning_effort="high")
    assert high > bare  # the template rendered the effort line
    assert prompt_tokens(reasoning_effort="xhigh") == high  # snapped down to the nearest gear
    assert prompt_tokens(reasoning_effort="low") != high
    assert prompt_tokens(chat_template_kwargs={"reasoning_effort": "low"}) == prompt_tokens(
        reasoning_effort="low"
    )


def test_an_effort_no_dialect_knows_is_a_400_before_anything_runs(probed):
    engine, _ = probed
    before = engine.status()["throughput"]["requests_served"]
    r = chat(engine, reasoning_effort="banana")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "reasoning_effort" in r.json()["error"]["message"]
    assert engine.status()["throughput"]["requests_served"] == before
