"""Rules of the pool budget: one formula for the start-up plan, the slider and the live re-split."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from moetray.policy.pool_budget import (
    MIN_KV_PAGES,
    MIN_STATE_SLOTS,
    PRESET_STATE_SLOTS,
    BudgetTooSmall,
    PoolBudget,
    PoolFloors,
    PoolLimits,
    PoolSizes,
    RebuildRejected,
    RebuildRequest,
    budget_from_free_memory,
    fraction_of,
    plan_budget,
    presets,
    project,
    reserve_pages,
    slider_limits,
    split_at,
    validate_rebuild,
)

GiB = 2**30
MiB = 2**20
CURRENT = PoolSizes(moe_slots=64, kv_pages=1024)
FLOORS = PoolFloors(moe_slots=8, kv_pages=16)
COSTS = {"budget_bytes": 4 * GiB, "bytes_per_slot": 16 * MiB, "bytes_per_page": 1 * MiB}


def validate(
    request: RebuildRequest, *, idle: bool = True, floors: PoolFloors = FLOORS, **costs
) -> PoolSizes:
    return validate_rebuild(request, CURRENT, floors, idle=idle, **{**COSTS, **costs})


def rejected(request: RebuildRequest, **kw) -> RebuildRejected:
    with pytest.raises(RebuildRejected) as refusal:
        validate(request, **kw)
    return refusal.value


# --- RebuildRequest -----------------------------------------------------------------------


def test_default_request_is_empty():
    """A request naming nothing must be recognisable, or the engine would tear pools down for nothing."""
    assert RebuildRequest().is_empty()
    assert not RebuildRequest(kv_pages=4).is_empty()


def test_only_kv_changes_invalidate_the_prefix_cache():
    """Dropping cached prefixes on a MoE-only resize would throw away reusable KV for no reason."""
    assert not RebuildRequest(moe_slots=32).invalidates_prefix_cache()
    assert RebuildRequest(kv_pages=32).invalidates_prefix_cache()
    assert RebuildRequest(moe_slots=32, kv_pages=32).invalidates_prefix_cache()


def test_touched_names_exactly_the_requested_pools():
    """Restoring an untouched KV pool in a rollback would wipe the prefix cache for nothing."""
    assert RebuildRequest(kv_pages=1).touched() == {"kv"}
    assert RebuildRequest(moe_slots=9).touched() == {"moe"}
    assert RebuildRequest().touched() == frozenset()


# --- validate_rebuild ---------------------------------------------------------------------


def test_busy_engine_is_refused_first():
    """Resizing under running requests would free pages they are reading; busy outranks every other check."""
    refusal = rejected(RebuildRequest(moe_slots=1, kv_pages=2**40), idle=False)
    assert refusal.kind == "busy"


def test_moe_below_floor_names_pool_and_numbers():
    """Fewer slots than one layer's experts cannot run a layer; the UI needs the floor to say why."""
    refusal = rejected(RebuildRequest(moe_slots=4))
    assert (refusal.kind, refusal.pool, refusal.requested, refusal.floor) == ("below_floor", "moe", 4, 8)


def test_kv_below_floor_names_pool_and_numbers():
    """A KV pool below its floor cannot hold one request's prompt."""
    refusal = rejected(RebuildRequest(kv_pages=15))
    assert (refusal.kind, refusal.pool, refusal.requested, refusal.floor) == ("below_floor", "kv", 15, 16)


def test_kv_floor_is_never_below_min_kv_pages():
    """A caller passing floor 0 would otherwise accept a pool that cannot page a single request."""
    refusal = rejected(RebuildRequest(kv_pages=1), floors=PoolFloors(8, 0))
    assert (refusal.kind, refusal.floor) == ("below_floor", MIN_KV_PAGES)


def test_moe_below_floor_is_checked_before_kv():
    """The check order is part of the contract: the same bad request must always get the same answer."""
    assert rejected(RebuildRequest(moe_slots=1, kv_pages=1)).pool == "moe"


def test_resizing_a_pool_the_model_lacks_is_refused_by_name():
    """A dense model answering 200 to a MoE resize would claim a change that never happened."""
    refusal = rejected(RebuildRequest(moe_slots=64), floors=PoolFloors(None, 16))
    assert (refusal.kind, refusal.pool) == ("no_such_pool", "moe")


