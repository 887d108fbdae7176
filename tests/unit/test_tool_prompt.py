"""policy.tool_prompt: the tool block and earlier calls, written in each family's own format."""

from __future__ import annotations

import copy
import json

import pytest

from moetray.policy.parser import ToolCallFormat, ToolCallParser
from moetray.policy.tool_prompt import EXAMPLE_CALL, render_tool_calls, tool_system_block, with_tool_block

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "get_time", "arguments": '{"zone": "UTC"}'},
]


@pytest.mark.parametrize("fmt", list(ToolCallFormat))
def test_rendered_calls_parse_back_to_the_same_calls(fmt):
    _, calls = ToolCallParser(fmt, None).parse_complete(render_tool_calls(fmt, CALLS))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"zone": "UTC"}),
    ]


@pytest.mark.parametrize("fmt", list(ToolCallFormat))
def test_the_block_lists_the_tools_and_shows_the_format(fmt):
    block = tool_system_block(fmt, [TOOL])
    assert json.dumps(TOOL) in block
    assert render_tool_calls(fmt, [EXAMPLE_CALL]) in block


def test_the_block_leads_an_existing_system_turn_or_becomes_one():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    before = copy.deepcopy(messages)
    out = with_tool_block(messages, ToolCallFormat.HERMES, [TOOL])
    assert messages == before  # the input is not mutated
    assert out[0]["role"] == "system" and out[0]["content"].endswith("Be brief.")
    assert "get_weather" in out[0]["content"] and len(out) == 2
    out = with_tool_block(messages[1:], ToolCallFormat.HERMES, [TOOL])
    assert [m["role"] for m in out] == ["system", "user"]


def test_earlier_calls_and_results_are_written_for_a_template_without_tool_roles():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = with_tool_block(messages, ToolCallFormat.HERMES, [TOOL])
    assert out[2]["content"] == render_tool_calls(
        ToolCallFormat.HERMES, [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    )
    assert "tool_calls" not in out[2]
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
