"""`moetray bench gemv`: what a decode step's int8 products cost per weight, against the memory bound.

A decode step of a few requests multiplies every int8 weight matrix by a few activation rows.
This measures those products as the engine computes them, on weights that stream from memory
(more bytes than the last-level cache), at the engine's intra-op threads:

- ``compiled multiply-and-sum``: :func:`~moetray.engine.cb.one_row.one_row_int8_product`, the
  formula the compiled decode step traces for a one-row int8 linear (and the experts' kernel
  uses per token-expert pair);
- ``int8 kernel``: torch's weight-only int8 kernel (``_weight_int8pack_mm``);
- ``few-rows kernel``: ``moetray::int8_rows_mm`` (:mod:`~moetray.engine.models.few_rows`), what an
  int8 linear of 1 to 8 rows calls where it builds (left out where it does not);

each as one compiled graph over every matrix (as a step's graph calls its products back to back:
no Python between them), and against the read bandwidth of the same threads (``bench decode``'s:
a float32 sum over 512 MiB). Per rows count and form: µs per matrix, weight GB/s, that over the
read bandwidth, and the time over the form's own one-row time (how a step's cost grows with its
batch: 1.0 would be a kernel that reads each weight once for every row).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from moetray.engine.bench.results import receipt_name, write_receipt
from moetray.engine.compiling import compile_region

FORMS = ("compiled multiply-and-sum", "int8 kernel", "few-rows kernel")


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: compiled, caches primed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _torch_int8_kernel(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, qweight, qscale)


def _few_rows_kernel(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.moetray.int8_rows_mm(x, qweight, qscale)


def measure(*, out_features: int, in_features: int, stream_mib: int, rows: list[int], threads: int,
            repeats: int) -> dict:
    """The measurements (see the module docstring); ``stream_mib`` of int8 weights in all."""
    from moetray.engine.bench.decode import read_bandwidth_gbs
    from moetray.engine.cb.one_row import one_row_int8_product
    from moetray.engine.models import few_rows

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per = out_features * in_features
        count = max(1, (stream_mib << 20) // per)
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
                   for _ in range(count)]
        scale = torch.rand(out_features, generator=gen).to(torch.bfloat16)
        read_gbs = read_bandwidth_gbs(repeats)
        out: list[dict] = []
        with torch.no_grad():
            products = {FORMS[0]: one_row_int8_product, FORMS[1]: _torch_int8_kernel}
            if few_rows.build() is None:
                products[FORMS[2]] = _few_rows_kernel
            for name, product in products.items():
                # One graph for a whole pass, as a step's graph calls its products back to back.
                def one_pass(x: torch.Tensor, product=product) -> list[torch.Tensor]:
                    return [product(x, w, scale, None) for w in weights]

                compiled = compile_region(one_pass, fullgraph=True, dynamic=False, recompile_limit=64)
                for m in rows:
                    x = torch.randn(m, in_features, generator=gen).to(torch.bfloat16)
                    seconds = _best_seconds(functools.partial(compiled, x), repeats)
                    out.append({"form": name, "rows": m, "us_per_matrix": seconds / count * 1e6,
                                "weight_gbs": count * per / seconds / 1e9})
        for r in out:
            one = next(o for o in out if o["form"] == r["form"] and o["rows"] == rows[0])
            r["x_read_bandwidth"] = r["weight_gbs"] / read_gbs
            r["x_first_rows_time"] = r["us_per_matrix"] / one["us_per_matrix"]
        return {"matrices": count, "read_gbs": read_gbs, "rows": out}
    finally:
        torch.set_num_threads(before)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moetray bench gemv", description=__doc__.splitlines()[0])
    ap.add_argument("--out-features", type=int, default=512, help="the demo's shared expert: 512")
    ap.add_argument("--in-features", type=int, default=576, help="the demo's hidden size: 576")
    ap.add_argument("--stream-mib", type=int, default=48,
                    help="int8 weights in all (past a 32 MiB last-level cache)")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--threads", default="1,2",
                    help="intra-op thread counts (a decode step's: 1, the budget)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--receipt", type=receipt_name, default="gemv")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    runs = {}
    table = []
    for threads in (int(t) for t in args.threads.split(",")):
        got = measure(out_features=args.out_features, in_features=args.in_features,
                      stream_mib=args.stream_mib, rows=rows, threads=threads, repeats=args.repeats)
        runs[threads] = got
        for r in got["rows"]:
            table.append([threads, r["rows"], r["form"], r["us_per_matrix"], r["weight_gbs"],
                          got["read_gbs"], r["x_read_bandwidth"], r["x_first_rows_time"]])
            print(f"[bench gemv] {threads} thread(s), {r['rows']} row(s), {r['form']}: "
                  f"{r['us_per_matrix']:.1f} µs, {r['weight_gbs']:.1f} GB/s", flush=True)
    params = vars(args) | {"rows": rows}
    path = write_receipt(
        args.receipt, params=params, results=runs,
        columns=["threads", "rows", "form", "µs / matrix", "weight GB/s", "read GB/s",
                 "× read bandwidth", f"time × {rows[0]} row(s)"],
        rows=table,
        title="Decode's int8 products per weight: the compiled multiply-and-sum, torch's int8 kernel and "
              "the few-rows kernel against the read bandwidth (CPU)",
        notes=[f"{args.out_features}×{args.in_features} int8 matrices, {args.stream_mib} MiB in all "
               "(streamed from memory), bfloat16 activations, per-channel bfloat16 scales; best of "
               f"{args.repeats} passes over every matrix.",
               "Each form is one compiled graph over every matrix. compiled multiply-and-sum: "
               "one_row_int8_product (engine/cb/one_row.py), the loop the compiled decode step runs for "
               "a one-row int8 linear and, per token-expert pair, for the experts; int8 kernel: torch's "
               "_weight_int8pack_mm; few-rows kernel: moetray::int8_rows_mm (engine/models/few_rows.py), "
               "what an int8 linear of 1 to 8 rows calls.",
               "time × first rows: 1.0 would be a kernel that reads each weight once for all its rows; "
               "the growth measured here is a share of what a step of several requests costs more.",
               "reproduce: `.venv/bin/moetray bench gemv " + " ".join(argv) + "`"])
    print(f"[bench gemv] receipt: {path}")
    return 0