def test_below_floor_is_checked_before_no_such_pool():
    """Issue 2 fixes the order busy → below_floor → no_such_pool → too_large."""
    refusal = rejected(RebuildRequest(moe_slots=64, kv_pages=1), floors=PoolFloors(None, 16))
    assert refusal.kind == "below_floor"


def test_no_such_pool_is_checked_before_too_large():
    """A request naming a missing pool must say so, not blame the budget."""
    refusal = rejected(RebuildRequest(moe_slots=2**40), floors=PoolFloors(None, 16))
    assert refusal.kind == "no_such_pool"


def test_too_large_carries_needed_and_net_budget():
    """A rebuild over budget would die after the free; the rejection must come first and say by how much."""
    refusal = rejected(RebuildRequest(kv_pages=2**40), budget_bytes=2 * GiB, fixed_bytes=0)
    assert refusal.kind == "too_large"
    assert refusal.needed_bytes == 64 * 16 * MiB + 2**40 * MiB
    assert refusal.budget_bytes == 2 * GiB
    assert refusal.sizes == PoolSizes(64, 2**40)


def test_more_slots_than_the_model_has_experts_is_too_large_and_names_the_pool():
    """Slots beyond every expert of every layer would sit empty while the KV pool starves."""
    refusal = rejected(RebuildRequest(moe_slots=100), max_moe_slots=64)
    assert (refusal.kind, refusal.pool, refusal.requested) == ("too_large", "moe", 100)
    assert refusal.needed_bytes is None
    assert rejected(RebuildRequest(moe_slots=3), max_moe_slots=64).kind == "below_floor"  # floor first
    assert validate(RebuildRequest(moe_slots=64), max_moe_slots=64) == PoolSizes(64, 1024)


def test_the_budget_bundle_validates_with_its_expert_cap():
    """The engine validates through PoolBudget; dropping the cap there would let 10**6 slots through."""
    budget = PoolBudget(page_size=16, floors=FLOORS, max_moe_slots=96, **COSTS)
    with pytest.raises(RebuildRejected) as refusal:
        budget.validate(RebuildRequest(moe_slots=97), CURRENT, idle=True)
    assert (refusal.value.kind, refusal.value.pool) == ("too_large", "moe")
    assert budget.validate(RebuildRequest(moe_slots=96), CURRENT, idle=True) == PoolSizes(96, 1024)


def test_unnamed_pool_keeps_its_current_size():
    """Resetting a pool the request did not name would resize it behind the user's back."""
    assert validate(RebuildRequest(moe_slots=128)) == PoolSizes(128, 1024)
    assert validate(RebuildRequest(kv_pages=512)) == PoolSizes(64, 512)


def test_exact_fit_is_accepted_and_one_more_page_rejected():
    """An off-by-one in the fit check either wastes a page or lets an allocation fail after the free."""
    costs = {"budget_bytes": 64 * 100 + 50 * 10, "bytes_per_slot": 100, "bytes_per_page": 10}
    assert validate(RebuildRequest(kv_pages=50), **costs) == PoolSizes(64, 50)
    assert rejected(RebuildRequest(kv_pages=51), **costs).kind == "too_large"


def test_fixed_bytes_come_out_of_the_budget():
    """Pricing the fixed companions at nothing passes a rebuild that later dies after the free."""
    costs = {"budget_bytes": 64 * 100 + 50 * 10, "bytes_per_slot": 100, "bytes_per_page": 10}
    refusal = rejected(RebuildRequest(kv_pages=50), fixed_bytes=1, **costs)
    assert (refusal.kind, refusal.budget_bytes) == ("too_large", 64 * 100 + 50 * 10 - 1)


def test_over_committed_budget_rejects_everything():
    """Unsigned arithmetic would wrap a negative net budget into a huge one and accept anything."""
    refusal = rejected(RebuildRequest(kv_pages=16), budget_bytes=100, fixed_bytes=1000)
    assert refusal.kind == "too_large"
    assert refusal.budget_bytes == -900


def test_non_positive_unit_costs_are_a_programming_error():
    """A zero per-page cost would make every size fit."""
    with pytest.raises(ValueError):
        validate(RebuildRequest(kv_pages=16), bytes_per_page=0)


# --- plan_budget (FreeToken's table, per_expert 100, per_page 10) ---------------------------


