"""What agents and structured-output clients need, through the official ``openai`` SDK on a live server.

Tools reach the prompt and are forced by grammar; ``response_format`` constrains the answer;
``logit_bias``, penalties, ``n`` and log-probabilities take effect; unknown models and
unreadable content are refused by name. The tiny model has random weights: constrained
outputs are checked with ``jsonschema`` against the very schemas that forced them, so the
test fails if the grammar stage is not applied (random text is never a valid call).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from example_tools import SCHEMAS, TIME, WEATHER

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="default", **kw)


# --- tools in the prompt ----------------------------------------------------------------------


def test_tools_reach_the_prompt_through_a_tool_block_in_the_familys_format(live, client):
    """The tiny ChatML template has no tool section: the engine writes one (Hermes, the family's
    format), so ``prompt_tokens`` grows and the prompt names the function and the call markup."""
    chat = live.engine.chat_support()
    assert not chat.template_renders_tools
    plain = _chat(client, max_tokens=1)
    with_tools = _chat(client, tools=[WEATHER], max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    prompt = chat.render(ASK, tools=[WEATHER])
    assert "get_weather" in prompt and "<tool_call>" in prompt


# --- tool_choice --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_forces_one_schema_valid_call(client, stream):
    """``required`` with ``parallel_tool_calls: false``: exactly one call, arguments valid for its schema."""
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    if not stream:
        choice = _chat(client, **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        finish = choice.finish_reason
    else:
        parts: dict[int, list[str]] = {}
        names: dict[int, str] = {}
        finish = None
        for chunk in _chat(client, stream=True, **kw):
            for ch in chunk.choices:
                for call in ch.delta.tool_calls or []:
                    names[call.index] = call.function.name or names.get(call.index)
                    parts.setdefault(call.index, []).append(call.function.arguments or "")
                finish = ch.finish_reason or finish
        calls = [(names[i], "".join(parts[i])) for i in sorted(parts)]
    assert finish == "tool_calls"
    assert len(calls) == 1
    name, arguments = calls[0]
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_function_is_the_call_made(client):
    choice = _chat(
        client,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
    ).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), SCHEMAS["get_time"])


def test_a_named_function_not_among_the_tools_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    body = err.value.body
    assert body["param"] == "tool_choice" and "nope" in body["message"]


def test_tool_choice_none_masks_the_opener(live, client):
    """``none``: the grammar stage runs (masks counted) with the opener excluded, and no call comes back."""
    before = live.engine.pools.runner.masks_computed()
    choice = _chat(client, tools=[WEATHER], tool_choice="none", max_tokens=6).choices[0]
    assert live.engine.pools.runner.masks_computed() > before
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")


# --- response_format --------------------------------------------------------------------------


def test_json_schema_output_validates_against_the_schema(client):
    schema = SCHEMAS["get_weather"]
    reply = _chat(
        client,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": schema, "strict": True},
        },
        max_tokens=200,
    )
    value = json.loads(reply.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert set(value) <= set(schema["properties"])  # strict: no extra keys


def test_json_object_output_is_a_json_object(client):
    reply = _chat(client, response_format={"type": "json_object"}, max_tokens=300, seed=3, temperature=0.7)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a JSON object's prefix
        assert reply.choices[0].message.content.startswith("{")


def test_an_unknown_response_format_is_refused_by_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, response_format={"type": "sound"})
    assert err.value.body["param"] == "response_format"


# --- sampling controls --------------------------------------------------------------------------


def _token_ids(live, entries) -> list[int]:
    """Token ids of chat log-probability entries, by their exact bytes."""
    vocab = live.engine.chat_support().grammars.vocab_size
    by_bytes = {b: t for t, b in enumerate(live.engine.chat_support().grammars.token_bytes(range(vocab)))}
    return [by_bytes[bytes(e.bytes)] for e in entries]


def test_logit_bias_bans_and_forces_tokens(client, live):
    kw = dict(max_tokens=6, logprobs=True)
    first = _token_ids(live, _chat(client, **kw).choices[0].logprobs.content)[0]
    banned = _chat(client, logit_bias={str(first): -100}, **kw).choices[0].logprobs.content
    assert _token_ids(live, banned)[0] != first
    forced_id = live.engine.chat_support().encode("x")[0]
    forced = client.completions.create(
        model="default", prompt="Hello there", max_tokens=5, temperature=0, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == "x" * 5


def test_penalties_change_a_repetitive_greedy_output(client):
    """A random model's greedy text repeats; frequency and presence penalties break the repetition."""
    base = client.completions.create(model="default", prompt="Tell me", max_tokens=40, temperature=0)
    penalised = client.completions.create(
        model="default",
        prompt="Tell me",
        max_tokens=40,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    assert penalised.choices[0].text != base.choices[0].text
    assert len(set(penalised.choices[0].text)) >= len(set(base.choices[0].text))


def test_logit_bias_outside_the_vocabulary_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt="x", max_tokens=2, logit_bias={"999999": 5})
    assert err.value.body["param"] == "logit_bias"


