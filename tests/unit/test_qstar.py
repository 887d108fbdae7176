"""Rules of the q* split between fetching misses over the link and computing them on the CPU."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.moe.expert_cache import ExpertCache
from moetray.policy.moe.qstar import (
    Q16,
    QStarPolicy,
    QStarRefused,
    balanced_fetch,
    fetch_fraction,
    recommend_backend,
)


@pytest.mark.parametrize("f", [0.1, 0.415, 0.454, 0.7, 1.0, 0.0, 0.5])
def test_split_adds_up_and_stays_within_one_expert_of_the_fraction(f):
    for missing in range(65):
        fetch, cpu = QStarPolicy.from_fraction(f).split(missing)
        assert fetch + cpu == missing and 0 <= fetch <= missing
        assert abs(fetch - f * missing) <= 1, (f, missing, fetch)


def test_split_is_balanced_not_ceiled():
    # ceil(0.415 · 3) = 2 would leave the link as the slow side; the balanced choice is 1.
    policy = QStarPolicy.from_fraction(0.415)
    assert policy.split(3) == (1, 2)
    assert policy.split(4) == (2, 2)


@given(q16=st.integers(0, Q16), missing=st.integers(0, 500))
def test_balanced_fetch_minimises_the_slower_side(q16, missing):
    # The rule itself: no other integer split finishes the overlapped step sooner.
    fetch = balanced_fetch(missing, q16)

    def slower(n):
        return max(n * (Q16 - q16), (missing - n) * q16)

    assert all(slower(fetch) <= slower(n) for n in range(missing + 1))
    assert abs(fetch * Q16 - q16 * missing) <= Q16


def test_full_fraction_fetches_everything_and_zero_nothing():
    assert QStarPolicy.from_fraction(1.0).split(9) == (9, 0)
    assert QStarPolicy.from_fraction(0.0).split(9) == (0, 9)


def test_fraction_is_clamped_and_kept_in_q16():
    assert QStarPolicy.from_fraction(1.7).fraction == 1.0
    assert QStarPolicy.from_fraction(-0.2).fraction == 0.0
    assert QStarPolicy.from_fraction(0.25).q16 == Q16 // 4


def test_fixed_cap():
    assert QStarPolicy.fixed_cap(0).split(9) == (0, 9)
    one = QStarPolicy.fixed_cap(1)
    assert one.split(8) == (1, 7) and one.split(0) == (0, 0) and one.fraction is None
    assert QStarPolicy.fixed_cap().cap == 1  # unbenchmarked default


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.5", None, True])
def test_fraction_refuses_non_numbers(bad):
    with pytest.raises(QStarRefused) as err:
        QStarPolicy.from_fraction(bad)
    assert err.value.kind == "invalid_fraction"


def test_cap_and_missing_refusals():
    for bad in (-1, 1.5, True):
        with pytest.raises(QStarRefused) as err:
            QStarPolicy.fixed_cap(bad)
        assert err.value.kind == "invalid_cap"
    with pytest.raises(QStarRefused) as err:
        QStarPolicy.from_fraction(0.5).split(-1)
    assert err.value.kind == "invalid_missing"


def test_recommend_backend_needs_a_real_margin():
    assert recommend_backend(100, 40) == "hybrid"
    assert recommend_backend(60, 40) == "offload"
    assert recommend_backend(80, 40) == "offload"  # exactly 2× is not a margin
    assert recommend_backend(80, 40, threshold=1.5) == "hybrid"


@pytest.mark.parametrize("cpu,link", [(None, 40), (100, None), (0, 40), (100, -1), (float("nan"), 4)])
def test_unknown_bandwidth_never_recommends_hybrid(cpu, link):
    assert recommend_backend(cpu, link) == "offload"


def test_fetch_fraction_from_bandwidths():
    assert fetch_fraction(40, 100, overlapped=False) == pytest.approx(0.4)
    assert fetch_fraction(30, 90) == pytest.approx(0.25)
    assert fetch_fraction(40, 10, overlapped=False) == 1.0
    assert fetch_fraction(25, 50) == pytest.approx(1 / 3)
    assert fetch_fraction(0, 40) is None and fetch_fraction(40, None) is None


def test_policy_plugs_into_the_planner_as_a_fetch_limit():
    # The planner asks q* after counting misses; fetched + bypassed is every miss.
    cache = ExpertCache(1, 16, 16)
    plan = cache.ensure(0, range(8), fetch_limit=QStarPolicy.from_fraction(0.25).fetch_count)
    assert (plan.fetched, len(plan.bypassed)) == (2, 6)