@pytest.mark.parametrize(
    ("budget", "floor", "all_experts", "reserve", "expected"),
    [
        (2000, 8, 8, 5, PoolSizes(8, 120)),  # experts capped at all experts, KV takes the rest
        (1000, 2, 50, 10, PoolSizes(9, 10)),  # the reserve bounds the experts
        (200000, 128, 992, 0, PoolSizes(992, 10080)),  # a slot cap: the surplus rolls over to KV
    ],
)
def test_plan_is_expert_priority_after_the_reserve(budget, floor, all_experts, reserve, expected):
    """Starving experts for KV nobody asked for would turn every decode step into a copy over the link."""
    plan = plan_budget(
        PoolFloors(floor, 0),
        budget_bytes=budget,
        bytes_per_slot=100,
        bytes_per_page=10,
        max_moe_slots=all_experts,
        reserve_pages=reserve,
    )
    assert plan == expected


def test_plan_never_goes_below_one_layer_of_experts():
    """Fewer slots than one layer's experts cannot run the model at all; the reserve must give way."""
    plan = plan_budget(
        PoolFloors(4, 0),
        budget_bytes=1000,
        bytes_per_slot=100,
        bytes_per_page=10,
        max_moe_slots=40,
        reserve_pages=90,
    )
    assert plan.moe_slots == 4
    assert plan.kv_pages == 60  # the reserve is a priority, not a floor: KV gets what is left


@pytest.mark.parametrize(("budget", "floor_kv"), [(410, 0), (300, 10)])
def test_plan_refuses_when_the_floors_do_not_fit(budget, floor_kv):
    """A plan over budget would surface as an out-of-memory error mid-load instead of a named refusal."""
    with pytest.raises(BudgetTooSmall) as refusal:
        plan_budget(
            PoolFloors(4, floor_kv),
            budget_bytes=budget,
            bytes_per_slot=100,
            bytes_per_page=10,
            max_moe_slots=4,
            reserve_pages=0,
        )
    assert refusal.value.kind == "too_large"
    assert refusal.value.needed_bytes == 400 + max(floor_kv, MIN_KV_PAGES) * 10


PINNABLE = PoolBudget(
    budget_bytes=10000,
    bytes_per_slot=100,
    bytes_per_page=10,
    page_size=16,
    floors=PoolFloors(4, 3),
    max_moe_slots=40,
)


@pytest.mark.parametrize(
    ("pinned", "expected"),
    [
        (None, PINNABLE.plan(0)),
        (RebuildRequest(), PINNABLE.plan(0)),
        (RebuildRequest(kv_pages=500), PoolSizes(40, 500)),  # experts take the rest, up to every expert
        (RebuildRequest(kv_pages=900), PoolSizes(10, 900)),
        (RebuildRequest(moe_slots=20), PoolSizes(20, 800)),  # KV takes every page the rest pays for
        (RebuildRequest(moe_slots=100, kv_pages=100), PoolSizes(40, 100)),  # slots capped at every expert
    ],
)
def test_plan_keeps_a_pinned_pool_and_fits_the_other_around_it(pinned, expected):
    """``--moe-capacity`` / ``--kv-tokens`` pin one pool; ignoring it, or starving the other, surprises."""
    assert PINNABLE.plan(0, pinned=pinned) == expected


@pytest.mark.parametrize(
    "pinned",
    [RebuildRequest(moe_slots=20, kv_pages=900), RebuildRequest(kv_pages=990), RebuildRequest(moe_slots=2)],
)
def test_a_pinned_split_that_does_not_fit_is_refused_like_a_rebuild(pinned):
    """A pinned size over budget must fail loading by name, not as an allocation error after the weights."""
    with pytest.raises(RebuildRejected) as refusal:
        PINNABLE.plan(0, pinned=pinned)
    assert refusal.value.kind in ("too_large", "below_floor")


HYBRID_PINNABLE = dataclasses.replace(PINNABLE, floors=PoolFloors(4, 3, 2), bytes_per_state_slot=50)


@pytest.mark.parametrize(
    ("pinned", "expected"),
    [
        (None, PoolSizes(40, 560, 8)),  # the default state reserve comes off the top
        (RebuildRequest(state_slots=20), PoolSizes(40, 500, 20)),  # a pinned state pool replaces it
        (RebuildRequest(kv_pages=500), PoolSizes(40, 500, 8)),
        (RebuildRequest(moe_slots=20, state_slots=10), PoolSizes(20, 750, 10)),  # KV takes the rest
        (RebuildRequest(kv_pages=900, state_slots=2), PoolSizes(9, 900, 2)),  # experts take the rest
    ],
)
def test_plan_keeps_a_pinned_state_pool_and_fits_the_others_around_it(pinned, expected):
    """``--state-slots`` pins the third pool; experts and KV share what it leaves."""
    assert HYBRID_PINNABLE.plan(0, pinned=pinned) == expected


