"""The parsers against turns written by real checkpoints' chat templates.

A parser validated only against text its own tests wrote is validated against nothing:
here each family's real template (``tests/data/templates``, provenance in SOURCES.md)
serializes an assistant turn with reasoning and a tool call, exactly as the model was
trained to write it, and the parsers must recover the reasoning and the call. The
generation prompts of the same templates decide ``prompt_opens_reasoning``.
"""

from __future__ import annotations

import pytest
from chat_templates import real, renderer

from moetray.policy.detokenize import IncrementalDetokenizer
from moetray.policy.parser import (
    Delta,
    ReasoningFormat,
    ReasoningParser,
    ToolCall,
    ToolCallFormat,
    ToolCallParser,
    fold_events,
    prompt_opens_reasoning,
)

SPECIALS = {
    "meta-llama-Llama-3.1-8B-Instruct": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": dict(bos_token="<s>", eos_token="</s>"),
    "openai-gpt-oss-120b": dict(bos_token="<|startoftext|>", eos_token="<|return|>"),
    "google-gemma-4-31B-it": dict(bos_token="<bos>", eos_token="<eos>"),
    "deepseek-ai-DeepSeek-V3.1": dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>"),
}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find a postal code.",
    "parameters": {"type": "object", "required": ["zip"],
                   "properties": {"zip": {"type": "string"}, "n": {"type": "integer"}}}}}]
USER = [{"role": "user", "content": "Where is 018956?"}]
CALL = {"type": "function", "id": "abcDEF123",
        "function": {"name": "lookup", "arguments": {"zip": "018956", "n": 3}}}
THOUGHT = "I should look it up."
EXPECTED_CALL = ToolCall(0, "lookup", '{"zip": "018956", "n": 3}')


def render(name: str):
    return renderer(real(name), **SPECIALS.get(name, {}))


def assistant_turn(name: str, end: str, keep_end: bool = False, **kwargs) -> tuple[str, str]:
    """``(generation prompt, the assistant turn the template writes after it)``, cut at ``end``."""
    r = render(name)
    prompt = r(USER, tools=TOOLS, add_generation_prompt=True, **kwargs)
    message = {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [CALL]}
    full = r([*USER, message, {"role": "tool", "tool_call_id": "abcDEF123", "content": "Singapore"}],
             tools=TOOLS, **kwargs)
    assert full.startswith(prompt), name
    turn = full[len(prompt):]
    cut = turn.index(end) + (len(end) if keep_end else 0)
    return prompt, turn[:cut]


def parse(turn: str, prompt: str, rfmt: ReasoningFormat | None, tfmt: ToolCallFormat, step: int = 3):
    """Stream ``turn`` in ``step``-character chunks through reasoning then tool parsing."""
    reasoning, events = [], []
    rp = ReasoningParser(rfmt, prompt_opens_reasoning(rfmt, prompt), tool_format=tfmt) if rfmt else None
    tp = ToolCallParser(tfmt, TOOLS)
    for i in range(0, len(turn), step):
        d = rp.push(turn[i:i + step]) if rp else Delta("", turn[i:i + step])
        reasoning.append(d.reasoning)
        events += tp.push(d.content)
    if rp:
        d = rp.flush()
        reasoning.append(d.reasoning)
        events += tp.push(d.content)
    events += tp.flush()
    return "".join(reasoning), fold_events(events)


