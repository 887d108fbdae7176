"""What ``policy.radix`` costs the scheduler at engine sizes (no model, no device).

The engine mirrors every completed KV block into the tree (page-id mode, one block id per
page) and asks it for evictions under pressure, on the generation thread between forward
passes. This measures those calls on trees of growing size: conversations share a
512-token system prompt and grow turn by turn, each turn re-inserting its whole sequence
(as the engine does when a block completes) after matching it.

Run: ``.venv/bin/python -m moetray.engine.bench.radix_cost`` → ``bench/results/radix_cost.json``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from moetray.engine.bench.results import write_receipt
from moetray.policy.radix import RadixCache


def measure(conversations: int, turn_tokens: int, turns: int, block_size: int, seed: int = 0) -> dict:
    rnd = random.Random(seed)
    cache = RadixCache(block_size, slot_unit="page")
    blocks = itertools.count()
    system = tuple(range(10**6, 10**6 + 512))
    match_s = insert_s = reinsert_s = 0.0
    ops = 0
    longest = 0
    for _ in range(conversations):
        seq = system
        for _ in range(turns):
            seq = seq + tuple(rnd.randrange(50_000) for _ in range(turn_tokens))
            t0 = time.perf_counter()
            match = cache.match_prefix(seq)
            match_s += time.perf_counter() - t0
            have = cache.slots_of(match.node)
            ids = list(have) + [next(blocks) for _ in range(len(seq) // block_size - len(have))]
            t0 = time.perf_counter()
            cache.insert_prefix(seq, ids)
            insert_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            cache.insert_prefix(seq, ids)  # a block completed: the engine re-mirrors the sequence
            reinsert_s += time.perf_counter() - t0
            ops += 1
            longest = max(longest, len(seq))
    pages = cache.total_size // block_size
    check = time.perf_counter()
    cache.check_integrity()
    check = time.perf_counter() - check
    evictions = 0
    t0 = time.perf_counter()
    while cache.evictable_size and evictions < 200:
        cache.evict(block_size)
        evictions += 1
    evict_s = (time.perf_counter() - t0) / max(evictions, 1)
    return {
        "conversations": conversations,
        "cached_pages": pages,
        "longest_sequence_tokens": longest,
        "match_us": 1e6 * match_s / ops,
        "insert_us": 1e6 * insert_s / ops,
        "reinsert_us": 1e6 * reinsert_s / ops,
        "evict_one_page_us": 1e6 * evict_s,
        "check_integrity_ms": 1e3 * check,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moetray bench radix_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    rows, results = [], []
    for n in args.conversations:
        r = measure(n, args.turn_tokens, args.turns, args.block_size)
        results.append(r)
        rows.append([r["conversations"], r["cached_pages"], r["match_us"], r["insert_us"],
                     r["reinsert_us"], r["evict_one_page_us"], r["check_integrity_ms"]])
        print(r)
    path = write_receipt(
        "radix_cost",
        params=vars(args),
        results=results,
        columns=["conversations", "cached pages", "match µs", "insert µs", "re-insert µs",
                 "evict 1 page µs", "check_integrity ms"],
        rows=rows,
        title="policy.radix call costs at engine sizes (page-id mode)",
        notes=[
            "Per call, averaged; sequences of 512 + k*256 tokens, block size 16.",
            "evict scans the tree for unlocked leaves: linear in nodes, called only under pressure.",
        ],
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
