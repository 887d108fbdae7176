"""The sampling stages on a real tiny MoE through transformers' own batcher.

Penalties, bias, grammar masks and log-probabilities act per request: a constrained or
penalised row beside plain greedy rows leaves their tokens equal to ``generate``'s; a step
of plain greedy rows still skips the processors; each grammar-forced output parses.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from test_cb_runner import EOS, greedy_reference, make_runner, prompt_ids, run_all

from moetray.engine.cb import GrammarCompiler, Sampling, json_item, needs_processors, sampling_kwargs
from moetray.engine.cb.tool_grammar import constraint_lark

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
}


@pytest.fixture(scope="module")
def grammars(tiny):
    model, tok = tiny
    return GrammarCompiler(tok, vocab_size=model.config.vocab_size, eos_ids=[EOS])


def _kwargs(sampling: Sampling) -> dict:
    return sampling_kwargs(sampling, prompt_len=5, eos=EOS)


def test_every_new_control_needs_the_processors(grammars):
    grammar = grammars.compile(constraint_lark(body=json_item(SCHEMA), lit=grammars.literal))
    for s in (
        Sampling(temperature=0.0, presence_penalty=0.5),
        Sampling(temperature=0.0, frequency_penalty=-0.5),
        Sampling(temperature=0.0, logit_bias=((5, 3.0),)),
        Sampling(temperature=0.0, logprobs=0),
        Sampling(temperature=0.0, grammar=grammar),
    ):
        assert needs_processors(_kwargs(s)), s
    assert not needs_processors(_kwargs(Sampling(temperature=0.0)))


async def test_stages_act_per_row_and_leave_greedy_neighbours_equal_to_generate(tiny, grammars):
    """A grammar row, a penalised row and a logprobs row beside plain greedy rows: the greedy rows
    still get ``generate``'s tokens; the grammar row's text validates; every logprobs entry is one token."""
    model, tok = tiny
    greedy = [prompt_ids(tok, f"Plain greedy {i}") for i in range(2)]
    refs = [greedy_reference(model, p, 10) for p in greedy]
    grammar = grammars.compile(constraint_lark(body=json_item(SCHEMA), lit=grammars.literal))
    runner = make_runner(model, policy="off")
    try:
        masks0 = runner.masks_computed()
        jobs = {f"g{i}": (p, 10, Sampling(temperature=0.0)) for i, p in enumerate(greedy)}
        jobs["json"] = (prompt_ids(tok, "json please"), 80, Sampling(temperature=0.0, grammar=grammar))
        jobs["lp"] = (prompt_ids(tok, "logprobs please"), 6, Sampling(temperature=0.0, logprobs=2))
        finals = await run_all(runner, jobs)
        taken = list(runner.logprobs("lp"))
        masks = runner.masks_computed() - masks0
        for rid in jobs:
            runner.forget(rid)
        assert runner.logprobs("lp") is None  # released with the reply
    finally:
        runner.stop()
    for i, ref in enumerate(refs):
        assert finals[f"g{i}"].generated_tokens == ref
    out = finals["json"].generated_tokens
    assert out[-1] == EOS and masks == len(out)
    jsonschema.validate(json.loads(tok.decode(out[:-1])), SCHEMA)
    lp_tokens = finals["lp"].generated_tokens
    assert [e.token for e in taken] == lp_tokens
    for e in taken:
        assert len(e.top) == 2 and e.top[0][0] == e.token  # greedy takes the most likely token
        assert math.isclose(e.logprob, e.top[0][1]) and e.logprob <= 0


async def test_penalties_and_bias_change_what_greedy_picks(tiny):
    model, tok = tiny
    ids = prompt_ids(tok, "Repeat after me")
    runner = make_runner(model, policy="off")
    try:
        plain = (await run_all(runner, {"p": (ids, 30, Sampling(temperature=0.0))}))["p"].generated_tokens
        banned = plain[0]
        jobs = {
            "pen": (ids, 30, Sampling(temperature=0.0, frequency_penalty=2.0)),
            "ban": (ids, 30, Sampling(temperature=0.0, logit_bias=((banned, -100.0),))),
            "force": (ids, 4, Sampling(temperature=0.0, logit_bias=((7, 100.0), (9, 100.0)))),
        }
        finals = await run_all(runner, jobs)
    finally:
        runner.stop()
    assert len(set(plain)) < len(plain)  # a random model's greedy output repeats
    assert finals["pen"].generated_tokens != plain
    assert len(set(finals["pen"].generated_tokens)) > len(set(plain))
    assert banned not in finals["ban"].generated_tokens
    assert set(finals["force"].generated_tokens) <= {7, 9}


async def test_a_greedy_constrained_step_runs_its_mask_and_nothing_else(tiny, grammars):
    """Greedy rows under a grammar: the grammar stage runs every step, temperature and the draw never
    (the stock argmax over the masked scores picks what the draw would); the output still validates."""
    model, tok = tiny
    grammar = grammars.compile(constraint_lark(body=json_item(SCHEMA), lit=grammars.literal))
    runner = make_runner(model, policy="off")
    try:
        processors = runner.manager.logit_processor
        before = list(processors.stage_runs)
        out = await run_all(
            runner, {"j": (prompt_ids(tok, "only json"), 80, Sampling(temperature=0.0, grammar=grammar))}
        )
        runs = [a - b for a, b in zip(processors.stage_runs, before, strict=True)]
    finally:
        runner.stop()
    tokens = out["j"].generated_tokens
    assert runs[processors.GRAMMAR] == len(tokens)
    assert runs[processors.DRAW] == runs[processors.TEMPERATURE] == runs[processors.PENALTY] == 0
    jsonschema.validate(json.loads(tok.decode(tokens[:-1])), SCHEMA)
