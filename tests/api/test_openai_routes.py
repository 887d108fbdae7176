"""The OpenAI-compatible surface on a live server, driven by httpx and by the official ``openai`` client.

The tiny model has random weights: tests of reasoning / tool-call plumbing drive the real
engine with the documented forced-token test hook (``moetray_test_forced_text``), so the
tokens really flow through batching, detokenization and the parsers.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from engine_harness import ADMIN

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def resident(tiny_qwen3):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_qwen3)


def test_models_lists_the_served_checkpoint_with_its_label(live):
    """/v1/models names the model and the label the UI shows (a tray reads it verbatim)."""
    data = httpx.get(f"{live.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == [live.engine.model_id()]
    assert data[0]["label"] == live.engine.served.loaded.info.label
    assert data[0]["context_length"] == live.engine.pools.ceiling.limit


def test_greedy_completion_through_the_offloaded_engine_equals_resident_generate(live, resident):
    """Token identity end to end: HTTP → batcher → offloaded experts gives `generate`'s tokens (fp32)."""
    model, tok = resident
    prompt = tok.encode("The quick brown fox jumps over")
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0
    )
    ref_ids = ref[0, len(prompt) :].tolist()
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    out = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    shown = [t for t in ref_ids if t != 2]
    assert out["choices"][0]["text"] == tok.decode(shown, skip_special_tokens=False)
    assert out["usage"]["completion_tokens"] == len(ref_ids)
    assert out["choices"][0]["finish_reason"] == ("stop" if 2 in ref_ids else "length")


def test_streamed_chat_equals_the_whole_reply(client):
    """SSE deltas concatenate to exactly the non-streaming reply (same seed, same tokens)."""
    messages = [{"role": "user", "content": "Tell me about experts"}]
    whole = client.chat.completions.create(
        model="default", messages=messages, max_tokens=16, temperature=0.8, seed=11
    )
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=16,
        temperature=0.8,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_streamed_text_completion(live):
    """/v1/completions streams OpenAI text_completion chunks and ends with [DONE]."""
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_tool_call_reaches_the_openai_client_as_structured_tool_calls(client):
    """Hermes tool-call text from the engine becomes `tool_calls` with JSON arguments, finish tool_calls."""
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        max_tokens=200,
        temperature=0,
        extra_body={"moetray_test_forced_text": forced},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not choice.message.content


def test_streamed_tool_call_and_reasoning(client):
    """Streaming: reasoning_content and tool-call deltas arrive in order and assemble to the call."""
    forced = (
        "<think>I should call the tool.</think>"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER_TOOL],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"moetray_test_forced_text": forced},
    )
    reasoning, name, args, finish = [], None, [], None
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning.append(extra.get("reasoning_content") or "")
            for call in choice.delta.tool_calls or []:
                name = call.function.name or name
                args.append(call.function.arguments or "")
            finish = choice.finish_reason or finish
    assert "".join(reasoning) == "I should call the tool."
    assert name == "get_weather"
    assert json.loads("".join(args)) == {"city": "Oslo"}
    assert finish == "tool_calls"


def test_reasoning_is_split_from_the_answer(client):
    forced = "<think>pondering deeply</think>The answer is 4."
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "2+2?"}],
        max_tokens=200,
        temperature=0,
        extra_body={"moetray_test_forced_text": forced},
    )
    message = reply.choices[0].message
    assert message.content == "The answer is 4."
    assert (message.model_extra or {}).get("reasoning_content") == "pondering deeply"


def test_stop_string_cuts_the_text_and_ends_the_request_early(live, client):
    """A stop string ends the reply exactly before it; the request stops generating (pages freed)."""
    forced = "Hello there STOP and a very long tail that must never be generated " * 3
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=400,
        temperature=0,
        stop=["STOP"],
        extra_body={"moetray_test_forced_text": forced},
    )
    assert reply.choices[0].message.content == "Hello there "
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < len(live.engine.served.chat.encode(forced)) // 2


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_runs_to_max_tokens_past_the_models_eos(client, ignore_eos):
    """vLLM's ``ignore_eos``: the forced reply ends in EOS, yet the request runs to max_tokens."""
    forced = "Hello there"
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=24,
        temperature=0,
        extra_body={"moetray_test_forced_text": forced, "ignore_eos": ignore_eos},
    )
    choice = reply.choices[0]
    assert choice.message.content.startswith("Hello there")
    if ignore_eos:
        assert (choice.finish_reason, reply.usage.completion_tokens) == ("length", 24)
    else:
        assert choice.finish_reason == "stop" and reply.usage.completion_tokens < 24


