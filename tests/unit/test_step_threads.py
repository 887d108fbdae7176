"""policy.step_threads: one rule per test."""

import pytest

from moetray.policy.step_threads import (
    DECODE_STEP_TOKENS,
    ONE_THREAD_MAX_MACS,
    TEAM_LEAVE_OTHERS_CORES,
    TEAM_LEAVE_WINDOW_S,
    TEAM_RETURN_OTHERS_CORES,
    TEAM_RETURN_WINDOW_S,
    TEAM_SPIN_COUNT,
    one_thread_tokens,
    openmp_defaults,
    openmp_workers_spin,
    others_load,
    step_threads,
    team_serves_decode,
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


def test_a_decode_step_on_the_team_keeps_the_budget():
    assert step_threads(1, 2, one_thread_up_to=96, on_team=True) == 2
    assert step_threads(DECODE_STEP_TOKENS, 4, one_thread_up_to=96, on_team=True) == 4


def test_a_short_prefill_on_the_team_keeps_the_budget():
    assert step_threads(DECODE_STEP_TOKENS + 1, 2, one_thread_up_to=96, on_team=True) == 2


def test_a_short_prefill_off_the_team_runs_on_one_thread():
    assert step_threads(DECODE_STEP_TOKENS + 1, 2, one_thread_up_to=96) == 1


def _team(others, *, cores=2, budget=2, spinning=True, on_team=False):
    return team_serves_decode(others, cores=cores, budget=budget, spinning=spinning, on_team=on_team)


def test_decode_steps_take_the_team_while_other_programs_leave_the_cores_free():
    assert _team(0.0) and _team(TEAM_RETURN_OTHERS_CORES)


def test_decode_steps_leave_the_team_when_another_program_keeps_a_core_busy():
    assert not _team(1.0, on_team=True)
    assert not _team(TEAM_LEAVE_OTHERS_CORES + 0.01, on_team=True)


def test_a_load_between_the_limits_keeps_the_choice_in_force():
    between = (TEAM_LEAVE_OTHERS_CORES + TEAM_RETURN_OTHERS_CORES) / 2
    assert _team(between, on_team=True) and not _team(between, on_team=False)


def test_cores_the_budget_leaves_free_are_the_other_programs_to_use():
    assert _team(2.0, cores=8, budget=6)
    assert not _team(2.0 + TEAM_LEAVE_OTHERS_CORES + 0.01, cores=8, budget=6, on_team=True)


def test_off_the_team_the_latest_load_decides():
    assert others_load(0.05, None, on_team=False) == 0.05
    assert others_load(0.05, 0.9, on_team=False) == 0.05  # an ended burst does not hold it back


def test_on_the_team_only_a_load_that_lasted_and_still_holds_counts():
    assert others_load(0.9, 0.05, on_team=True) == 0.05  # a noisy moment
    assert others_load(0.05, 0.9, on_team=True) == 0.05  # a burst that has ended
    assert others_load(1.0, 0.9, on_team=True) == 0.9


def test_the_latest_window_is_the_shorter():
    assert TEAM_RETURN_WINDOW_S < TEAM_LEAVE_WINDOW_S


def test_a_load_not_measured_yet_stays_unknown():
    assert others_load(None, None, on_team=False) is None
    assert others_load(None, None, on_team=True) is None


def test_an_unknown_load_keeps_decode_steps_on_one_thread():
    assert not _team(None)


def test_sleeping_workers_or_a_one_thread_budget_never_make_a_team():
    assert not _team(0.0, spinning=False)
    assert not _team(0.0, budget=1)


def test_the_engine_sets_a_short_spin_only_where_the_user_set_no_wait_policy():
    assert openmp_defaults(None) == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(TEAM_SPIN_COUNT)}
    assert openmp_defaults("ACTIVE") == {} and openmp_defaults("PASSIVE") == {}


def test_workers_spin_by_libgomps_rules():
    assert openmp_workers_spin("PASSIVE", str(TEAM_SPIN_COUNT))
    assert not openmp_workers_spin("PASSIVE", None) and not openmp_workers_spin("passive", "")
    assert not openmp_workers_spin(None, "0") and not openmp_workers_spin("ACTIVE", "00")
    assert openmp_workers_spin(None, None) and openmp_workers_spin("ACTIVE", None)
