"""`moetray bench batch`: batched decode through continuous batching, the experts runtime alone.

`moetray bench serve` measures whole servers over HTTP; this isolates what the offloading
experts runtime costs on a batched step. One process, one checkpoint (default: the serving
benchmark's model), transformers' continuous batching with the serving benchmark's geometry
(page 16, 256 batch tokens), ``--batch`` prompts decoded together, every expert resident:

- **stock eager** and **stock grouped_mm**: the resident model with each stock experts
  implementation (``transformers serve`` runs grouped_mm);
- **moetray eager**: the runtime's eager-exact path (the only path before the grouped one);
- **moetray grouped_mm, one thread for GEMMs**: the default arithmetic, every group's GEMM on
  the calling thread;
- **moetray grouped_mm**: the default, with a step's small groups shared over the torch
  thread budget (the same as the previous row when ``--threads 1``).

Rows run round-robin (``--rounds``), medians reported: completion tokens per second of wall
time and this process's CPU milliseconds per token. Every moetray row's tokens are checked
against the stock row of the same arithmetic. The receipt is ``bench/results/batch.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _progress(msg: str) -> None:
    print(f"[bench batch] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moetray bench batch", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint (default: the serving benchmark's 4k-context tiny MoE)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (the serving benchmark's default)")
    parser.add_argument("--batch", default="1,4,8", help="prompts decoded together, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from moetray.engine.bench.results import write_receipt
    from moetray.engine.bench.serve import ensure_bench_model
    from moetray.engine.experts import grouped as grouped_module
    from moetray.engine.experts import load_offloaded_model, load_resident_model
    from moetray.engine.experts import runtime as runtime_module

    torch.set_num_threads(args.threads)
    checkpoint = args.model or ensure_bench_model()
    batches = [int(b) for b in args.batch.split(",")]
    _progress(f"loading {checkpoint}")
    stock = load_resident_model(checkpoint)
    offloaded = load_offloaded_model(checkpoint, capacity=1)
    rt = offloaded.runtime
    rt.resize(rt.num_layers * rt.num_experts)  # every expert resident, as in the stock rows
    share_min = grouped_module.PARALLEL_MIN_GROUPS
    never = 1 << 30

    def select(model, *, impl: str | None = None, compute: str | None = None, share: bool = True):
        def apply() -> Any:
            if impl is not None:
                model.set_experts_implementation(impl)
            if compute is not None:
                rt.compute = compute
            grouped_module.PARALLEL_MIN_GROUPS = share_min if share else never
            return model
        return apply

    rows_spec = [
        ("stock eager", "eager", select(stock, impl="eager")),
        ("stock grouped_mm", "grouped_mm", select(stock, impl="grouped_mm")),
        ("moetray eager", "eager", select(offloaded.model, compute="eager")),
        ("moetray grouped_mm, GEMMs on one thread", "grouped_mm",
         select(offloaded.model, compute="grouped_mm", share=False)),
        ("moetray grouped_mm", "grouped_mm", select(offloaded.model, compute="grouped_mm")),
    ]
    generator = torch.Generator().manual_seed(0)
    vocab = stock.config.vocab_size
    prompts = [torch.randint(3, vocab, (24 + 3 * i,), generator=generator).tolist()
               for i in range(max(batches))]
    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    # No prefix sharing: every round prefills its prompts afresh, so rounds are alike.
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=256,
                                  max_requests_per_batch=max(batches), use_cuda_graph=False,
                                  allow_block_sharing=False)
    # One long-lived manager per model, as a server keeps one: a run times requests, not start-up.
    managers = {id(m): m.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
                for m in (stock, offloaded.model)}
    for manager in managers.values():
        manager.start()
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}

    def decode(model, batch: int) -> tuple[list[list[int]], float, float]:
        manager = managers[id(model)]
        t0, c0 = time.perf_counter(), time.process_time()
        ids = manager.add_requests(inputs=prompts[:batch], max_new_tokens=args.max_tokens)
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("the generation loop produced nothing for 60 s")
            if result.is_finished():
                done[result.request_id] = result.generated_tokens
        return [done[i] for i in ids], time.perf_counter() - t0, time.process_time() - c0

    try:
        for batch in batches:
            for _name, _, apply in rows_spec:  # warm-up: allocator, caches, the helper thread
                decode(apply(), batch)
            for rnd in range(args.rounds):
                order = rows_spec if rnd % 2 == 0 else rows_spec[::-1]
                for name, _, apply in order:
                    made, wall, cpu = decode(apply(), batch)
                    n = sum(len(t) for t in made)
                    runs.setdefault((name, batch), []).append((n / wall, cpu / n * 1e3))
                    tokens[(name, batch)] = made
                    _progress(f"batch {batch} round {rnd} {name}: {n / wall:.0f} tok/s")
    finally:
        for manager in managers.values():
            manager.stop(block=True, timeout=30)
        grouped_module.PARALLEL_MIN_GROUPS = share_min
        rt.compute = runtime_module.DEFAULT_COMPUTE

    table, results = [], []
    for batch in batches:
        base = {name: [r[0] for r in runs[(name, batch)]] for name, _, _ in rows_spec}
        for name, arithmetic, _ in rows_spec:
            tok_s = [r[0] for r in runs[(name, batch)]]
            cpu_ms = [r[1] for r in runs[(name, batch)]]
            twin = f"stock {arithmetic}"
            ratio = statistics.median(a / b for a, b in zip(tok_s, base["stock grouped_mm"], strict=True))
            identical = tokens[(name, batch)] == tokens[(twin, batch)]
            results.append({"row": name, "batch": batch, "tok_s": statistics.median(tok_s),
                            "runs_tok_s": tok_s, "cpu_ms_per_token": statistics.median(cpu_ms),
                            "vs_stock_grouped_mm": ratio, "identical_to": twin, "identical": identical})
            table.append([f"batch {batch}: {name}", statistics.median(tok_s), statistics.median(cpu_ms),
                          ratio, "yes" if identical else "NO"])
    ok = all(r["identical"] for r in results)
    params = {"model": str(checkpoint), "threads": args.threads, "batch": batches,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "page_size": 16, "max_batch_tokens": 256,
              "one_thread_max_macs": grouped_module.ONE_THREAD_MAX_MACS, "parallel_min_groups": share_min}
    path = write_receipt(
        "batch", params=params, results={"rows": results, "token_identical": ok},
        columns=["row", "tok/s (wall)", "CPU ms / token", "× stock grouped_mm",
                 "identical to its stock twin"],
        rows=table,
        title="Batched decode through continuous batching: the experts runtime vs stock (CPU)",
        notes=[
            f"{Path(checkpoint).name}: every expert resident in moetray's slot pool; greedy decode of "
            f"{args.max_tokens} tokens per prompt, prompts of 24+ tokens, {args.threads} torch thread(s); "
            f"rows round-robin, median of {args.rounds} rounds; ratios paired per round.",
            "moetray eager = the runtime's eager-exact path (its only path before the grouped one); "
            "moetray grouped_mm = the default now, bit-identical to stock grouped_mm.",
            f"Token identity with the stock row of the same arithmetic: {'met' if ok else 'NOT met'}.",
            "reproduce: `.venv/bin/moetray bench batch" + (" " + " ".join(argv) if argv else "") + "`",
        ])
    _progress(f"receipt: {path}")
    for row in table:
        print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
