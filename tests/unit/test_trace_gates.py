"""Gates of the trace benchmark, on small traces: the optima are right, and the default
policy never collapses, never trails LRU or LFU, and grows with capacity."""

from __future__ import annotations

import itertools
from functools import cache

import pytest

from moetray.engine.bench.trace import (
    Trace,
    capacity_points,
    cyclic_trace,
    run_min,
    run_policy,
    run_static_oracle,
    synthetic_trace,
)
from moetray.policy.moe.expert_cache import DEFAULT_POLICY


def brute_force_hits(trace: Trace, capacity: int, bypass: bool) -> int:
    """The optimum by exhaustive search: every admission and victim choice is tried."""
    calls = [tuple(layer * trace.num_experts + e for e in dict.fromkeys(ids))
             for step in trace.tokens for layer, ids in enumerate(step)]

    @cache
    def best(i: int, resident: frozenset[int]) -> int:
        if i == len(calls):
            return 0
        group = calls[i]
        hits = sum(1 for f in group if f in resident)
        misses = [f for f in group if f not in resident]
        evictable = sorted(resident - set(group))
        options = []
        for n_admit in range(len(misses) + 1) if bypass else [len(misses)]:
            for admitted in itertools.combinations(misses, n_admit):
                overflow = max(0, len(resident) + n_admit - capacity)
                if overflow > len(evictable):
                    continue
                for victims in itertools.combinations(evictable, overflow):
                    options.append((resident - set(victims)) | set(admitted))
        return hits + max(best(i + 1, frozenset(state)) for state in options)

    return best(0, frozenset())


TINY = [
    Trace("t1", "synthetic", 2, 3, 1, [[(0,), (1,)], [(1,), (1,)], [(2,), (0,)], [(0,), (1,)],
                                       [(1,), (2,)], [(0,), (1,)]]),
    Trace("t2", "synthetic", 1, 4, 2, [[(0, 1)], [(2, 3)], [(0, 2)], [(1, 3)], [(0, 1)], [(2, 0)],
                                       [(3, 1)]]),
    Trace("t3", "synthetic", 3, 3, 1, [[(0,), (0,), (1,)], [(1,), (0,), (2,)], [(0,), (2,), (1,)],
                                       [(2,), (0,), (1,)]]),
]


@pytest.mark.parametrize("trace", TINY, ids=lambda t: t.name)
def test_min_matches_brute_force_on_tiny_traces(trace):
    # A wrong MIN would make every "ratio to MIN" in the benchmark meaningless.
    for capacity in range(trace.top_k, 5):
        assert run_min(trace, capacity).hits == brute_force_hits(trace, capacity, bypass=False), capacity
        assert run_min(trace, capacity, bypass=True).hits == brute_force_hits(trace, capacity, bypass=True)


def small_synthetic(seed: int) -> Trace:
    return synthetic_trace(f"small-{seed}", 4, 16, 2, 600, alpha=1.0, stickiness=0.35, window=4,
                           phase_every=100, phase_shuffle=0.3, seed=seed)


SMALL = [small_synthetic(1), small_synthetic(2)]


@pytest.mark.parametrize("trace", SMALL, ids=lambda t: t.name)
def test_min_bounds_every_online_policy(trace):
    for _, cap in capacity_points(trace):
        h_min = run_min(trace, cap).hit_rate
        assert run_min(trace, cap, bypass=True).hit_rate >= h_min
        for policy in (DEFAULT_POLICY, "lru", "lfu", "layer_aware_lru"):
            assert run_policy(trace, cap, policy).hit_rate <= h_min + 1e-12, (policy, cap)


@pytest.mark.parametrize("trace", SMALL, ids=lambda t: t.name)
def test_default_never_trails_lru_or_lfu_by_more_than_a_point(trace):
    for label, cap in capacity_points(trace):
        mine = run_policy(trace, cap, DEFAULT_POLICY).hit_rate
        lru = run_policy(trace, cap, "lru").hit_rate
        lfu = run_policy(trace, cap, "lfu").hit_rate
        assert mine >= max(lru, lfu) - 0.01, (label, mine, lru, lfu)


@pytest.mark.parametrize("trace", SMALL, ids=lambda t: t.name)
def test_hit_rate_grows_with_capacity(trace):
    # LRU and MIN are stack algorithms; the default policy must not show Belady's anomaly here.
    caps = range(trace.top_k, trace.num_layers * trace.num_experts + 1, 6)
    for name, run in [("min", lambda c: run_min(trace, c)),
                      ("lru", lambda c: run_policy(trace, c, "lru")),
                      (DEFAULT_POLICY, lambda c: run_policy(trace, c, DEFAULT_POLICY))]:
        rates = [run(c).hit_rate for c in caps]
        assert all(b >= a - 1e-12 for a, b in zip(rates, rates[1:], strict=False)), (name, rates)


def test_cyclic_sweep_collapses_lru_but_not_the_default():
    # capacity < layers × top_k: global LRU evicts exactly what the next layer needs.
    trace = cyclic_trace(6, 16, 3, 40)
    for cap in (6, 9, 12, 17):
        if cap % 3 == 0:  # whole calls' worth of slots: every LRU victim is needed next
            assert run_policy(trace, cap, "lru").hit_rate == 0.0
        optimum = run_min(trace, cap).hit_rate
        assert optimum > 0
        assert run_policy(trace, cap, DEFAULT_POLICY).hit_rate >= 0.9 * optimum, cap


def test_static_oracle_counts_each_route_once():
    trace = TINY[0]
    everything = run_static_oracle(trace, trace.num_layers * trace.num_experts)
    assert everything.misses == 0 and everything.hits == sum(len(set(ids)) for s in trace.tokens for ids in s)
    assert run_static_oracle(trace, 1).hits == 4  # (layer 1, expert 1) is routed 4 times


def test_trace_reader_takes_the_demo_format_and_refuses_malformed_files(tmp_path):
    # The real-text traces come from another component: a silently misread file would
    # turn every number of the benchmark into noise.
    import json

    from moetray.engine.bench.trace import load_trace_json

    good = {"num_layers": 2, "num_experts": 4, "top_k": 2, "reuse_w1": 0.5,
            "tokens": [[[0, 1], [2, 3]], [[1, 0], [3, 2]]]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good))
    trace = load_trace_json(path)
    assert (trace.num_layers, trace.num_experts, trace.top_k, trace.source) == (2, 4, 2, "real")
    assert trace.tokens[1] == [(1, 0), (3, 2)] and trace.reuse(1) == 1.0
    for bad in ({**good, "tokens": [[[0, 1]]]}, {**good, "tokens": [[[0, 4], [1, 2]]]},
                {k: v for k, v in good.items() if k != "top_k"}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            load_trace_json(path)
