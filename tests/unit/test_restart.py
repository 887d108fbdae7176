"""Rules of the restart budget: back-off 1 s, 3 s, 10 s; at most 3 crashes per 10 minutes; it refills."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.restart import DEFAULT_BACKOFF_S, RestartBudget, RestartDecision


def test_three_crashes_restart_with_growing_back_off_and_the_fourth_is_final():
    budget = RestartBudget()
    assert [budget.on_crash(t) for t in (0.0, 5.0, 20.0)] == [
        RestartDecision(True, 1.0, 1), RestartDecision(True, 3.0, 2), RestartDecision(True, 10.0, 3)]
    assert budget.on_crash(40.0) == RestartDecision(False, None, 4)


def test_the_budget_refills_as_crashes_leave_the_window():
    budget = RestartBudget(window_s=600.0)
    for t in (0.0, 1.0, 2.0):
        assert budget.on_crash(t).restart
    assert budget.crashes(599.0) == 3
    # An hour later the old crashes no longer count: a new one is the first again.
    assert budget.on_crash(3600.0) == RestartDecision(True, 1.0, 1)


def test_a_crash_exactly_one_window_later_no_longer_counts():
    budget = RestartBudget(window_s=10.0, max_crashes=1)
    assert budget.on_crash(0.0).restart
    assert budget.on_crash(10.0) == RestartDecision(True, DEFAULT_BACKOFF_S[0], 1)


def test_a_user_start_resets_the_count():
    budget = RestartBudget(max_crashes=1)
    budget.on_crash(0.0)
    assert not budget.on_crash(1.0).restart
    budget.reset()
    assert budget.on_crash(2.0).restart


def test_no_budget_is_refused_by_name():
    with pytest.raises(ValueError):
        RestartBudget(backoff_s=())


@given(st.lists(st.floats(min_value=0, max_value=10_000, allow_nan=False), min_size=1, max_size=40))
def test_never_more_than_max_restarts_in_any_window(gaps):
    budget = RestartBudget()
    now, restarts = 0.0, []
    for gap in gaps:
        now += gap
        decision = budget.on_crash(now)
        if decision.restart:
            restarts.append(now)
            assert decision.delay_s in DEFAULT_BACKOFF_S
    for t in restarts:
        assert sum(1 for r in restarts if t <= r < t + budget.window_s) <= budget.max_crashes
