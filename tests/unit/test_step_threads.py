"""policy.step_threads: one rule per test."""

import pytest

from moetray.policy.step_threads import DECODE_STEP_TOKENS, step_threads


def test_a_decode_step_runs_on_one_thread():
    assert step_threads(1, 2, single_thread_decode=True) == 1
    assert step_threads(DECODE_STEP_TOKENS, 4, single_thread_decode=True) == 1


def test_a_prefill_chunk_keeps_the_budget():
    assert step_threads(DECODE_STEP_TOKENS + 1, 2, single_thread_decode=True) == 2
    assert step_threads(256, 16, single_thread_decode=True) == 16


def test_without_the_rule_every_step_keeps_the_budget():
    assert step_threads(1, 2, single_thread_decode=False) == 2


def test_a_budget_below_one_thread_is_refused():
    with pytest.raises(ValueError):
        step_threads(1, 0, single_thread_decode=True)