@pytest.mark.parametrize(
    ("budget", "pinned", "kind"),
    [
        (HYBRID_PINNABLE, RebuildRequest(state_slots=1), "below_floor"),
        (HYBRID_PINNABLE, RebuildRequest(state_slots=1000), "too_large"),
        (PINNABLE, RebuildRequest(state_slots=4), "no_such_pool"),  # no linear-attention layers
    ],
)
def test_a_pinned_state_pool_that_cannot_be_served_is_refused_by_name(budget, pinned, kind):
    with pytest.raises(RebuildRejected) as refusal:
        budget.plan(0, pinned=pinned)
    assert refusal.value.kind == kind


def test_reserve_pages_rounds_up():
    """Rounding the KV reserve down would leave the last tokens of a reserved context without a page."""
    assert reserve_pages(8192, 16) == 512
    assert reserve_pages(8193, 16) == 513
    assert reserve_pages(0, 16) == 0


def test_budget_from_free_memory_keeps_headroom_and_subtracts_weights():
    """Planning with all free memory leaves no room for activations; forgetting the weights double-counts."""
    assert budget_from_free_memory(baseline_free_bytes=1000, free_after_weights_bytes=900, ratio=0.9) == 800
    assert budget_from_free_memory(baseline_free_bytes=1000, free_after_weights_bytes=50, ratio=0.9) == -50


# --- slider_limits, split_at, presets --------------------------------------------------------

SMALL = {"budget_bytes": 10_000, "bytes_per_slot": 100, "bytes_per_page": 10}


def test_slider_limits_trade_one_pool_against_the_other_floor():
    """A maximum computed with the other pool at zero would offer sizes that cannot fit beside its floor."""
    limits = slider_limits(PoolFloors(4, 16), max_moe_slots=1000, **SMALL)
    assert limits == PoolLimits(
        moe_min=4, moe_max=(10_000 - 160) // 100, kv_min=16, kv_max=(10_000 - 400) // 10
    )


def test_slider_limits_include_fixed_costs():
    """FreeToken's maxima ignored fixed costs and so offered sizes the rebuild then rejected."""
    limits = slider_limits(PoolFloors(4, 16), max_moe_slots=1000, fixed_bytes=1000, **SMALL)
    assert limits.moe_max == (9_000 - 160) // 100
    assert limits.kv_max == (9_000 - 400) // 10


def test_slider_moe_max_is_capped_at_all_experts():
    """Slots beyond every expert of every layer would sit empty while KV starves."""
    assert slider_limits(PoolFloors(4, 16), max_moe_slots=24, **SMALL).moe_max == 24


def test_slider_for_a_model_without_experts_has_no_moe_range():
    """A dense model's slider must not offer an expert pool that a rebuild refuses as no_such_pool."""
    limits = slider_limits(PoolFloors(None, 16), max_moe_slots=0, **SMALL)
    assert (limits.moe_min, limits.moe_max) == (0, 0)
    assert fraction_of(PoolSizes(0, 100), limits) is None


def test_slider_limits_refuse_when_floors_do_not_fit():
    """Offering an empty range as if it were valid would let the UI post a size that must be rejected."""
    with pytest.raises(BudgetTooSmall):
        slider_limits(
            PoolFloors(4, 16), max_moe_slots=100, budget_bytes=500, bytes_per_slot=100, bytes_per_page=10
        )


def test_split_at_ends_are_the_limits():
    """The slider's ends must reach the limits, or part of the range would be unreachable."""
    limits = slider_limits(PoolFloors(4, 16), max_moe_slots=1000, **SMALL)
    assert split_at(0.0, limits, **SMALL) == PoolSizes(limits.moe_min, limits.kv_max)
    top = split_at(1.0, limits, **SMALL)
    assert top.moe_slots == limits.moe_max
    assert top.kv_pages == (10_000 - limits.moe_max * 100) // 10 >= limits.kv_min


