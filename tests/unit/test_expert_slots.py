"""Rules of the plan executor: validate the whole plan before any write, trust no slot after
a failed write or flush, and every slot holds the bytes of the expert the plan promised."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetray.policy.moe.expert_cache import POLICIES, ExpertCache
from moetray.policy.moe.expert_slots import (
    UNKNOWN,
    ExpertSlots,
    HostSlotMemory,
    RowsFromCallable,
    SlotDeviceError,
    SlotPlanRefused,
    row_nbytes,
)

ROW = 32


def named_row(layer: int, expert: int) -> bytes:
    """A row whose bytes name their expert, so a wrong slot is visible in the bytes."""
    return f"L{layer:03d}E{expert:03d}|".encode().ljust(ROW, b".")


def rig(layers=2, experts=8, capacity=4, policy="horizon", device=None, read=named_row):
    cache = ExpertCache(layers, experts, capacity, policy=policy)
    device = device or HostSlotMemory(capacity, ROW)
    slots = ExpertSlots(device, RowsFromCallable(layers, experts, ROW, read))
    return cache, slots, device


def assert_bytes_match_plan(plan, device) -> None:
    for expert, slot in zip(plan.expert_ids, plan.slots, strict=True):
        if slot is not None:
            assert device.read_slot(slot) == named_row(plan.layer, expert)


class FlakyMemory(HostSlotMemory):
    """Host memory that fails the Nth write or the next flush (fault injection)."""

    def __init__(self, slots, row_bytes, fail_write_at=None, fail_flush=False):
        super().__init__(slots, row_bytes)
        self.fail_write_at, self.fail_flush = fail_write_at, fail_flush

    def write_slot(self, slot, row):
        if self.fail_write_at is not None and self.writes + 1 == self.fail_write_at:
            raise OSError("link reset")
        super().write_slot(slot, row)

    def flush(self):
        if self.fail_flush:
            raise OSError("device lost")


def test_one_cold_step_then_warm_steps_copy_zero_bytes():
    cache, slots, device = rig(layers=1, experts=8, capacity=4)
    cold = slots.apply(cache.ensure(0, [1, 4, 6]))
    assert cold == (3, 3 * ROW)
    for _ in range(10):
        assert slots.apply(cache.ensure(0, [6, 1, 4])) == (0, 0)
    stats = slots.stats()
    assert (stats.plans, stats.warm_plans, stats.bytes) == (11, 10, 3 * ROW)
    assert stats.warm_plan_rate == pytest.approx(10 / 11) and device.writes == 3


@settings(max_examples=80, deadline=None)
@given(policy=st.sampled_from(POLICIES), capacity=st.integers(1, 9),
       steps=st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=4),
                                st.one_of(st.none(), st.integers(0, 2)), st.integers(0, 12)),
                      min_size=1, max_size=40))
def test_every_slot_holds_the_bytes_the_plan_promised(policy, capacity, steps):
    # The end-to-end promise: whatever the policy, a routed slot's bytes are that expert's.
    layers = 3
    cache, slots, device = rig(layers=layers, experts=6, capacity=capacity, policy=policy)
    for i, (experts, limit, resize_to) in enumerate(steps):
        if resize_to and i % 7 == 6:
            slots.apply_resize(cache.resize(resize_to))
            assert device.slot_count == cache.capacity == resize_to
        plan = cache.ensure(i % layers, experts, fetch_limit=limit)
        slots.apply(plan)
        assert_bytes_match_plan(plan, device)
        assert slots.disagreements(cache.occupant) == []


def test_refused_plans_write_nothing():
    cache, slots, device = rig(layers=2, experts=8, capacity=4)
    slots.apply(cache.ensure(0, [0, 1]))
    good = cache.ensure(0, [2, 3])
    occupants = [slots.occupant(s) for s in range(4)]
    bad_plans = {
        "slot_out_of_range": replace(good, copies=[(good.copies[0][0], 2), (4, 3)]),
        "slot_written_twice": replace(good, copies=[(good.copies[0][0], 2), (good.copies[0][0], 3)]),
        "expert_copied_twice": replace(good, copies=[(good.copies[0][0], 2), (good.copies[1][0], 2)]),
        "expert_out_of_range": replace(good, copies=[(good.copies[0][0], 2), (good.copies[1][0], 8)]),
        "layer_out_of_range": replace(good, layer=2),
        "length_mismatch": replace(good, slots=good.slots[:1]),
        # routed to a slot that holds another expert's bytes
        "stale_slot": replace(good, copies=good.copies[:1]),
    }
    for kind, plan in bad_plans.items():
        with pytest.raises(SlotPlanRefused) as err:
            slots.apply(plan)
        assert err.value.kind == kind, kind
    assert device.writes == 2 and [slots.occupant(s) for s in range(4)] == occupants
    assert slots.stats().plans == 1


def test_a_short_row_anywhere_in_the_plan_blocks_every_write():
    # Validation covers the whole plan: the good first row must not be written either.
    def read(layer, expert):
        return named_row(layer, expert)[:-1] if expert == 5 else named_row(layer, expert)

    cache, slots, device = rig(read=read)
    with pytest.raises(SlotPlanRefused) as err:
        slots.apply(cache.ensure(0, [1, 5]))
    assert err.value.kind == "row_size" and err.value.size == ROW - 1 and device.writes == 0


def test_a_missing_row_blocks_every_write():
    cache, slots, device = rig(read=lambda layer, expert: None if expert == 3 else named_row(layer, expert))
    with pytest.raises(SlotPlanRefused) as err:
        slots.apply(cache.ensure(1, [0, 3]))
    assert (err.value.kind, err.value.expert) == ("missing_row", 3) and device.writes == 0


def test_a_failed_write_marks_the_plan_slots_unknown_and_names_the_slot():
    cache, slots, device = rig(device=FlakyMemory(4, ROW, fail_write_at=2))
    plan = cache.ensure(0, [1, 2, 3])
    with pytest.raises(SlotDeviceError) as err:
        slots.apply(plan)
    first, second = plan.copies[0][0], plan.copies[1][0]
    assert err.value.kind == "device_write" and err.value.slot == second
    assert err.value.unknown_slots == (first, second)
    assert slots.occupant(first) is UNKNOWN and slots.occupant(second) is UNKNOWN
    assert set(slots.disagreements(cache.occupant)) >= {first, second}


def test_a_failed_flush_marks_every_written_slot_unknown_and_recovery_recopies():
    device = FlakyMemory(4, ROW, fail_flush=True)
    cache, slots, _ = rig(device=device)
    plan = cache.ensure(0, [1, 2])
    with pytest.raises(SlotDeviceError) as err:
        slots.apply(plan)
    assert err.value.kind == "device_flush" and set(err.value.unknown_slots) == {s for s, _ in plan.copies}
    assert slots.unknown_slots() == sorted(s for s, _ in plan.copies)
    # The engine's recovery: forget the slots in both maps, then the experts miss and recopy.
    for slot in err.value.unknown_slots:
        cache.forget_slot(slot)
        slots.forget(slot)
    device.fail_flush = False
    again = cache.ensure(0, [1, 2])
    assert again.misses == 2
    slots.apply(again)
    assert_bytes_match_plan(again, device)
    assert slots.disagreements(cache.occupant) == [] and slots.unknown_slots() == []


def test_a_route_to_an_unknown_slot_is_refused():
    # Without forget_slot after a failure, the planner would call the slot a hit.
    cache, slots, _ = rig(device=FlakyMemory(4, ROW, fail_flush=True))
    with pytest.raises(SlotDeviceError):
        slots.apply(cache.ensure(0, [1]))
    slots.device.fail_flush = False
    with pytest.raises(SlotPlanRefused) as err:
        slots.apply(cache.ensure(0, [1]))
    assert err.value.kind == "stale_slot"


def test_resize_moves_survivor_bytes_below_the_new_capacity():
    cache, slots, device = rig(layers=1, experts=8, capacity=6)
    for experts in ([0, 1, 2], [3, 4, 5], [4, 5]):
        slots.apply(cache.ensure(0, experts))
    plan = cache.resize(2)
    assert plan.moves  # 4 and 5 sat in slots 4 and 5
    slots.apply_resize(plan)
    assert device.slot_count == slots.slot_count == 2
    warm = cache.ensure(0, [4, 5])
    assert warm.hits == 2
    slots.apply(warm)
    assert_bytes_match_plan(warm, device)


def test_resize_refuses_a_move_from_an_empty_slot_before_any_copy():
    cache, slots, device = rig(layers=1, experts=8, capacity=4)
    bad = type("Plan", (), {"capacity": 2, "moves": [(3, 0)]})()
    with pytest.raises(SlotPlanRefused) as err:
        slots.apply_resize(bad)
    assert err.value.kind == "stale_slot" and device.slot_count == 4


def test_geometry_mismatch_is_refused():
    with pytest.raises(SlotPlanRefused) as err:
        ExpertSlots(HostSlotMemory(2, ROW), RowsFromCallable(1, 2, ROW + 1, named_row))
    assert err.value.kind == "geometry_mismatch"


def test_row_nbytes_reads_buffers_and_nbytes():
    assert row_nbytes(b"abc") == 3 and row_nbytes(memoryview(b"abcd")) == 4
    assert row_nbytes(bytearray(5)) == 5
