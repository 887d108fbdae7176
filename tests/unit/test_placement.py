"""Rules for choosing which MoE layers run on the CPU."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.moe.placement import (
    PlacementRefused,
    auto_cpu_layers,
    parse_cpu_layers_spec,
    spread_layers,
)

GIB = 1 << 30


@pytest.mark.parametrize("spec,expected", [
    ("3,7,11", {3, 7, 11}), (" 3 , 7 ", {3, 7}), ("5,", {5}), ("", set()), (None, set()),
    ("8", {0, 5, 10, 15, 20, 25, 30, 35}), ("0", set()),
])
def test_specs(spec, expected):
    assert parse_cpu_layers_spec(spec, 40) == expected


def test_fraction_rounds_half_to_even_then_spreads():
    assert len(parse_cpu_layers_spec("0.5", 40)) == 20
    # 0.25 × 10 = 2.5 → 2 layers (half to even), not 3.
    assert parse_cpu_layers_spec("0.25", 10) == {0, 5}
    assert parse_cpu_layers_spec("1", 6) == {0}  # "1" is a count, not a fraction
    assert parse_cpu_layers_spec("1.0", 6) == set(range(6))


@pytest.mark.parametrize("spec,kind", [
    ("40,1", "out_of_range"), ("-1,", "out_of_range"), ("-1", "count_out_of_range"),
    ("99", "count_out_of_range"), ("1.5", "fraction_out_of_range"), ("nan", "fraction_out_of_range"),
    ("half", "unparsable"), ("3,x", "unparsable"), ("auto", "auto_needs_sizes"),
])
def test_bad_specs_are_refused_by_kind(spec, kind):
    with pytest.raises(PlacementRefused) as err:
        parse_cpu_layers_spec(spec, 40)
    assert err.value.kind == kind


def test_round_half_even_is_what_spreading_uses():
    assert [round(x) for x in (0.5, 1.5, 2.5, 2.4, 2.6)] == [0, 2, 2, 2, 3]
    assert spread_layers(3, 10) == {0, 3, 7}  # 10/3 → 3.33, 6.67


def test_auto_takes_layers_from_both_ends_of_the_stack():
    layers = auto_cpu_layers(40, 16 * GIB, 8 * GIB)
    assert len(layers) == 20 and {0, 9, 30, 39} <= layers and not {15, 20} & layers
    assert auto_cpu_layers(8, 100 * GIB, 1 * GIB) == set(range(8))
    assert auto_cpu_layers(10, 1024, 768) == {0, 1, 9}  # odd count: head-heavy


def test_auto_moves_nothing_without_a_cap_or_when_banks_fit():
    assert auto_cpu_layers(40, 16 * GIB, None) == set()
    assert auto_cpu_layers(40, 16 * GIB, 16 * GIB) == set()
    assert parse_cpu_layers_spec("auto", 40, bank_bytes=16 * GIB, pin_budget=None) == set()
    assert len(parse_cpu_layers_spec("AUTO", 40, bank_bytes=16 * GIB, pin_budget=4 * GIB)) == 30


@given(n=st.integers(1, 200), bank=st.integers(1, 10**12), budget=st.integers(0, 10**12))
def test_auto_keeps_the_pinned_layers_within_budget(n, bank, budget):
    # The device layers' share of the banks must fit the budget, with as few CPU layers as that needs.
    cpu = auto_cpu_layers(n, bank, budget)
    device_layers = n - len(cpu)
    assert device_layers * bank <= max(budget, 0) * n or bank <= budget
    if cpu and bank > budget:
        assert (device_layers + 1) * bank > budget * n


@given(k=st.integers(0, 64), n=st.integers(1, 64))
def test_spread_count_is_exact_and_in_range(k, n):
    if k <= n:
        layers = spread_layers(k, n)
        assert len(layers) == k and all(0 <= x < n for x in layers)
