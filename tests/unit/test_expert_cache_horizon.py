"""Rules of the default residency policy, ``horizon``, that its cheap bookkeeping must keep:
the victim is the resident whose next use is predicted farthest away (computed here from the
routing history alone), the duel's shadows decide exactly as standalone fixed-λ caches on the
sampled experts, and a call whose routed experts are all resident touches no heap."""

from __future__ import annotations

import dataclasses
import math
import random
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetray.policy.moe.expert_cache import ExpertCache, ExpertPlan
from moetray.policy.moe.horizon import Horizon

LAMBDAS = Horizon.LAMBDAS


def predicted_horizon(history: list[int], passes_now: int, lam: float, owner: int, layer: int,
                      num_layers: int) -> float:
    """Layer calls until ``(owner, e)`` is next needed, seen from a call of ``layer``, from
    the passes of ``owner`` that routed it: ``d + L · (1/r − 1)`` with ``r`` the decayed
    routing count (LRFU's CRF) times ``1 − 2^−λ``, at most 1."""
    crf = sum(2.0 ** (-lam * (passes_now - p)) for p in history)
    rate = min(1.0, crf * (1.0 - 2.0 ** -lam))
    distance = (owner - layer) % num_layers or num_layers
    return distance + num_layers * (1.0 / rate - 1.0) if rate > 0 else math.inf


calls_strategy = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4), min_size=1, max_size=70)


@pytest.mark.parametrize("decay_table", [Horizon.DECAY_TABLE, 2], ids=["tabulated", "computed"])
@pytest.mark.parametrize("policy", ["horizon", *(f"horizon@{lam}" for lam in LAMBDAS)])
@settings(max_examples=40, deadline=None)
@given(layers=st.integers(2, 4), capacity=st.integers(1, 12), calls=calls_strategy)
def test_victim_is_the_resident_needed_farthest_ahead(policy, decay_table, layers, capacity, calls):
    # The heaps, the lagging keys re-keyed only at the top, the cached layer heads and the
    # shared CRF tables are shortcuts: a stale key or a stale head would evict an expert
    # that is needed sooner than another resident.
    experts = 8
    with mock.patch.object(Horizon, "DECAY_TABLE", decay_table):
        cache = ExpertCache(layers, experts, min(capacity, layers * experts - 1), policy=policy)
    history: dict[tuple[int, int], list[int]] = {}
    passes = [0] * layers
    for i, ids in enumerate(calls):
        layer = i % layers
        lam = cache.policy_info()["lambda"]  # the λ deciding this call (switches happen after it)
        grid = cache.residency_map()
        residents = {(m, e) for m in range(layers) for e in range(experts) if grid[m][e] is not None}
        full = len(residents) == cache.capacity
        passes[layer] += 1
        plan = cache.ensure(layer, ids)
        if full:
            candidates = residents - {(layer, e) for e in ids}
            for victim in plan.evicted:
                scores = {c: predicted_horizon(history[c], passes[c[0]], lam, c[0], layer, layers)
                          for c in candidates}
                best = max(scores.values())
                assert scores[victim] >= best - 1e-9 * max(1.0, abs(best)), (victim, scores)
                candidates.discard(victim)
        for e in set(ids):
            history.setdefault((layer, e), []).append(passes[layer])


def sampled_ids(cache: ExpertCache, layer: int, ids: list[int]) -> list[int]:
    sample = cache._ranker.in_sample
    return [e for e in dict.fromkeys(ids) if sample[layer * cache.num_experts + e]]


@pytest.mark.parametrize("layers,experts,capacity,resized", [(4, 512, 64, 8), (3, 8, 7, 5), (1, 12, 4, 2)],
                         ids=["sampled 1 in 4", "every expert", "one layer, smaller than a call"])
def test_duel_shadows_count_the_misses_of_fixed_lambda_caches_on_the_sample(layers, experts, capacity,
                                                                             resized):
    # The shadows are slot-less and share the real cache's CRFs and clocks; a drift from a
    # real fixed-λ planner on the same experts would make the duel pick λ on wrong counts.
    # The routing skips the sample on many calls (clocks must still advance), the pool is
    # resized (the shadows follow with their share), and a call may route more experts than
    # the shadows hold (which of them get the slots decides the next call's hits).
    cache = ExpertCache(layers, experts, capacity)
    ranker = cache._ranker
    assert (ranker.sample_rate > 1) == (layers * experts >= 1024)
    refs = [ExpertCache(layers, experts, ranker._shadow_capacity(cache.capacity), policy=f"horizon@{lam}")
            for lam in LAMBDAS]
    expected = [0.0] * len(LAMBDAS)
    rng = random.Random(7)
    for t in range(240):
        if t == 150:
            cache.resize(resized)
            for ref in refs:
                ref.resize(ranker._shadow_capacity(cache.capacity))
        hot = [(t // 60 * 3 + j) % experts for j in range(12)]  # a drifting hot set, a cold tail
        for layer in range(layers):
            ids = [rng.choice(hot) if rng.random() < 0.75 else rng.randrange(experts)
                   for _ in range(rng.choice((1, 3)))]
            cache.ensure(layer, ids)
            sample = sampled_ids(cache, layer, ids)
            for i, ref in enumerate(refs):
                expected[i] = expected[i] * ranker.forget + ref.ensure(layer, sample).misses
    assert sum(ref.stats().misses for ref in refs) > 0
    assert cache.policy_info()["shadow_misses"] == {lam: round(m, 3) for lam, m in zip(LAMBDAS, expected,
                                                                                        strict=True)}


def heaps_of(cache: ExpertCache) -> list[list[list[tuple[float, int]]]]:
    ranker = cache._ranker
    return [[list(h) for h in order.heaps] for order in (ranker.order, *(s.order for s in ranker.shadows))]


@pytest.mark.parametrize("layers,experts,top_k", [(30, 16, 4), (8, 256, 8)])
def test_a_call_whose_experts_are_all_resident_touches_no_heap(layers, experts, top_k):
    # The decode hot path at 100 % capacity: no victim is ever needed, so keeping the
    # eviction order up to date there is wasted work on every layer of every token.
    cache = ExpertCache(layers, experts, layers * experts)
    for layer in range(layers):
        cache.ensure(layer, range(experts))
    cache.ensure(0, [0])  # a victim search would refresh heads; none has happened
    before = heaps_of(cache)
    for t in range(50):
        for layer in range(layers):
            plan = cache.ensure(layer, [(t * 7 + layer + j * 5) % experts for j in range(top_k)])
            assert plan.misses == 0
    assert heaps_of(cache) == before


def test_the_hot_path_plan_equals_the_public_constructor_and_stays_frozen():
    # ensure builds its plans without the dataclass __init__; they must be the same objects.
    cache = ExpertCache(2, 4, 2)
    plan = cache.ensure(1, [3, 1, 3, 2])
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(ExpertPlan)}
    assert plan == ExpertPlan(**fields) and repr(plan) == repr(ExpertPlan(**fields))
    assert (plan.fetched, plan.warm, len(plan.bypassed)) == (2, False, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.hits = 5  # type: ignore[misc]
