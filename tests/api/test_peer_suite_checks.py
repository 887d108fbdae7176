"""The model-independent checks a peer server's own suite makes (llama.cpp's server tests, issue 13).

llama.cpp's tests mostly match the text of one particular model; the checks kept here are
about the protocol alone, in our own words: malformed ``messages`` are a 400 in OpenAI's
shape, a stream keeps one id and names the role once, log-probability tokens spell out the
reply exactly (streamed or not), and a ``response_format`` or schema that cannot be
enforced is refused instead of ignored.
"""

from __future__ import annotations

import openai
import pytest

ASK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "string",
        [123],
        [{}],
        [{"role": 123}],
        [{"role": "system", "content": 123}],
        [{"role": "system", "content": "test"}, {}],
    ],
)
def test_malformed_messages_are_a_400_in_openais_shape(live, messages):
    import httpx

    r = httpx.post(
        f"{live.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=30
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


def test_a_stream_keeps_one_id_names_the_role_once_and_counts_its_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=ASK,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert len({c.id for c in chunks}) == 1
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    ends = [c for c in with_choices if c.choices[0].finish_reason is not None]
    assert len(ends) == 1 and ends[0] is with_choices[-1] and ends[0].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.completion_tokens == 8
    whole = client.chat.completions.create(model="default", messages=ASK, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_tokens_spell_out_the_reply(client, stream):
    kw = dict(model="default", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=10)
    if stream:
        text, entries = "", []
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].logprobs is not None:
                    entries += chunk.choices[0].logprobs.content or []
    else:
        reply = client.chat.completions.create(**kw)
        text, entries = reply.choices[0].message.content, reply.choices[0].logprobs.content
    assert len(entries) == 5
    assert "".join(e.token for e in entries) == text
    for e in entries:
        assert e.logprob <= 0.0 and e.bytes is not None and len(e.top_logprobs) == 10


@pytest.mark.parametrize(
    ("response_format", "code"),
    [
        ({"type": "sound"}, None),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": 123}}, None),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 123}}}, "invalid_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "hiccup"}}},
            "invalid_schema",
        ),
    ],
)
def test_a_format_that_cannot_be_enforced_is_refused(client, response_format, code):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=ASK, max_tokens=4, response_format=response_format
        )
    assert err.value.code == code
    assert code is not None or err.value.body["param"] == "response_format"
