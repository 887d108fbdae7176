"""``POST /v1/responses`` through the official ``openai`` SDK: text, tools, structured output, streaming."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_text_response_and_its_usage(client):
    r = client.responses.create(
        model="default", instructions="Be brief.", input="Hello", max_output_tokens=8, temperature=0
    )
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text == "".join(
        c.text for item in r.output if item.type == "message" for c in item.content
    )
    assert r.usage.output_tokens >= 1 and r.usage.input_tokens > 1
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_follow_openais_sequence_and_add_up(client):
    whole = client.responses.create(model="default", input="Hello", max_output_tokens=8, temperature=0)
    events = list(
        client.responses.create(
            model="default", input="Hello", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kind in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_forced_and_schema_valid(client, stream):
    kw = dict(
        model="default",
        input=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        output = events[-1].response.output
        streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    else:
        output = client.responses.create(**kw).output
        streamed = None
    (call,) = [item for item in output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    if streamed is not None:
        assert streamed == call.arguments


def test_tool_results_come_back_as_input_items(client, live):
    """A function_call and its function_call_output in ``input`` reach the prompt."""
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    plain = client.responses.create(model="default", input=items[:1], tools=[WEATHER], max_output_tokens=1)
    more = client.responses.create(model="default", input=items, tools=[WEATHER], max_output_tokens=1)
    assert more.usage.input_tokens > plain.usage.input_tokens


def test_structured_output_through_text_format(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    r = client.responses.create(
        model="default",
        input="Is it raining?",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="default", input="hi", previous_response_id="resp_1")
    assert err.value.body["code"] == "unsupported_parameter"
    assert err.value.body["param"] == "previous_response_id"
    kept = client.responses.create(model="default", input="hi", store=True, max_output_tokens=2)
    assert kept.store is False  # nothing is kept, and the reply says so