@pytest.mark.parametrize(("name", "rfmt", "tfmt", "end", "keep_end", "reasoning"), [
    ("Qwen-Qwen3-0.6B", ReasoningFormat.QWEN3, ToolCallFormat.HERMES, "<|im_end|>", False, THOUGHT),
    ("meta-llama-Llama-3.1-8B-Instruct", None, ToolCallFormat.LLAMA3, "<|eot_id|>", False, ""),  # bare JSON
    ("mistralai-Mistral-Nemo-Instruct-2407", None, ToolCallFormat.MISTRAL, "</s>", False, ""),
    ("openai-gpt-oss-120b", ReasoningFormat.GPT_OSS, ToolCallFormat.GPT_OSS, "<|call|>", True, THOUGHT),
])
def test_a_call_written_by_the_real_template_is_recovered(name, rfmt, tfmt, end, keep_end, reasoning):
    # If our description of a family's wire format drifted from the template, this call is lost.
    prompt, turn = assistant_turn(name, end, keep_end)
    assert parse(turn, prompt, rfmt, tfmt) == (reasoning, ("", [EXPECTED_CALL]))


def test_gemma4_thought_written_by_the_real_template_is_split():
    # Gemma 4 keeps the thought in history before a tool call; its call grammar
    # (``<|tool_call>call:NAME{…}``) is not one of ours, so the turn is cut where it starts.
    prompt, turn = assistant_turn("google-gemma-4-31B-it", "<|tool_call>", enable_thinking=True)
    assert turn.startswith("<|channel>thought")
    parser = ReasoningParser(ReasoningFormat.GEMMA4, prompt_opens_reasoning(ReasoningFormat.GEMMA4, prompt))
    assert parser.parse_complete(turn) == Delta(THOUGHT, "")


@pytest.mark.parametrize(("name", "fmt", "kwargs", "opens"), [
    ("Qwen-Qwen3-0.6B", ReasoningFormat.QWEN3, {}, False),  # the model prints <think> itself
    ("Qwen-Qwen3-0.6B", ReasoningFormat.QWEN3, {"enable_thinking": False}, False),  # empty block closed
    ("HuggingFaceTB-SmolLM3-3B", ReasoningFormat.QWEN3, {"enable_thinking": False}, False),
    ("deepseek-ai-DeepSeek-V3.1", ReasoningFormat.QWEN3, {"thinking": True}, True),  # prompt ends in <think>
    ("deepseek-ai-DeepSeek-V3.1", ReasoningFormat.QWEN3, {"thinking": False}, False),
    ("google-gemma-4-31B-it", ReasoningFormat.GEMMA4, {}, False),  # an empty thought channel, closed
    ("google-gemma-4-31B-it", ReasoningFormat.GEMMA4, {"enable_thinking": True}, False),
    ("openai-gpt-oss-120b", ReasoningFormat.GPT_OSS, {}, False),
])
def test_real_generation_prompts_decide_whether_reasoning_is_open(name, fmt, kwargs, opens):
    prompt = render(name)(USER, add_generation_prompt=True, **kwargs)
    assert prompt_opens_reasoning(fmt, prompt) is opens


def test_the_engine_pipeline_detokenize_then_reason_then_call():
    # The way the engine wires them: token ids → safe text → reasoning/content → text/calls.
    from tiny_moe import make_tokenizer

    tok = make_tokenizer(384)
    prompt, turn = assistant_turn("Qwen-Qwen3-0.6B", "<|im_end|>")
    ids = tok.encode(turn + "<|im_end|>", add_special_tokens=False)
    det = IncrementalDetokenizer(lambda i: tok.decode(i, skip_special_tokens=False),
                                 special_ids=tok.all_special_ids)
    rp = ReasoningParser(ReasoningFormat.QWEN3, prompt_opens_reasoning(ReasoningFormat.QWEN3, prompt),
                         tool_format=ToolCallFormat.HERMES)
    tp = ToolCallParser(ToolCallFormat.HERMES, TOOLS)
    reasoning, events = [], []
    for text in [det.push(i) for i in ids] + [det.finish()]:
        d = rp.push(text)
        reasoning.append(d.reasoning)
        events += tp.push(d.content)
    d = rp.flush()
    events += tp.push(d.content) + tp.flush()
    assert "".join(reasoning) + d.reasoning == THOUGHT
    assert fold_events(events) == ("", [EXPECTED_CALL])
