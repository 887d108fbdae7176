"""Clients map moetray's refusals onto their own exception classes, from OpenAI's error shape.

The openai SDK maps on the status; litellm maps on the status and then the ``code`` (a
prompt over the context is ``ContextWindowExceededError``, not a generic error). Both are
driven against a live server; a body in another shape (an int ``code``, the kind in
``type``) fails these tests. litellm also gets tools and structured output right through its
OpenAI-compatible provider.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def litellm():
    """litellm, told to use its bundled model table (it would fetch one from the network)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        yield litellm


@pytest.fixture(scope="module")
def keyed(tiny_qwen3, tmp_path_factory):
    """An engine that wants an API key on /v1/*."""
    from engine_harness import LiveEngine

    engine = LiveEngine(tiny_qwen3, tmp_path_factory.mktemp("keyed"), api_key="sk-right")
    yield engine
    engine.close()


def _litellm_call(litellm, live, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("api_key", "unused")
    return litellm.completion(
        model="openai/default", api_base=f"{live.url}/v1", max_retries=0, num_retries=0, **kw
    )


def _too_long(live) -> list[dict]:
    return [{"role": "user", "content": "hello " * (live.engine.pools.ceiling.limit + 8)}]


def test_litellm_raises_its_own_class_for_each_refusal(live, keyed, litellm):
    with pytest.raises(litellm.ContextWindowExceededError):
        _litellm_call(litellm, live, messages=_too_long(live), max_tokens=1)
    with pytest.raises(litellm.BadRequestError) as bad:
        _litellm_call(
            litellm,
            live,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=1,
        )
    assert not isinstance(bad.value, litellm.ContextWindowExceededError)
    assert "tool_choice" in str(bad.value)
    with pytest.raises(litellm.NotFoundError):
        litellm.completion(
            model="openai/gpt-4o", api_base=f"{live.url}/v1", api_key="unused", messages=ASK, max_tokens=1
        )
    with pytest.raises(litellm.AuthenticationError):
        _litellm_call(litellm, keyed, api_key="sk-wrong", max_tokens=1)
    assert _litellm_call(litellm, keyed, api_key="sk-right", max_tokens=1).choices


def test_openai_sdk_classes_from_the_status_and_the_string_code(live, keyed):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="default", messages=_too_long(live), max_tokens=1)
    assert long.value.code == "context_length_exceeded" and long.value.param == "messages"
    assert long.value.body["type"] == "invalid_request_error" and long.value.body["retry"] == "never"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1)
    assert missing.value.code == "model_not_found" and missing.value.body["type"] == "not_found_error"
    wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong.models.list()
    assert denied.value.body["type"] == "authentication_error" and isinstance(denied.value.code, str)


def test_litellm_tools_and_structured_output(live, litellm):
    called = _litellm_call(
        litellm, live, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0
    )
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert called.choices[0].finish_reason == "tool_calls"
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 12}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    shaped = _litellm_call(
        litellm,
        live,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
        max_tokens=120,
        temperature=0,
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)
