"""The agent and structured-output libraries people point at a local server: langchain-openai and instructor.

Each drives the live engine through its own client code (tools bound, structured output
requested), and gets back objects it accepts: a tool call with arguments valid for the
function, a validated pydantic model.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field


class Weather(BaseModel):
    """Current weather for a city."""

    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


def test_langchain_bind_tools_and_structured_output(live):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="default",
        base_url=f"{live.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])
    structured = llm.with_structured_output(Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(structured, Weather)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_model(live, mode):
    import instructor
    import openai

    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0),
        mode=getattr(instructor.Mode, mode),
    )
    weather = client.chat.completions.create(
        model="default",
        response_model=Weather,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=200,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(weather, Weather)
