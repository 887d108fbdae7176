"""Rules of the residency planner: a contract every eviction policy passes, then each
policy's own eviction order, the cyclic-collapse guard and property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetray.policy.moe.expert_cache import (
    DEFAULT_POLICY,
    POLICIES,
    CacheRefused,
    CacheStats,
    ExpertCache,
)


def sweep(cache: ExpertCache, tokens: int, routes) -> None:
    """Run ``tokens`` forward steps; ``routes(t, layer)`` gives the routed ids."""
    for t in range(tokens):
        for layer in range(cache.num_layers):
            cache.ensure(layer, routes(t, layer))


class CacheContract:
    """What every policy must do; subclasses set ``policy``."""

    policy: str = ""

    def make(self, layers=2, experts=8, capacity=4) -> ExpertCache:
        return ExpertCache(layers, experts, capacity, policy=self.policy)

    def test_duplicates_collapse_to_one_slot_and_one_copy(self):
        # Copying an expert twice would waste the link and write one slot twice.
        plan = self.make().ensure(0, [3, 3, 5, 3])
        assert plan.slots[0] == plan.slots[1] == plan.slots[3] is not None
        assert len(plan.copies) == 2 and (plan.hits, plan.misses) == (0, 2)
        assert sorted(e for _, e in plan.copies) == [3, 5]

    def test_second_call_hits_and_copies_nothing(self):
        cache = self.make()
        first = cache.ensure(1, [2, 6])
        again = cache.ensure(1, [6, 2])
        assert (again.hits, again.misses, again.copies) == (2, 0, [])
        assert again.slots == [first.slots[1], first.slots[0]]

    def test_slot_used_in_this_call_is_never_a_victim(self):
        # Evicting a hit of the same call would compute an expert from another's bytes.
        cache = self.make(layers=1, experts=8, capacity=3)
        cache.ensure(0, [0, 1, 2])
        plan = cache.ensure(0, [0, 1, 2, 3, 4])
        held = {e: s for e, s in zip(plan.expert_ids, plan.slots, strict=True) if s is not None}
        assert {0, 1, 2} <= set(held) and plan.slots[3] is None and plan.slots[4] is None
        assert plan.evicted == [] and plan.bypassed == (3, 4)
        assert len(set(held.values())) == len(held)

    def test_more_distinct_experts_than_slots_go_to_the_cpu(self):
        # Prefill can route more experts than the pool holds: the overflow is computed on the CPU.
        plan = self.make(layers=1, experts=8, capacity=3).ensure(0, range(8))
        assert sum(s is not None for s in plan.slots) == 3 and len(plan.bypassed) == 5
        assert (plan.hits, plan.misses, plan.fetched) == (0, 8, 3)

    def test_fetch_limit_admits_at_most_that_many_misses(self):
        cache = self.make(layers=1, experts=8, capacity=8)
        cache.ensure(0, [7])
        plan = cache.ensure(0, [7, 1, 2, 3], fetch_limit=1)
        assert plan.hits == 1 and plan.misses == 3 and plan.fetched == 1
        assert len(plan.bypassed) == 2 and plan.slots[0] is not None
        assert sum(s is None for s in plan.slots) == 2

    def test_fetch_limit_zero_leaves_residency_untouched(self):
        cache = self.make()
        cache.ensure(0, [1, 2])
        before = cache.residency_map()
        plan = cache.ensure(0, [3, 4], fetch_limit=0)
        assert plan.copies == [] and plan.slots == [None, None] and plan.bypassed == (3, 4)
        assert cache.residency_map() == before

    def test_maps_are_mutual_inverses(self):
        cache = self.make(layers=3, experts=6, capacity=5)
        sweep(cache, 7, lambda t, layer: [(t + layer) % 6, (3 * t + layer) % 6])
        cache.check_integrity()
        for slot in range(cache.capacity):
            owner = cache.occupant(slot)
            if owner is not None:
                assert cache.slot_of(*owner) == slot
        grid = cache.residency_map()
        assert sum(s is not None for row in grid for s in row) == cache.resident_count

    def test_per_layer_stats_sum_exactly_to_global(self):
        cache = self.make(layers=3, experts=6, capacity=4)
        sweep(cache, 9, lambda t, layer: [(t * (layer + 1)) % 6, (t + 2) % 6, 5])
        total = CacheStats()
        for s in cache.per_layer_stats():
            total = total + s
        assert total == cache.stats() and cache.stats().calls == 27
        assert cache.stats().misses == cache.stats().fetched + cache.stats().bypassed

    def test_stats_are_none_before_any_route(self):
        # Unknown is None, never 0: a 0 % hit rate before the first token would be a lie.
        assert self.make().stats().hit_rate is None

    def test_forget_slot_drops_the_expert_and_reuses_the_slot_first(self):
        cache = self.make(layers=1, experts=8, capacity=4)
        plan = cache.ensure(0, [0, 1, 2, 3])
        slot = plan.slots[2]
        assert cache.forget_slot(slot) == (0, 2)
        assert cache.occupant(slot) is None and cache.slot_of(0, 2) is None
        again = cache.ensure(0, [5])
        assert again.copies == [(slot, 5)] and again.evicted == []
        assert cache.ensure(0, [2]).misses == 1  # the failed copy is never served as a hit
        cache.check_integrity()

    def test_forget_slot_refuses_out_of_range_before_any_change(self):
        cache = self.make()
        with pytest.raises(CacheRefused) as err:
            cache.forget_slot(cache.capacity)
        assert err.value.kind == "slot_out_of_range"

    def test_refusals_change_nothing(self):
        cache = self.make(layers=2, experts=8, capacity=4)
        cache.ensure(0, [1])
        before = (cache.residency_map(), cache.stats(), cache.recency_map())
        for args, kind in [((2, [1]), "layer_out_of_range"), ((0, [1, 8]), "expert_out_of_range"),
                           ((0, [-1]), "expert_out_of_range"), ((True, [1]), "layer_out_of_range")]:
            with pytest.raises(CacheRefused) as err:
                cache.ensure(*args)
            assert err.value.kind == kind
        with pytest.raises(CacheRefused) as err:
            cache.ensure(0, [2], fetch_limit=-1)
        assert err.value.kind == "invalid_fetch_limit"
        assert (cache.residency_map(), cache.stats(), cache.recency_map()) == before

    def test_record_hits_leaves_the_state_ensure_leaves_on_a_pure_hit(self):
        # A compiled step's settled calls take record_hits: any drift from ensure would make the
        # policy evict differently after a decode than after the same eager calls.
        planned, recorded = (self.make(layers=2, experts=8, capacity=8) for _ in range(2))
        for cache in (planned, recorded):
            sweep(cache, 2, lambda t, layer: [layer, 2 + layer, 4 + t])
        hits = [(0, [0, 4]), (1, [3, 1, 3]), (0, [5, 2]), (1, [1]), (0, [4, 0, 2])]
        for layer, routed in hits:
            assert planned.ensure(layer, routed).misses == 0
            assert recorded.record_hits(layer, routed) == len(set(routed))
        assert recorded.per_layer_stats() == planned.per_layer_stats()
        assert recorded.recency_map() == planned.recency_map()
        assert recorded.policy_info() == planned.policy_info()
        for layer, routed in [(1, [6, 7]), (0, [6, 7, 1]), (1, [0, 5])]:  # then misses: the same victims
            assert recorded.ensure(layer, routed) == planned.ensure(layer, routed)
        assert recorded.residency_map() == planned.residency_map()

    def test_record_hits_refuses_a_call_that_is_no_pure_hit_before_any_change(self):
        cache = self.make(layers=2, experts=8, capacity=4)
        cache.ensure(0, [1, 2])
        before = (cache.residency_map(), cache.stats(), cache.recency_map(), cache.policy_info())
        for args, kind in [((0, [1, 3]), "not_resident"), ((2, [1]), "layer_out_of_range"),
                           ((0, [1, 8]), "expert_out_of_range")]:
            with pytest.raises(CacheRefused) as err:
                cache.record_hits(*args)
            assert err.value.kind == kind
        assert (cache.residency_map(), cache.stats(), cache.recency_map(), cache.policy_info()) == before

    def test_resize_shrink_compacts_survivors_below_the_new_capacity(self):
        cache = self.make(layers=2, experts=8, capacity=8)
        sweep(cache, 3, lambda t, layer: [t, t + 1])
        residents = {cache.occupant(s) for s in range(8)} - {None}
        plan = cache.resize(3)
        assert cache.capacity == 3 and cache.resident_count <= 3
        assert all(src >= 3 and dst < 3 for src, dst in plan.moves)
        kept = {cache.occupant(s) for s in range(3)} - {None}
        assert kept | set(plan.dropped) == residents and not kept & set(plan.dropped)
        cache.check_integrity()

    def test_resize_keeps_the_experts_routed_last(self):
        # The hottest experts of every policy include those routed in the latest call.
        cache = self.make(layers=1, experts=8, capacity=6)
        for experts in ([0, 1], [2, 3], [4, 5], [0, 1], [0, 1]):
            cache.ensure(0, experts)
        cache.resize(2)
        assert {cache.occupant(0), cache.occupant(1)} == {(0, 0), (0, 1)}
        assert cache.ensure(0, [0, 1]).hits == 2

    def test_resize_grow_adds_empty_slots_and_keeps_residents(self):
        cache = self.make(layers=1, experts=8, capacity=2)
        cache.ensure(0, [4, 5])
        plan = cache.resize(5)
        assert plan.moves == [] and plan.dropped == [] and cache.capacity == 5
        assert cache.ensure(0, [4, 5, 6]).hits == 2
        cache.check_integrity()

    def test_resize_refuses_below_one_slot_before_any_change(self):
        cache = self.make()
        cache.ensure(0, [1, 2])
        before = cache.residency_map()
        with pytest.raises(CacheRefused) as err:
            cache.resize(0)
        assert err.value.kind == "below_floor" and cache.residency_map() == before

    def test_recency_counts_visits_of_that_layer(self):
        cache = self.make(layers=2, experts=4, capacity=4)
        cache.ensure(0, [1])
        cache.ensure(1, [2])
        cache.ensure(0, [3])
        rec = cache.recency_map()
        assert rec[0][1] == 1 and rec[0][3] == 0 and rec[1][2] == 0 and rec[0][0] is None


@pytest.mark.parametrize("policy", POLICIES)
class TestEveryPolicy(CacheContract):
    @pytest.fixture(autouse=True)
    def _policy(self, policy):
        self.policy = policy


def test_default_policy_is_the_first_and_not_lru():
    assert POLICIES[0] == DEFAULT_POLICY == "horizon"
    assert ExpertCache(2, 4, 2).policy == DEFAULT_POLICY


def test_constructor_refusals():
    for args, kind in [((0, 4, 2), "invalid_geometry"), ((2, 0, 2), "invalid_geometry"),
                       ((2, 4, 0), "below_floor")]:
        with pytest.raises(CacheRefused) as err:
            ExpertCache(*args)
        assert err.value.kind == kind
    with pytest.raises(CacheRefused) as err:
        ExpertCache(2, 4, 2, policy="mru")
    assert err.value.kind == "unknown_policy" and err.value.policy == "mru"


# --- each policy's own eviction order ---------------------------------------------------


def test_lru_evicts_the_least_recent_expert_of_any_layer():
    cache = ExpertCache(3, 4, 3, policy="lru")
    cache.ensure(0, [0])
    cache.ensure(1, [0])
    cache.ensure(2, [0])
    cache.ensure(0, [0])
    plan = cache.ensure(1, [1])
    assert plan.evicted == [(1, 0)]  # layer 1's expert 0 was routed longest ago


def test_lru_evicts_the_layer_that_runs_next():
    # The root of the cyclic collapse: global LRU throws out what the next layer needs.
    cache = ExpertCache(3, 4, 3, policy="lru")
    for layer in range(3):
        cache.ensure(layer, [0])
    cache.ensure(0, [0])
    assert cache.ensure(1, [0, 1]).evicted == [(2, 0)]


@pytest.mark.parametrize("policy", ["horizon", "layer_aware_lru"])
def test_horizon_evicts_the_layer_that_just_ran(policy):
    # Same state as above, after a warm-up in which every layer routed expert 0 every token:
    # layer 0's expert is needed again only after the whole stack, layer 2's in the very
    # next call, so the horizon policies keep layer 2's.
    cache = ExpertCache(3, 4, 3, policy=policy)
    sweep(cache, 20, lambda t, layer: [0])
    cache.ensure(0, [0])
    assert cache.ensure(1, [0, 1]).evicted == [(0, 0)]


@pytest.mark.parametrize("policy", ["horizon", "layer_aware_lru"])
def test_horizon_evicts_an_expert_unused_for_many_visits_first(policy):
    cache = ExpertCache(2, 4, 3, policy=policy)
    cache.ensure(0, [3])  # layer 0 expert 3, then never again
    cache.ensure(1, [0])
    for _ in range(4):
        cache.ensure(0, [1])
        cache.ensure(1, [0])
    assert cache.ensure(0, [1, 2]).evicted == [(0, 3)]


def test_layer_lru_evicts_only_inside_its_own_share():
    cache = ExpertCache(2, 8, 4, policy="layer_lru")  # two slots per layer
    cache.ensure(0, [0, 1])
    cache.ensure(1, [0])
    plan = cache.ensure(0, [2])
    # Layer 1 leaves a slot free, but layer 0 is at its share: it evicts its own LRU expert.
    assert plan.evicted == [(0, 0)]


def test_lfu_evicts_the_least_frequently_routed():
    cache = ExpertCache(1, 8, 2, policy="lfu")
    for experts in ([0], [0], [0], [1], [1], [2]):
        cache.ensure(0, experts)
    plan = cache.ensure(0, [3])
    assert plan.evicted == [(0, 2)]  # 2 was routed once, 0 three times (1 was already out)


def test_lru_fetches_the_most_recent_misses_under_a_cap():
    # A recurring expert that keeps losing the cap must eventually be fetched.
    cache = ExpertCache(1, 8, 8, policy="lru")
    cache.ensure(0, [5], fetch_limit=0)
    plan = cache.ensure(0, [1, 5], fetch_limit=1)
    assert plan.copies[0][1] == 5 and plan.bypassed == (1,)


# --- the cyclic sweep -------------------------------------------------------------------


def cyclic_hit_rate(policy: str, layers=6, experts=16, top_k=4, capacity=None, tokens=40) -> float:
    capacity = capacity if capacity is not None else layers * top_k - top_k  # < L·k
    cache = ExpertCache(layers, experts, capacity, policy=policy)
    sweep(cache, 5, lambda t, layer: range(top_k))
    cache.reset_stats()
    sweep(cache, tokens, lambda t, layer: range(top_k))
    return cache.stats().hit_rate


def test_global_lru_collapses_to_zero_on_the_cyclic_sweep():
    # The pathology the default policy must avoid: capacity < layers × top_k.
    assert cyclic_hit_rate("lru") == 0.0


@pytest.mark.parametrize("capacity", [4, 8, 13, 20])
def test_default_policy_does_not_collapse_on_the_cyclic_sweep(capacity):
    # Belady keeps capacity − k experts for good: (C − k)/(L·k) of the routes hit.
    rate = cyclic_hit_rate(DEFAULT_POLICY, capacity=capacity)
    optimum = (capacity - 4) / 24
    assert rate >= optimum - 1e-9 and (capacity == 4 or rate > 0)


# --- properties -------------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("ensure"), st.integers(0, 2), st.lists(st.integers(0, 5), max_size=5),
                  st.one_of(st.none(), st.integers(0, 3))),
        st.tuples(st.just("forget"), st.integers(0, 20)),
        st.tuples(st.just("resize"), st.integers(1, 9)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICIES), capacity=st.integers(1, 8), script=ops)
def test_plans_and_maps_stay_consistent_under_any_sequence(policy, capacity, script):
    cache = ExpertCache(3, 6, capacity, policy=policy)
    for op in script:
        if op[0] == "ensure":
            _, layer, experts, limit = op
            before = {s: cache.occupant(s) for s in range(cache.capacity)}
            plan = cache.ensure(layer, experts, fetch_limit=limit)
            distinct = set(experts)
            assert len(plan.slots) == len(experts)
            assert plan.hits + plan.misses == len(distinct)
            assert plan.misses == plan.fetched + len(plan.bypassed)
            if limit is not None:
                assert plan.fetched <= limit
            by_expert: dict[int, int | None] = {}
            for e, s in zip(experts, plan.slots, strict=True):
                assert by_expert.setdefault(e, s) == s  # duplicates share
                if s is not None:
                    assert cache.occupant(s) == (layer, e)
            used = [s for s in by_expert.values() if s is not None]
            assert len(used) == len(set(used))  # no two experts share a slot
            assert len({s for s, _ in plan.copies}) == len(plan.copies)
            for lay, e in plan.evicted:  # a victim was never routed in this call
                assert not (lay == layer and e in distinct)
            for s, e in plan.copies:  # a copy lands in a slot that did not hold this expert
                assert before[s] != (layer, e)
        elif op[0] == "forget":
            if op[1] < cache.capacity:
                cache.forget_slot(op[1])
        else:
            cache.resize(op[1])
        cache.check_integrity()
    assert sum(cache.per_layer_stats(), CacheStats()) == cache.stats()


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES), k=st.integers(1, 3), layers=st.integers(2, 4),
       capacity=st.integers(1, 14), seq=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3),
                                                 min_size=1, max_size=30))
def test_enough_slots_means_no_cpu_fallback(policy, k, layers, capacity, seq):
    # Without a fetch limit a miss goes to the CPU only when the call's own experts fill
    # every slot it may use.
    cache = ExpertCache(layers, 5, capacity, policy=policy)
    for i, experts in enumerate(seq):
        layer = i % layers
        plan = cache.ensure(layer, experts)
        share = capacity if policy != "layer_lru" else capacity // layers + (layer < capacity % layers)
        if len(set(experts)) <= share:
            assert plan.bypassed == ()


# --- horizon's online choice between frequency and recency ------------------------------


def drifting(t: int, layer: int) -> list[int]:
    # A window of experts that slides forward and never comes back: only recency helps.
    return [(t // 3 + j + 5 * layer) % 64 for j in range(4)]


def alternating_hot_and_noise(t: int, layer: int) -> list[int]:
    # Four hot experts, each routed every other token, plus two from a large cold pool.
    # Recency alone (λ = 1) evicts a hot expert while it waits for its turn; a longer memory
    # keeps it.
    return [2 * (t % 2), 1 + 2 * (t % 2), 4 + (t * 7 + layer * 13) % 60, 4 + (t * 11 + layer * 5) % 60]


def test_horizon_moves_to_recency_when_popularity_drifts_and_back_when_it_holds():
    cache = ExpertCache(4, 64, 20)
    sweep(cache, 300, drifting)
    assert cache.policy_info()["lambda"] >= 0.3 and cache.policy_info()["switches"] >= 1
    cache.reset_stats()
    sweep(cache, 600, alternating_hot_and_noise)
    assert cache.policy_info()["lambda"] <= 0.3
    # horizon@1.0 gets 0.27 on this phase alone, the longer memories 0.50
    assert cache.stats().hit_rate >= 0.45


def test_fixed_lambda_variants_are_accepted_but_not_listed():
    cache = ExpertCache(2, 4, 2, policy="horizon@1.0")
    assert cache.policy == "horizon@1.0" and "horizon@1.0" not in POLICIES
    assert cache.policy_info() == {"policy": "horizon@1.0", "lambda": 1.0, "switches": 0,
                                   "shadow_misses": {1.0: 0.0}}
