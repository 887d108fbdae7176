"""The expert runtime's rules: wiring to the policies, resize, integrity, telemetry, faults."""

from __future__ import annotations

import pytest
import torch
from expert_helpers import (  # noqa: F401 (autouse fixtures)
    assert_identical,
    greedy,
    isolated_profile_dir,
    one_torch_thread,
    resident,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetray.engine.experts import ResizeFault, load_offloaded_model
from moetray.engine.experts.hybrid import cache_directory, device_identity, settle_host_banks
from moetray.policy.moe.bench_profile import BandwidthProfile, DeviceIdentity, save_profile
from moetray.policy.moe.expert_cache import CacheRefused
from moetray.policy.moe.expert_slots import SlotDeviceError
from moetray.policy.moe.residency import ResidencyRefused
from moetray.policy.wire import ExpertStats

FULL = 16  # tiny models: 2 layers × 8 experts


@pytest.fixture
def qwen3(tiny_moe):
    return tiny_moe("qwen3_moe", "per_expert")


# --- wiring: every policy on the live path ------------------------------------------------------


def test_every_layer_call_is_planned_by_expert_cache(qwen3):
    """Each MoE layer call asks ExpertCache.ensure once, with that call's distinct routed experts.
    Prevents: computing from slots the planner never assigned (the planner bypassed)."""
    om = load_offloaded_model(qwen3, capacity=6)
    om.runtime.start_trace()
    greedy(om.model)
    trace = om.runtime.stop_trace()
    stats = om.runtime.cache.stats()
    assert stats.calls == len(trace) == om.runtime.calls
    assert stats.hits + stats.misses == sum(len(routed) for _, routed in trace)
    assert [layer for layer, _ in trace[:4]] == [0, 1, 0, 1]


def test_misses_are_copied_through_expert_slots(qwen3):
    """Every fetched miss is one row copied by the ExpertSlots executor into the pool, and the
    executor's record of each slot's bytes agrees with the planner. Prevents: a plan whose
    copies are skipped (stale slot bytes computed from), or copies the planner did not ask."""
    om = load_offloaded_model(qwen3, capacity=6)
    greedy(om.model)
    rt = om.runtime
    fetched = rt.cache.stats().fetched
    assert fetched > 0
    assert rt.slots.stats().rows == rt.pool.copies == fetched
    assert rt.total_bytes == rt.pool.bytes_copied == fetched * rt.bytes_per_slot
    assert rt.slots.disagreements(rt.cache.occupant) == []
    rt.check_integrity(deep=True)


def test_profile_picks_hybrid_and_its_fraction(qwen3):
    """With fetch_fraction=None the runtime reads this device's bandwidth profile: a CPU that
    beats the link by the threshold gives the hybrid backend with the profile's q* fraction;
    a profile recorded on another device is never borrowed (offload)."""
    me = device_identity(torch.device("cpu"))
    profile_dir = cache_directory()  # the autouse fixture points it at a temp folder
    save_profile(profile_dir, BandwidthProfile(device=me, link_gbs=10.0, cpu_gbs=30.0))
    om = load_offloaded_model(qwen3, capacity=6)
    assert om.runtime.backend == "hybrid"
    assert om.runtime.fetch_fraction == pytest.approx(10.0 / 30.0, abs=1e-4)  # standalone: link/cpu
    assert_identical(qwen3, om.model)
    assert om.runtime.cache.stats().bypassed > 0

    foreign = DeviceIdentity("cpu", me.name + " (another box)")
    (profile_dir / "benchbw" / f"{me.key}.json").write_text(
        (profile_dir / "benchbw" / f"{me.key}.json").read_text().replace(
            f'"name": "{me.name}"', f'"name": "{foreign.name}"'))
    om = load_offloaded_model(qwen3, capacity=6)
    assert om.runtime.backend == "offload" and om.runtime.fetch_fraction is None


def test_residency_plan_pins_copied_layers_and_refuses_an_unpinned_one():
    """On CUDA every layer whose experts are copied must end pinned; a failed pin is refused at
    attach (a copy from pageable memory would be silently synchronous or fail). CPU layers are
    mlock-ed, and one failed lock stops further attempts."""
    banks = [torch.zeros(4, 8) for _ in range(4)]
    cuda = torch.device("cuda")
    locks: list[int] = []
    plan = settle_host_banks(banks, frozenset({0, 3}), cuda, pin=lambda b: b.clone(),
                             lock=lambda b: locks.append(1) or False)
    assert [c.value for c in plan.achieved_labels()] == ["pageable", "pinned", "pinned", "pageable"]
    assert len(locks) == 1  # sticky: layer 3 was not even tried
    with pytest.raises(ResidencyRefused) as err:
        settle_host_banks([torch.zeros(4, 8)] * 2, frozenset(), cuda, pin=lambda b: None)
    assert err.value.kind == "device_layer_not_pinned"
    cpu_plan = settle_host_banks([torch.zeros(4, 8)] * 2, frozenset({1}), torch.device("cpu"),
                                 lock=lambda b: True)
    assert [c.value for c in cpu_plan.achieved_labels()] == ["pageable", "locked"]


def test_general_expert_path_is_identical_too(qwen3):
    """The eager mode's general per-expert path (biases, transposed weights, custom gates:
    gpt-oss-style flags) must match the stock loop as well; on the tiny families it is
    forced, since they take the verbatim SwiGLU fast path. Prevents: the general path rotting
    unseen. (The grouped mode has one path; gpt-oss itself runs in test_expert_grouped.)"""
    om = load_offloaded_model(qwen3, capacity=6, compute="eager")
    om.runtime._plain_swiglu = False
    assert_identical(qwen3, om.model, "eager")


# --- resize --------------------------------------------------------------------------------------


def test_shrink_keeps_the_hottest_and_output_is_unchanged(qwen3):
    """Shrinking keeps the most recently used experts (LRU's order), moves their bytes into
    the surviving slots without refetching, and decoding stays identical.
    Prevents: a resize that keeps cold experts, or relabels slots without moving their bytes."""
    om = load_offloaded_model(qwen3, capacity=FULL, policy="lru")
    rt = om.runtime
    rt.start_trace()
    greedy(om.model)
    trace = rt.stop_trace()
    last_use = {}
    for step, (layer, routed) in enumerate(trace):
        for expert in routed:
            last_use[(layer, expert)] = step
    before = {(layer, e) for layer, row in enumerate(rt.cache.residency_map())
              for e, s in enumerate(row) if s is not None}
    teardowns = []
    result = rt.resize(5, mark_teardown=lambda: teardowns.append(rt.capacity))
    assert teardowns == [FULL] and result["capacity"] == rt.capacity == rt.pool.capacity == 5
    kept = {(layer, e) for layer, row in enumerate(rt.cache.residency_map())
            for e, s in enumerate(row) if s is not None}
    assert len(kept) == 5 and kept <= before
    assert min(last_use[k] for k in kept) >= max(last_use[d] for d in before - kept)
    rt.check_integrity(deep=True)
    copies = rt.pool.copies
    assert_identical(qwen3, om.model)
    assert rt.pool.copies > copies  # the small pool really works for its living


def test_grow_keeps_every_resident_in_place(qwen3):
    """Growing adds empty slots and leaves every resident expert in its slot (no refetch)."""
    om = load_offloaded_model(qwen3, capacity=6)
    greedy(om.model)
    rt = om.runtime
    before = rt.cache.residency_map()
    rt.resize(12)
    assert rt.cache.residency_map() == before and rt.pool.capacity == 12
    rt.check_integrity(deep=True)
    assert_identical(qwen3, om.model)


def test_allocation_failure_before_teardown_leaves_the_pool_intact(qwen3):
    """If the new pool cannot be allocated, resize raises before calling mark_teardown and the
    old pool, planner and bytes are untouched. Prevents: a failed grow that frees the old pool."""
    sizes = []

    def allocate(shape, dtype, device):
        sizes.append(shape[0])
        if shape[0] > 8:
            raise torch.OutOfMemoryError(f"no room for {shape[0]} slots")
        return torch.empty(shape, dtype=dtype, device=device)

    om = load_offloaded_model(qwen3, capacity=6, allocate=allocate)
    greedy(om.model)
    rt = om.runtime
    rows, residency = rt.pool.rows, rt.cache.residency_map()
    teardowns = []
    with pytest.raises(ResizeFault) as err:
        rt.resize(12, mark_teardown=lambda: teardowns.append(1))
    assert err.value.kind == "allocation_failed" and not err.value.torn_down
    assert teardowns == [] and sizes == [6, 12]
    assert rt.pool.rows is rows and rt.cache.residency_map() == residency and rt.capacity == 6
    rt.check_integrity(deep=True)
    assert_identical(qwen3, om.model)


def test_mark_teardown_runs_after_allocation_and_before_anything_is_freed(qwen3):
    """mark_teardown is called once the new pool exists, while the old rows are still in use."""
    om = load_offloaded_model(qwen3, capacity=8)
    greedy(om.model)
    rt = om.runtime
    old_rows = rt.pool.rows
    seen = {}

    def teardown():
        seen["old_still_live"] = rt.pool.rows is old_rows
        seen["reserved"] = rt.slot_device._reserved is not None
        seen["capacity"] = rt.cache.capacity

    rt.resize(4, mark_teardown=teardown)
    assert seen == {"old_still_live": True, "reserved": True, "capacity": 8}
    assert rt.pool.rows is not old_rows


def test_fault_after_teardown_keeps_a_consistent_old_pool(qwen3):
    """The injected post-teardown failure (for the rebuild transaction's tests) raises with
    ``torn_down`` set and leaves the runtime on its old, consistent pool, so a restore works."""
    om = load_offloaded_model(qwen3, capacity=8)
    greedy(om.model)
    rt = om.runtime
    rt.inject_resize_fault("after_teardown")
    teardowns = []
    with pytest.raises(ResizeFault) as err:
        rt.resize(4, mark_teardown=lambda: teardowns.append(1))
    assert err.value.kind == "injected_after_teardown" and err.value.torn_down and teardowns == [1]
    assert rt.capacity == 8
    rt.check_integrity(deep=True)
    rt.resize(4)  # the fault was one-shot
    assert rt.capacity == 4
    assert_identical(qwen3, om.model)


def test_same_capacity_is_a_named_no_op_and_floor_is_refused(qwen3):
    om = load_offloaded_model(qwen3, capacity=6)
    rt = om.runtime
    rows = rt.pool.rows
    assert rt.resize(6, mark_teardown=lambda: pytest.fail("no teardown for a no-op")) == rt.keep_capacity()
    assert rt.pool.rows is rows
    with pytest.raises(CacheRefused) as err:
        rt.resize(0)
    assert err.value.kind == "below_floor" and rt.capacity == 6


# --- faults during decode ------------------------------------------------------------------------


def test_a_failed_copy_forgets_its_slots_and_decoding_recovers(qwen3):
    """A device error mid-plan propagates, the planner forgets every slot whose bytes are now
    unknown (integrity holds), and the next decode refetches and is still identical."""
    om = load_offloaded_model(qwen3, capacity=6)
    rt = om.runtime
    real_write, calls = rt.pool.write, []

    def flaky(slot, row):
        calls.append(slot)
        if len(calls) == 3:
            raise RuntimeError("DMA error")
        real_write(slot, row)

    rt.pool.write = flaky
    with pytest.raises(SlotDeviceError) as err:
        greedy(om.model)
    assert err.value.kind == "device_write" and len(err.value.unknown_slots) == 3
    for slot in err.value.unknown_slots:
        assert rt.cache.occupant(slot) is None
    rt.check_integrity(deep=True)
    rt.pool.write = real_write
    assert_identical(qwen3, om.model)


# --- telemetry -----------------------------------------------------------------------------------


def test_snapshot_has_the_wire_shape_and_honest_unknowns(qwen3):
    """snapshot() carries exactly ExpertStats' keys; rates are None before any routing (never 0);
    window sums match the totals while the window holds everything; reset_window keeps totals."""
    om = load_offloaded_model(qwen3, capacity=6)
    rt = om.runtime
    snap = rt.snapshot()
    assert set(snap) == set(ExpertStats.__annotations__)
    assert snap["hit_rate"] is None and snap["bytes_per_token"] is None
    assert snap["backend"] == "offload" and snap["fetch_fraction"] is None
    greedy(om.model)
    snap = rt.snapshot()
    assert len(snap["residency"]) == rt.num_layers and len(snap["residency"][0]) == rt.num_experts
    assert sum(snap["window_hits"]) == snap["total_hits"]
    assert sum(snap["window_misses"]) == snap["total_misses"]
    assert sum(snap["window_bytes"]) == snap["total_bytes"] == rt.cache.stats().fetched * rt.bytes_per_slot
    assert snap["hit_rate"] == pytest.approx(snap["total_hits"] / (snap["total_hits"] + snap["total_misses"]))
    assert snap["bytes_per_token"] == pytest.approx(snap["total_bytes"] / rt.total_tokens)
    used = [(layer, e) for layer, row in enumerate(snap["recency"]) for e, r in enumerate(row) if r == 0]
    assert used  # the last call's experts are at recency 0
    rt.reset_window()
    snap = rt.snapshot()
    assert snap["hit_rate"] is None and snap["total_misses"] > 0


# --- property: any routing, any capacity, any policy ----------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_routing_matches_the_stock_experts_bit_for_bit(tiny_moe, data):
    """For arbitrary routings (duplicates across tokens, many tokens, all experts at once), any
    capacity, policy, compute mode and torch thread count (two threads share a batched step's
    small groups out), each layer call equals the stock Experts module of the matching
    implementation bit for bit and the planner and the slot pool agree after every call."""
    from moetray.engine.experts.loader import expert_modules
    from moetray.engine.experts.runtime import COMPUTE_MODES
    from moetray.policy.moe.expert_cache import POLICIES

    checkpoint = tiny_moe("qwen3_moe", "per_expert", top_k=3)
    capacity = data.draw(st.integers(1, FULL), label="capacity")
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    fraction = data.draw(st.sampled_from([None, 0.0, 0.3, 1.0]), label="fetch_fraction")
    compute = data.draw(st.sampled_from(COMPUTE_MODES), label="compute")
    torch.set_num_threads(data.draw(st.sampled_from([1, 2]), label="threads"))  # fixture restores
    om = load_offloaded_model(checkpoint, capacity=capacity, policy=policy, fetch_fraction=fraction,
                              compute=compute)
    stock = [m for _, m in expert_modules(resident(checkpoint, compute))]
    mine = [m for _, m in expert_modules(om.model)]
    hidden = om.model.config.hidden_size
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        for layer in range(om.runtime.num_layers):
            tokens = data.draw(st.integers(1, 12))
            index = torch.tensor(data.draw(st.lists(
                st.lists(st.integers(0, 7), min_size=3, max_size=3, unique=True),
                min_size=tokens, max_size=tokens)))
            weights = torch.rand(tokens, 3)
            states = torch.randn(tokens, hidden)
            with torch.no_grad():
                want = stock[layer](states, index, weights)
                got = mine[layer](states, index, weights)
            assert torch.equal(got, want)
            om.runtime.check_integrity(deep=True)
