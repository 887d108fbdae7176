"""policy.step_threads: one rule per test."""

import pytest

from moetray.policy.step_threads import (
    DECODE_STEP_TOKENS,
    ONE_THREAD_MAX_MACS,
    one_thread_tokens,
    step_threads,
)


def test_a_step_up_to_the_limit_runs_on_one_thread():
    assert step_threads(1, 2, one_thread_up_to=DECODE_STEP_TOKENS) == 1
    assert step_threads(96, 4, one_thread_up_to=96) == 1


def test_a_step_past_the_limit_keeps_the_budget():
    assert step_threads(DECODE_STEP_TOKENS + 1, 2, one_thread_up_to=DECODE_STEP_TOKENS) == 2
    assert step_threads(256, 16, one_thread_up_to=96) == 16


def test_without_the_rule_every_step_keeps_the_budget():
    assert step_threads(1, 2, one_thread_up_to=0) == 2


def test_a_budget_below_one_thread_is_refused():
    with pytest.raises(ValueError):
        step_threads(1, 0, one_thread_up_to=DECODE_STEP_TOKENS)


def test_a_narrow_model_prefills_short_prompts_on_one_thread():
    """The demo's width: a step's square projection stays small up to ~96 tokens."""
    assert one_thread_tokens(576) == ONE_THREAD_MAX_MACS // 576**2 == 96


def test_a_wide_model_keeps_one_thread_for_decode_steps_only():
    assert one_thread_tokens(2048) == DECODE_STEP_TOKENS
    assert one_thread_tokens(8192) == DECODE_STEP_TOKENS


def test_a_hidden_size_below_one_is_refused():
    with pytest.raises(ValueError):
        one_thread_tokens(0)