def test_follow_up_turn_reports_cached_prompt_tokens(client):
    """A follow-up that repeats the conversation is served from the prefix cache (usage says so)."""
    history = [{"role": "user", "content": "Remember the word mixture " * 12}]
    first = client.chat.completions.create(model="default", messages=history, max_tokens=4, temperature=0)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Which word?"},
    ]
    second = client.chat.completions.create(model="default", messages=history, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens % live_page_size() == 0


def live_page_size() -> int:
    return 16


def noise_tokens(n: int, seed: int = 0) -> list[int]:
    """Varied ordinary token ids (no specials): diverse routing, so a throttled link really slows decode."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_closing_the_stream_cancels_the_request_and_frees_its_pages(slow):
    """A client that disconnects mid-stream ends its request: it leaves /admin/requests, its pages return."""
    body = {
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 900,
        "stream": True,
        "moetray_test_forced_tokens": noise_tokens(900),
    }
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 4:
                assert len(slow.status()["requests"]) == 1
                break  # leaving the iteration closes the connection: the client is gone
    snap = slow.wait_idle(timeout=20)
    assert snap["pools"]["kv_pages_used"] == 0
    assert snap["throughput"]["completion_tokens_total"] > 0


BAD_BODIES = [
    ('{"messages": [', "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("body", "mentions"), BAD_BODIES)
def test_malformed_requests_get_a_clear_400_and_change_nothing(live, body, mentions):
    """Bad JSON, wrong types, negative or absurd max_tokens: 400 in OpenAI's shape, engine untouched."""
    before = live.status()["throughput"]
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, str)
        else {"json": body}
    )
    r = httpx.post(f"{live.url}/v1/chat/completions", timeout=30, **kwargs)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert mentions in err["message"]
    after = live.status()["throughput"]
    assert after["requests_served"] == before["requests_served"]


def test_prompt_over_the_context_is_refused_with_the_exact_wording(live):
    limit = live.engine.pools.ceiling.limit
    prompt = [5] * (limit + 3)
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["kind"] == "context_length_exceeded"
    assert err["param"] == "prompt"  # the body field OpenAI names for the prompt
    assert err["message"] == f"prompt is too long: {limit + 3} tokens > {limit - 1} maximum"


def test_max_tokens_is_clamped_to_the_context_left(live):
    limit = live.engine.pools.ceiling.limit
    prompt = [5] * (limit - 3)
    out = httpx.post(
        f"{live.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 100, "temperature": 0},
        timeout=120,
    ).json()
    assert out["usage"]["completion_tokens"] <= 3


def test_generation_while_loading_is_503_with_the_gate_state(tiny_qwen3, start_engine):
    """A closed gate refuses generation with its state as the error type (never a hang, never a 200).

    The server is up before the model loads (the tray watches /health); here loading is held
    back so the window is deterministic, then released.
    """
    engine = start_engine(tiny_qwen3, load=False)
    r = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                   timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["kind"] == "loading"
    assert r.json()["error"]["retry"] == "later"
    assert httpx.get(f"{engine.url}/health").json()["state"] == "loading"
    engine.engine.start_loading()
    engine.wait_state({"serving"})
    r = httpx.post(f"{engine.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


def test_openapi_schema_is_served(live):
    schema = httpx.get(f"{live.url}/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    assert "/admin/cache/rebuild" in schema["paths"]


def test_admin_status_needs_the_token(live):
    assert httpx.get(f"{live.url}/admin/status").status_code == 401
    assert httpx.get(f"{live.url}/admin/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{live.url}/admin/status", headers=ADMIN).status_code == 200
