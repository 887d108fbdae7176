"""Every family's tool-call format as a grammar: what it forces is what the family's parser reads.

For each ``ToolCallFormat``: the calls ``policy.tool_prompt`` writes (the prompt's own
example of the format) are accepted by the grammar, and random tokens drawn under the
grammar's masks always end in text the parser turns into calls whose arguments validate
against the function's schema (``jsonschema``).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from example_tools import SCHEMAS, TIME, TIME_FUNCTION, WEATHER, WEATHER_FUNCTION
from tiny_moe import make_tokenizer

from moetray.engine.cb.grammar import GrammarCompiler, apply_token_bitmask, fill_token_bitmask
from moetray.engine.cb.tool_grammar import calls_lark, constraint_lark, text_then_calls, text_without_calls
from moetray.policy.parser import ToolCallFormat, ToolCallParser
from moetray.policy.tool_prompt import render_tool_calls

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(384)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, vocab_size=len(tok), eos_ids=[EOS])


def _calls_grammar(compiler, fmt, parallel=False):
    rules = calls_lark(fmt, [WEATHER_FUNCTION, TIME_FUNCTION], lit=compiler.literal, parallel=parallel)
    return compiler.compile(constraint_lark(body="calls", rules=rules, lit=compiler.literal))


@pytest.mark.parametrize("fmt", list(ToolCallFormat))
def test_the_prompts_example_of_a_call_is_what_the_grammar_forces(tok, compiler, fmt):
    text = render_tool_calls(fmt, [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}])
    matcher = _calls_grammar(compiler, fmt).matcher()
    assert matcher.consume_tokens(tok.encode(text)), matcher.get_error()
    assert matcher.is_accepting()


@pytest.mark.parametrize("fmt", list(ToolCallFormat))
def test_anything_drawn_under_the_mask_parses_to_a_schema_valid_call(tok, compiler, fmt):
    grammar = _calls_grammar(compiler, fmt)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(4):
        matcher, out = grammar.matcher(), []
        while True:
            assert len(out) < 400, tok.decode(out)
            logits = apply_token_bitmask(
                torch.randn(1, len(tok), generator=gen), fill_token_bitmask([matcher], len(tok))
            )
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if token == EOS:
                break
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
        text, calls = ToolCallParser(fmt, [WEATHER, TIME]).parse_complete(tok.decode(out))
        assert len(calls) == 1 and not text.strip(), tok.decode(out)
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def test_tool_choice_none_grammar_refuses_the_opener(tok, compiler):
    body, rules = text_without_calls(ToolCallFormat.HERMES, lit=compiler.literal)
    grammar = compiler.compile(constraint_lark(body=body, rules=rules, lit=compiler.literal))
    assert grammar.matcher().consume_tokens(tok.encode("plain words, no calls"))
    assert not grammar.matcher().consume_tokens(tok.encode('sure <tool_call>\n{"name": "get_time"'))


def test_a_reasoning_block_the_prompt_opened_is_let_finish_first(tok, compiler):
    rules = calls_lark(ToolCallFormat.HERMES, [TIME_FUNCTION], lit=compiler.literal, parallel=False)
    grammar = compiler.compile(
        constraint_lark(body="calls", rules=rules, reasoning_end="</think>", lit=compiler.literal)
    )
    text = (
        'let me see</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    matcher = grammar.matcher()
    assert matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()


def test_auto_without_parallel_calls_allows_text_then_at_most_one_call(tok, compiler):
    body, rules = text_then_calls(ToolCallFormat.HERMES, [TIME_FUNCTION], lit=compiler.literal)
    grammar = compiler.compile(constraint_lark(body=body, rules=rules, lit=compiler.literal))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for text in ("just text", f"let me check {call}"):
        matcher = grammar.matcher()
        assert matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting(), text
    assert not grammar.matcher().consume_tokens(tok.encode(f"{call}\n{call}"))
