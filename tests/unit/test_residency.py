"""Rules of host memory classes: unknown is None, a layer is as resident as its worst bank."""

from __future__ import annotations

import pytest

from moetray.policy.moe.residency import (
    HostResidency,
    ResidencyPlan,
    ResidencyRefused,
    pin_budget,
    requested_labels,
)

P, L, G = HostResidency.PINNED, HostResidency.LOCKED, HostResidency.PAGEABLE


@pytest.mark.parametrize("label,expected", [("pinned", P), (" Locked ", L), ("PAGEABLE", G),
                                            ("pinned-ish", None), ("", None), (None, None), (1, None)])
def test_unknown_label_is_none_never_pinned(label, expected):
    assert HostResidency.from_label(label) is expected


def test_only_pinned_is_device_addressable():
    assert [c.device_addressable for c in (P, L, G)] == [True, False, False]


def test_cpu_layers_ask_for_locked_the_rest_for_pinned():
    assert requested_labels(4, {1, 3}) == [P, L, P, L]


def test_pin_budget_is_uncapped_on_linux_and_capped_under_wsl():
    assert pin_budget(64 << 30, wsl=False) is None
    assert pin_budget(100, wsl=True) == 40


def test_settle_actions_follow_the_request():
    plan = ResidencyPlan([P, L, G])
    assert [plan.settle_action(i) for i in range(3)] == ["pin", "lock", "leave_pageable"]


def test_a_failed_lock_exhausts_the_quota_for_good():
    plan = ResidencyPlan([L, L, L])
    plan.record_lock(True)
    assert plan.settle_action(1) == "lock"
    plan.record_lock(False)
    plan.record_lock(True)  # a later success does not reopen the quota
    assert plan.lock_exhausted and plan.settle_action(2) == "leave_pageable"


def test_a_layer_is_as_resident_as_its_worst_bank_and_never_raised_back():
    plan = ResidencyPlan([L, P])
    assert plan.record(0, L) is L
    assert plan.record(0, G) is G
    assert plan.record(0, L) is G  # pageable can never be raised back
    assert plan.achieved_labels() == [G, None] and not plan.applied
    plan.record(1, P)
    assert plan.applied and plan.downgraded() == [0]


def test_attach_refuses_an_unpinned_device_layer():
    plan = ResidencyPlan(requested_labels(3, {2}))
    plan.record(0, P)
    plan.record(1, G)  # a device layer whose pin failed
    plan.record(2, G)  # a CPU layer whose lock failed: fine
    with pytest.raises(ResidencyRefused) as err:
        plan.check_attach({2})
    assert err.value.kind == "device_layer_not_pinned" and err.value.layer == 1
    plan.check_attach({1, 2})  # once layer 1 runs on the CPU, it is fine


def test_prefill_overlap_needs_every_layer_pinned():
    plan = ResidencyPlan(requested_labels(2, {1}))
    plan.check_attach({1})
    with pytest.raises(ResidencyRefused) as err:
        plan.check_attach({1}, prefill_overlap=True)
    assert err.value.kind == "overlap_needs_pinned"


def test_layer_out_of_range_is_refused():
    with pytest.raises(ResidencyRefused) as err:
        ResidencyPlan([P]).settle_action(1)
    assert err.value.kind == "layer_out_of_range"
