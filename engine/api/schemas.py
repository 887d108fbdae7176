"""Request bodies of the OpenAI routes, described once for validation and the OpenAPI schema.

Shapes follow OpenAI's API; unknown extra fields are accepted and ignored, as OpenAI's
clients send fields a local server need not know. Fields whose meaning depends on other
fields (``tool_choice``, ``response_format``, ``logit_bias``) are checked in ``controls``,
so a refusal names the field (``param``) the way OpenAI does. The test-only fields are
hidden from the public schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic.json_schema import SkipJsonSchema

from moetray.engine.api.fields import WHOLE_NUMBER
from moetray.engine.budget import MAX_TOKENS_CEILING

MAX_CHOICES = 8
"""Largest ``n``: choices share one prefill, but each decodes on its own."""
MAX_TOP_LOGPROBS = 20
"""Largest ``top_logprobs`` (and completions' ``logprobs``), OpenAI's chat limit."""

# The whole integer fields (see ``fields``: bounds before ``WHOLE_NUMBER``).
TokenLimit = Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_CEILING), WHOLE_NUMBER]
"""``max_tokens`` and its Chat (``max_completion_tokens``) and Responses spellings."""
Seed = Annotated[int, Strict(), Field(ge=-(1 << 63), le=(1 << 63) - 1), WHOLE_NUMBER]
"""A signed 64-bit seed."""
ChoiceCount = Annotated[int, Strict(), Field(ge=1, le=MAX_CHOICES), WHOLE_NUMBER]
TopLogprobs = Annotated[int, Strict(), Field(ge=0, le=MAX_TOP_LOGPROBS), WHOLE_NUMBER]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: ToolFunction


class GenerationFields(BaseModel):
    """Fields shared by the generation routes."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenLimit | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: ChoiceCount = 1
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, StrictFloat] | None = None
    # vLLM's extension: generate exactly max_tokens, past EOS and the end-of-turn marker.
    ignore_eos: StrictBool = False
    # Test hook (honoured only when the engine runs with --test-hooks): the real engine
    # emits exactly these ids, or the encoding of this text, then EOS.
    moetray_test_forced_tokens: SkipJsonSchema[list[StrictInt] | None] = None
    moetray_test_forced_text: SkipJsonSchema[StrictStr | None] = None


class ChatRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenLimit | None = None
    tools: list[Tool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    response_format: dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    reasoning_effort: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(GenerationFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] = ""
    echo: StrictBool = False
    logprobs: TopLogprobs | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's Responses API (what Codex CLI and the agents SDK speak)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: TokenLimit | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    reasoning: dict[str, Any] | None = None
    moetray_test_forced_text: SkipJsonSchema[StrictStr | None] = None