def test_split_at_clamps_and_refuses_nan():
    """A stray value from a widget must neither leave the range nor turn into a silent 0."""
    limits = slider_limits(PoolFloors(4, 16), max_moe_slots=1000, **SMALL)
    assert split_at(-3.0, limits, **SMALL) == split_at(0.0, limits, **SMALL)
    assert split_at(7.0, limits, **SMALL) == split_at(1.0, limits, **SMALL)
    with pytest.raises(ValueError):
        split_at(float("nan"), limits, **SMALL)


def test_fraction_of_places_the_slider_at_the_current_split():
    """A slider that opened at a different split than the engine's would apply a change on first touch."""
    budget = PoolBudget(page_size=16, floors=PoolFloors(4, 16), max_moe_slots=1000, **SMALL)
    for fraction in (0.0, 0.25, 0.5, 1.0):
        sizes = budget.split_at(fraction)
        assert budget.split_at(budget.fraction_of(sizes)) == sizes


def test_presets_order_and_meaning():
    """Presets that did not differ in the stated direction would mislabel what the user picks."""
    floors = PoolFloors(4, 16)
    by_name = dict(
        presets(
            floors,
            max_moe_slots=1000,
            page_size=16,
            budget_bytes=100_000,
            bytes_per_slot=100,
            bytes_per_page=10,
        )
    )
    assert list(by_name) == ["minimum", "chat", "agent"]
    assert by_name["minimum"] == PoolSizes(4, 16)
    assert by_name["chat"].kv_pages >= reserve_pages(8192, 16) or by_name["chat"].moe_slots == 4
    assert by_name["agent"].kv_pages >= by_name["chat"].kv_pages
    assert by_name["agent"].moe_slots <= by_name["chat"].moe_slots


def test_project_gives_slots_tokens_and_bytes():
    """The dashboard shows tokens and GiB; computing them in the UI would be a second copy of the formula."""
    proj = project(PoolSizes(10, 4), page_size=16, bytes_per_slot=GiB, bytes_per_page=MiB)
    assert proj.kv_tokens == 64
    assert (proj.moe_bytes, proj.kv_bytes, proj.total_bytes) == (10 * GiB, 4 * MiB, 10 * GiB + 4 * MiB)


def test_wire_round_trip_gives_the_dashboard_the_engines_limits():
    """A dashboard that derived limits differently from the engine would offer sizes the engine rejects."""
    engine = PoolBudget(
        budget_bytes=4 * GiB,
        bytes_per_slot=16 * MiB,
        bytes_per_page=MiB,
        page_size=16,
        floors=PoolFloors(8, 16),
        max_moe_slots=96,
        fixed_bytes=100 * MiB,
    )
    wire = engine.to_wire(CURRENT, kv_pages_used=None, kv_pages_evictable=None)
    dashboard = PoolBudget.from_wire(wire)
    assert dashboard.limits() == engine.limits()
    assert dashboard.presets() == engine.presets()
    assert wire["kv_tokens"] == 1024 * 16
    assert wire["kv_pages_used"] is None  # unknown stays null, never 0


def test_wire_round_trip_for_a_model_without_experts():
    """Reading floor 0 back as a real floor would let the dashboard offer a MoE resize the engine refuses."""
    engine = PoolBudget(
        budget_bytes=GiB,
        bytes_per_slot=MiB,
        bytes_per_page=MiB,
        page_size=16,
        floors=PoolFloors(None, 16),
        max_moe_slots=0,
    )
    dashboard = PoolBudget.from_wire(engine.to_wire(PoolSizes(0, 64), kv_pages_used=3, kv_pages_evictable=1))
    assert dashboard.floors == PoolFloors(None, 16)
    assert dashboard.limits() == engine.limits()


# --- the third pool: recurrent-state slots (hybrid models) ---------------------------------

HYBRID = PoolFloors(moe_slots=8, kv_pages=16, state_slots=4)
STATE_COSTS = {**COSTS, "bytes_per_state_slot": 64 * MiB}
HYBRID_NOW = PoolSizes(64, 1024, 8)


def validate_hybrid(request: RebuildRequest, **costs) -> PoolSizes:
    return validate_rebuild(request, HYBRID_NOW, HYBRID, idle=True, **{**STATE_COSTS, **costs})


def test_state_requests_touch_the_state_pool_and_invalidate_the_prefix_cache():
    """Snapshots are slots in the state pool: re-creating it drops every snapshot the radix tree holds."""
    request = RebuildRequest(state_slots=12)
    assert not request.is_empty()
    assert request.touched() == {"state"}
    assert request.invalidates_prefix_cache()
    assert RebuildRequest(1, 2, 3).touched() == {"moe", "kv", "state"}


