"""Issue 11, defect 2: the KV pool a re-split retires is unmapped and its memory returned.

The startup pool used to be built before ``gc.freeze()``; the batch manager is a reference
cycle, a frozen cycle is never collected, so after the first re-split that pool stayed mapped
for the life of the process. Here each pool is filled (every page touched, as after long
traffic), then re-split away, and ``/proc/self/smaps`` and RSS must show it gone.
"""

from __future__ import annotations

import gc

import httpx
import psutil
from engine_harness import ADMIN

PAGE = 4096


def mappings_of(size: int, engine) -> int:
    """How many mappings of this process are exactly ``size`` bytes (page-rounded), not counting the
    live runner's attention mask, which is a mapping of its own (``kv.map_attention_mask_lazily``)
    and may have a pool's size: a 131,072-token pool's mask, 64 × 131,136 float32, is the 65,536-token
    pool's 33,570,816 bytes."""
    want = -(-size // PAGE) * PAGE
    masks = engine.engine.pools.runner.manager.batch_processor.inputs_and_outputs.attention_mask or {}
    live_masks = {mask.data_ptr() for mask in masks.values()}
    count = 0
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                count += hi - lo == want and lo not in live_masks
    return count


def fill_and_measure(engine) -> tuple[int, int]:
    """Serve a little traffic, touch every page of the live KV pool; returns (pool bytes, RSS)."""
    for _ in range(2):
        body = {"prompt": "memory is returned " * 20, "max_tokens": 4}
        assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60).status_code == 200
    engine.wait_idle()
    runner = engine.engine.pools.runner
    with runner.paused():
        runner.manager.batch_processor.cache.cache_tensor.fill_(1)
    live = engine.status()["pools"]["live_bytes"]["kv_pages"]
    assert live == runner.manager.batch_processor.cache.cache_tensor.nbytes
    return live, psutil.Process().memory_info().rss


def resplit(engine, kv_tokens: int) -> None:
    body = {"kv_tokens": kv_tokens}
    r = httpx.post(f"{engine.url}/admin/cache/rebuild", headers=ADMIN, json=body, timeout=120)
    assert r.status_code == 200, r.text


def test_a_retired_kv_pool_is_unmapped_and_rss_returns_after_every_resplit(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, budget_bytes=1 << 30, kv_tokens=131072)
    big, small = 131072, 65536
    gc.collect()  # an earlier test's engine, if garbage, unmaps its pools now
    startup_bytes, rss_full = fill_and_measure(engine)
    # Counted against the mappings of that size while the pool is live: an earlier test's engine may
    # still map one of the same size (seen once in a full run on a slower host), and may only go.
    startup_maps = mappings_of(startup_bytes, engine)
    assert startup_maps >= 1
    resplit(engine, small)
    assert mappings_of(startup_bytes, engine) <= startup_maps - 1, "the startup pool outlived a re-split"
    rss_after = psutil.Process().memory_info().rss
    # Less the new runner's own start (~14 MB in a full run: its warm-up, index storage): the
    # retired runner's attention mask, once wholly resident and returned with the pool, is no longer
    # resident at all (kv.map_attention_mask_lazily), so it no longer pads this difference.
    assert rss_full - rss_after >= 0.6 * startup_bytes, (rss_full, rss_after, startup_bytes)
    small_bytes, rss_small = fill_and_measure(engine)
    small_maps = mappings_of(small_bytes, engine)
    for _ in range(3):  # any number of re-splits with traffic between: nothing accumulates
        resplit(engine, big)
        assert mappings_of(small_bytes, engine) <= small_maps - 1
        fill_and_measure(engine)
        resplit(engine, small)
        assert mappings_of(startup_bytes, engine) <= startup_maps - 1
        _, rss = fill_and_measure(engine)
        assert rss <= 1.15 * rss_small, (rss, rss_small)


def test_a_compiled_engine_builds_its_graphs_before_the_freeze_and_maps_one_kv_pool(tiny_qwen3, start_engine):
    """A lossy format compiles its decode step at start (on a scratch runner) before the long-lived
    objects leave the cyclic GC: the graphs are frozen, so a full collection does not walk them
    (unfrozen, the demo's took 480 ms mid-request), and the scratch runner's KV pool was collected
    first, so one pool is mapped. Prevents: compiling in the live runner's start again, after the
    freeze (the graphs' objects stay in the collector's reach), or freezing the scratch pool."""
    engine = start_engine(tiny_qwen3, dtype="int8")
    assert engine.status()["model"]["decode_step"] == "compiled"
    runner = engine.engine.pools.runner
    assert mappings_of(runner.pool_bytes(), engine) == 1
    gc.collect()
    unfrozen = len(gc.get_objects())
    assert unfrozen < 20_000, f"{unfrozen} objects in the collector's reach after a compiled start"