def test_a_vocabulary_padded_past_the_tokenizer_is_biased_and_masked_over_every_logit(
    tiny_qwen3, start_engine, tmp_path
):
    """Real checkpoints pad the output layer past the tokenizer (Qwen3: 151 936 logits, 151 669
    tokens). Bias and grammar masks span the model's logits, not the tokenizer's length: a
    padding id is a valid ``logit_bias`` key, and a schema still forces schema-valid output."""
    import shutil

    from tiny_moe import make_tokenizer

    padded = tmp_path / "padded"
    shutil.copytree(tiny_qwen3, padded)
    make_tokenizer(320).save_pretrained(padded)  # 320 tokens under a 384-logit head
    engine = start_engine(padded)
    c = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="x", max_retries=0)
    assert _chat(c, max_tokens=2, logit_bias={"383": -100}).choices
    schema = SCHEMAS["get_time"]
    shaped = _chat(
        c,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        max_tokens=120,
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)


# --- n ---------------------------------------------------------------------------------------------


def test_n_choices_are_indexed_and_prefilled_once(live, client):
    """``n=2``: two choices (seeded, so different and repeatable); the second starts after the first's
    prefill and finds every full page of the prompt in the prefix cache (submitted together, the
    second would recompute the pages still being prefilled)."""
    messages = [{"role": "user", "content": "A prompt long enough to fill one page of the KV pool, " * 2}]
    cached_before = live.engine.telemetry.cached_prompt_tokens_total
    reply = _chat(client, messages=messages, n=2, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    page, prompt = live.engine.options.page_size, reply.usage.prompt_tokens
    cached = live.engine.telemetry.cached_prompt_tokens_total - cached_before
    assert cached >= (prompt - 1) // page * page  # every full page of the prompt, for the second choice
    again = _chat(client, messages=messages, n=2, max_tokens=8, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    indexes = set()
    for chunk in _chat(client, messages=messages, n=2, max_tokens=4, stream=True):
        indexes |= {c.index for c in chunk.choices}
    assert indexes == {0, 1}


# --- log-probabilities --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_one_entry_per_token(client, stream):
    kw = dict(max_tokens=6, logprobs=True, top_logprobs=3, messages=[{"role": "user", "content": "hi"}])
    if stream:
        entries, usage = [], None
        for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kw):
            usage = chunk.usage or usage
            for ch in chunk.choices:
                entries += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
        completion_tokens = usage.completion_tokens
    else:
        reply = _chat(client, **kw)
        entries, completion_tokens = reply.choices[0].logprobs.content, reply.usage.completion_tokens
    assert len(entries) == completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the top token is taken
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_shape(live, stream):
    body = {
        "model": "default",
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 2,
        "stream": stream,
    }
    if stream:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        text = ""
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    text += ch["text"]
                    for k in lp:
                        lp[k] += (ch["logprobs"] or {}).get(k, [])
    else:
        ch = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        lp, text = ch["logprobs"], ch["text"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) >= 1
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
    assert text  # the tokens behind the logprobs made text


def test_logprobs_leave_greedy_tokens_unchanged(client):
    """Asking for log-probabilities runs the stages but picks the same greedy tokens."""
    plain = client.completions.create(model="default", prompt="The experts", max_tokens=10, temperature=0)
    with_lp = client.completions.create(
        model="default", prompt="The experts", max_tokens=10, temperature=0, logprobs=1
    )
    assert with_lp.choices[0].text == plain.choices[0].text


# --- models and content -----------------------------------------------------------------------


def test_models_by_name_and_unknown_models(live, client):
    served = live.engine.model_id()
    assert client.models.retrieve(served).id == served
    assert client.models.retrieve("default").id == served
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found" and served in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1)


def test_model_aliases_and_any_model(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, model_aliases=("gpt-4o-mini",))
    c = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="x", max_retries=0)
    assert c.chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=1).choices
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1)
    anyone = start_engine(tiny_qwen3, accept_any_model=True)
    c = openai.OpenAI(base_url=f"{anyone.url}/v1", api_key="x", max_retries=0)
    assert c.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1).choices


def test_image_content_is_refused_not_dropped(client):
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, messages=[{"role": "user", "content": parts}], max_tokens=1)
    assert err.value.body["code"] == "unsupported_content"


def test_docs_are_served_offline_and_hide_the_test_fields(live):
    page = httpx.get(f"{live.url}/docs").text
    assert "cdn." not in page and "unpkg" not in page
    for src in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert httpx.get(f"{live.url}/static-offline-docs/{src}").status_code == 200
    schema = httpx.get(f"{live.url}/openapi.json").text
    assert "moetray_test_forced" not in schema
    assert "/v1/responses" in schema and "/v1/models/{model}" in schema