def test_a_state_request_on_a_model_without_the_pool_is_refused_by_name():
    """A full-attention model answering 200 to a state resize would claim a pool it never had."""
    refusal = rejected(RebuildRequest(state_slots=16))
    assert (refusal.kind, refusal.pool) == ("no_such_pool", "state")


def test_the_missing_expert_pool_is_named_before_the_missing_state_pool():
    """The check order is part of the contract: moe, then state."""
    refusal = rejected(RebuildRequest(moe_slots=64, state_slots=16), floors=PoolFloors(None, 16))
    assert (refusal.kind, refusal.pool) == ("no_such_pool", "moe")


def test_state_below_its_floor_names_pool_and_numbers():
    """Fewer slots than the floor could not hold a running request beside its snapshot."""
    with pytest.raises(RebuildRejected) as refusal:
        validate_hybrid(RebuildRequest(state_slots=3))
    assert (refusal.value.kind, refusal.value.pool, refusal.value.floor) == ("below_floor", "state", 4)
    with pytest.raises(RebuildRejected) as refusal:
        validate_rebuild(
            RebuildRequest(state_slots=1),
            HYBRID_NOW,
            HYBRID._replace(state_slots=0),
            idle=True,
            **STATE_COSTS,
        )
    assert refusal.value.floor == MIN_STATE_SLOTS


def test_state_slots_are_priced_in_the_fit_check_and_kept_when_unnamed():
    """Pricing the state pool at nothing passes a re-split that dies after the free."""
    assert validate_hybrid(RebuildRequest(kv_pages=512)) == PoolSizes(64, 512, 8)
    net = STATE_COSTS["budget_bytes"]
    room = (net - 64 * 16 * MiB - 1024 * MiB) // (64 * MiB)
    assert validate_hybrid(RebuildRequest(state_slots=room)).state_slots == room
    with pytest.raises(RebuildRejected) as refusal:
        validate_hybrid(RebuildRequest(state_slots=room + 1))
    assert refusal.value.kind == "too_large" and refusal.value.sizes == PoolSizes(64, 1024, room + 1)


def test_a_state_pool_needs_a_positive_unit_cost():
    """A zero per-slot cost would make every state size fit."""
    with pytest.raises(ValueError):
        validate_hybrid(RebuildRequest(state_slots=8), bytes_per_state_slot=0)


def test_limits_trade_all_three_pools_against_the_other_floors():
    """Each maximum leaves exactly the other floors' bytes; a model without the pool shows 0..0."""
    costs = {**SMALL, "bytes_per_state_slot": 50}
    limits = slider_limits(PoolFloors(4, 16, 2), max_moe_slots=1000, **costs)
    assert (limits.state_min, limits.state_max) == (2, (10_000 - 4 * 100 - 16 * 10) // 50)
    assert limits.moe_max == (10_000 - 16 * 10 - 2 * 50) // 100
    assert limits.kv_max == (10_000 - 4 * 100 - 2 * 50) // 10
    plain = slider_limits(PoolFloors(4, 16), max_moe_slots=1000, **costs)
    assert (plain.state_min, plain.state_max) == (0, 0)
    assert plain.to_wire()["state_slots"] == {"min": 0, "max": 0}


def test_split_at_keeps_the_state_slots_and_gives_kv_the_rest():
    """Moving the expert slider must not silently change how many requests can run at once."""
    costs = {**SMALL, "bytes_per_state_slot": 50}
    limits = slider_limits(PoolFloors(4, 16, 2), max_moe_slots=1000, **costs)
    split = split_at(0.0, limits, state_slots=20, **costs)
    assert split == PoolSizes(4, (10_000 - 400 - 20 * 50) // 10, 20)
    assert split_at(0.0, limits, state_slots=10**6, **costs).state_slots == limits.state_max
    assert split_at(1.0, limits, **costs).state_slots == 2  # unnamed: the floor


def test_plan_reserves_state_slots_before_experts():
    """Without state slots no request can run: the reserve comes before the expert share."""
    plan = plan_budget(
        PoolFloors(2, 0, 2),
        budget_bytes=2000,
        bytes_per_slot=100,
        bytes_per_page=10,
        bytes_per_state_slot=50,
        max_moe_slots=50,
        reserve_pages=10,
        reserve_state_slots=8,
    )
    # state 8 × 50 = 400 first; experts (2000 − 400 − 10 × 10) // 100 = 15; KV the remaining 100 bytes
    assert plan == PoolSizes(15, 10, 8)


def test_presets_set_all_three_pools():
    """A preset that left the state pool alone would not be the named split the user picked."""
    by_name = dict(
        presets(
            PoolFloors(4, 16, 2),
            max_moe_slots=1000,
            page_size=16,
            budget_bytes=1_000_000,
            bytes_per_slot=100,
            bytes_per_page=10,
            bytes_per_state_slot=50,
        )
    )
    assert by_name["minimum"] == PoolSizes(4, 16, 2)
    assert by_name["chat"].state_slots == PRESET_STATE_SLOTS["chat"]
    assert by_name["agent"].state_slots == PRESET_STATE_SLOTS["agent"]


def test_project_prices_the_state_pool():
    """The dashboard shows the third pool in GiB from the same unit cost the engine checks."""
    proj = project(
        PoolSizes(1, 2, 3), page_size=16, bytes_per_slot=1, bytes_per_page=10, bytes_per_state_slot=MiB
    )
    assert (proj.state_slots, proj.state_bytes, proj.total_bytes) == (3, 3 * MiB, 1 + 20 + 3 * MiB)


def test_wire_round_trip_with_a_state_pool():
    """The dashboard must rebuild the same three-pool limits and presets the engine enforces."""
    engine = PoolBudget(
        budget_bytes=4 * GiB,
        bytes_per_slot=16 * MiB,
        bytes_per_page=MiB,
        page_size=16,
        floors=HYBRID,
        max_moe_slots=96,
        fixed_bytes=100 * MiB,
        bytes_per_state_slot=64 * MiB,
    )
    wire = engine.to_wire(HYBRID_NOW, kv_pages_used=1, kv_pages_evictable=2, state_slots_used=None)
    assert (wire["state_slots"], wire["bytes_per_state_slot"], wire["state_slots_used"]) == (
        8,
        64 * MiB,
        None,
    )
    assert wire["floors"]["state_slots"] == 4 and wire["limits"]["state_slots"]["min"] == 4
    dashboard = PoolBudget.from_wire(wire)
    assert dashboard.has_state_pool and dashboard.limits() == engine.limits()
    assert dashboard.presets() == engine.presets()


def test_a_model_without_a_state_pool_says_zero_not_unknown():
    """state_slots: 0 is the pool's absence; an older payload without the fields reads the same way."""
    engine = PoolBudget(
        budget_bytes=GiB,
        bytes_per_slot=MiB,
        bytes_per_page=MiB,
        page_size=16,
        floors=FLOORS,
        max_moe_slots=64,
    )
    wire = engine.to_wire(CURRENT, kv_pages_used=None, kv_pages_evictable=None, state_slots_used=None)
    assert (wire["state_slots"], wire["state_slots_used"], wire["floors"]["state_slots"]) == (0, 0, 0)
    assert wire["live_bytes"]["state_slots"] == 0 and wire["live_bytes"]["kv_pages"] is None
    assert not PoolBudget.from_wire(wire).has_state_pool
    older = {k: v for k, v in wire.items() if "state" not in k}
    older["floors"] = {"moe_slots": 8, "kv_pages": 16}
    assert PoolBudget.from_wire(older).floors == FLOORS


# --- properties ---------------------------------------------------------------------------


@st.composite
def budgets(draw) -> PoolBudget:
    """Budgets around the floors' cost: mostly feasible, some just short, a few over-committed."""
    floors = draw(
        st.builds(
            PoolFloors,
            st.one_of(st.none(), st.integers(0, 512)),
            st.integers(0, 64),
            st.one_of(st.none(), st.integers(0, 64)),
        )
    )
    per_slot = draw(st.integers(1, 10**6))
    per_page = draw(st.integers(1, 10**5))
    per_state = 0 if floors.state_slots is None else draw(st.integers(1, 10**7))
    fixed = draw(st.integers(0, 10**8))
    floor_cost = (
        (floors.moe_slots or 0) * per_slot
        + max(floors.kv_pages, MIN_KV_PAGES) * per_page
        + (0 if floors.state_slots is None else max(floors.state_slots, MIN_STATE_SLOTS) * per_state)
    )
    slack = draw(st.one_of(st.integers(-3 * per_page, 3 * per_slot), st.integers(-(10**9), 10**9)))
    return PoolBudget(
        budget_bytes=fixed + floor_cost + slack,
        bytes_per_slot=per_slot,
        bytes_per_page=per_page,
        page_size=draw(st.sampled_from([1, 16, 64, 256])),
        floors=floors,
        max_moe_slots=draw(st.integers(0, 8192)),
        fixed_bytes=fixed,
        bytes_per_state_slot=per_state,
    )


sizes = st.builds(PoolSizes, st.integers(0, 10**5), st.integers(0, 10**6), st.integers(0, 10**3))
requests = st.builds(
    RebuildRequest,
    st.one_of(st.none(), st.integers(-5, 10**5)),
    st.one_of(st.none(), st.integers(-5, 10**6)),
    st.one_of(st.none(), st.integers(-5, 10**3)),
)


@given(budget=budgets(), request=requests, current=sizes)
def test_validate_never_returns_sizes_over_budget_or_below_a_floor(budget, request, current):
    """Property: whatever is asked, an accepted target fits the net budget and respects named floors."""
    try:
        target = budget.validate(request, current, idle=True)
    except RebuildRejected as refusal:
        assert refusal.kind in RebuildRejected.KINDS
        return
    assert budget.needed_bytes(target) <= budget.net_bytes
    if request.kv_pages is not None:
        assert target.kv_pages >= max(budget.floors.kv_pages, MIN_KV_PAGES)
    if request.moe_slots is not None:
        assert budget.floors.moe_slots is not None and target.moe_slots >= budget.floors.moe_slots
    if request.state_slots is not None:
        assert budget.floors.state_slots is not None
        assert target.state_slots >= max(budget.floors.state_slots, MIN_STATE_SLOTS)


@given(budget=budgets(), fraction=st.floats(0, 1), reserve=st.integers(0, 10**6), current=sizes)
def test_nothing_the_ui_or_plan_offers_is_rejected(budget, fraction, reserve, current):
    """Property: plan, presets and every slider position pass validate_rebuild from any current split."""
    try:
        limits = budget.limits()
    except BudgetTooSmall:
        with pytest.raises(BudgetTooSmall):
            budget.plan(reserve)
        return
    has_moe = budget.floors.moe_slots is not None
    has_state = budget.has_state_pool
    current = PoolSizes(
        current.moe_slots if has_moe else 0,  # a dense model's expert pool is empty
        current.kv_pages,
        current.state_slots if has_state else 0,  # so is a full-attention model's state pool
    )
    state_pick = limits.state_min + int(fraction * (limits.state_max - limits.state_min))
    offered = [
        budget.plan(reserve, reserve_state_slots=reserve % 97),
        budget.split_at(fraction),
        budget.split_at(fraction, state_slots=state_pick),
        *(p.sizes for p in budget.presets()),
    ]
    for offer in offered:
        request = RebuildRequest(
            offer.moe_slots if has_moe else None, offer.kv_pages, offer.state_slots if has_state else None
        )
        assert budget.validate(request, current, idle=True) == offer
        assert limits.moe_min <= offer.moe_slots <= limits.moe_max
        assert limits.kv_min <= offer.kv_pages <= limits.kv_max
        assert limits.state_min <= offer.state_slots <= limits.state_max


@given(budget=budgets())
def test_limits_are_tight(budget):
    """Property: one page or slot past a maximum is rejected, so the slider hides no usable memory."""
    try:
        limits = budget.limits()
    except BudgetTooSmall:
        return
    assume(budget.floors.moe_slots is not None)
    floor_state = limits.state_min if budget.has_state_pool else None
    kv_one_more = RebuildRequest(limits.moe_min, limits.kv_max + 1, floor_state)
    with pytest.raises(RebuildRejected):
        budget.validate(kv_one_more, PoolSizes(0, 0), idle=True)
    if limits.moe_max < max(budget.max_moe_slots, limits.moe_min):  # bounded by memory, not by the cap
        with pytest.raises(RebuildRejected):
            budget.validate(
                RebuildRequest(limits.moe_max + 1, limits.kv_min, floor_state), PoolSizes(0, 0), idle=True
            )
    if budget.has_state_pool:
        state_one_more = RebuildRequest(limits.moe_min, limits.kv_min, limits.state_max + 1)
        with pytest.raises(RebuildRejected):
            budget.validate(state_one_more, PoolSizes(0, 0), idle=True)
