"""`moetray bench engine --formats BF16,Q8_0,Q4_K`: the format axis of the engine benchmark.

One random-init Qwen3-MoE (the engine benchmark's checkpoint) written as GGUF in each format
(:func:`moetray.engine.models.gguf_export.export_gguf`), each served by the offloading runtime with
its experts kept as stored, side by side in one run: greedy decode of the same prompt at 25, 50
and 100 % expert capacity over the same emulated link (``--link-gbps``). Reported per row: tok/s
(CPU+link clock, as the engine benchmark's), bytes moved over the link per generated token, and
whether the tokens equal the same format's 100 % row (offloading is exact at any capacity).

Goals (issue 12): bytes/token falls with the stored size (Q4_K ≤ 0.35× BF16) and, on a throttled
link, tok/s at 25 % capacity ≥ 2× BF16's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from moetray.engine.bench.results import write_receipt

FORMAT_FRACTIONS = (0.25, 0.50, 1.00)


def _progress(msg: str) -> None:
    import sys

    print(f"[bench engine --formats] {msg}", file=sys.stderr, flush=True)


def _decode(model, prompt: torch.Tensor, tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, prompt.shape[1] :].tolist()


def run_formats(args, checkpoint: Path, workdir: Path, prompt: torch.Tensor, argv: list[str]) -> Path:
    """Export, load and time every format of ``args.formats``; write the ``engine-formats`` receipt."""
    from moetray.engine.experts import offload_loaded
    from moetray.engine.models.gguf import load_gguf, read_gguf
    from moetray.engine.models.gguf_export import export_gguf

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    models = []
    fill_bytes: dict[str, int] = {}  # per format: what one expert fill moves (the GGUF store's row)
    for fmt in formats:
        path = workdir / f"{checkpoint.name}-{fmt}.gguf"
        if not path.exists():
            _progress(f"writing {path.name}")
            export_gguf(checkpoint, path, fmt)
        ck = read_gguf(path)
        model, store, modules = load_gguf(ck, device=device, dtype=torch.float32)
        total = store.num_layers * store.num_experts
        om = offload_loaded(
            model,
            store,
            modules,
            device=device,
            capacity=total,
            link_gbps=args.link_gbps,
            fetch_fraction=args.fetch_fraction,
        )
        models.append((fmt, om, total, path))
        fill_bytes[fmt] = store.link_bytes(0)
        _progress(
            f"loaded {fmt}: store {store.format}, {store.total_bytes / 2**20:.1f} MiB host, "
            f"{store.link_bytes(0) / 2**10:.1f} KiB per expert fill"
        )
    runs: dict[tuple[str, float], dict[str, Any]] = {}
    for rep in range(args.repeats):  # round-robin, so load drift on a shared box hits every row alike
        for fmt, om, total, _ in models:
            rt = om.runtime
            for fraction in FORMAT_FRACTIONS:
                rt.resize(max(1, round(fraction * total)))
                _decode(om.model, prompt, max(2, args.tokens // 4))  # warm-up: the cache's steady state
                rt.reset_window()
                moved, slept, cpu, wall = (
                    rt.total_bytes,
                    rt.throttle.slept_s if rt.throttle else 0.0,
                    time.process_time(),
                    time.perf_counter(),
                )
                tokens = _decode(om.model, prompt, args.tokens)
                wall = time.perf_counter() - wall
                busy = time.process_time() - cpu + (rt.throttle.slept_s if rt.throttle else 0.0) - slept
                rec = runs.setdefault((fmt, fraction), {"tok_s": [], "wall": [], "bpt": [], "tokens": None})
                rec["tok_s"].append(args.tokens / busy)
                rec["wall"].append(args.tokens / wall)
                rec["bpt"].append((rt.total_bytes - moved) / args.tokens)
                rec["tokens"] = tokens
                _progress(
                    f"  [{rep + 1}/{args.repeats}] {fmt} {fraction:.0%}: {rec['tok_s'][-1]:.1f} tok/s, "
                    f"{rec['bpt'][-1] / 2**20:.2f} MiB/token"
                )
    for fmt, om, total, path in models:
        full = runs[(fmt, 1.0)]["tokens"]
        for fraction in FORMAT_FRACTIONS:
            rec = runs[(fmt, fraction)]
            rows.append(
                {
                    "format": fmt,
                    "store_format": om.store.format,
                    "fraction": fraction,
                    "capacity": max(1, round(fraction * total)),
                    "tok_s": statistics.median(rec["tok_s"]),
                    "runs_tok_s": rec["tok_s"],
                    "wall_tok_s": statistics.median(rec["wall"]),
                    "bytes_per_token": statistics.median(rec["bpt"]),
                    "expert_fill_bytes": fill_bytes[fmt],
                    "store_bytes": om.store.total_bytes,
                    "file_bytes": path.stat().st_size,
                    "identical_to_full": rec["tokens"] == full,
                }
            )
    base = {r["fraction"]: r for r in rows if r["format"] == formats[0]}
    for r in rows:
        b = base[r["fraction"]]
        r["bytes_vs_first"] = r["bytes_per_token"] / b["bytes_per_token"] if b["bytes_per_token"] else None
        r["tok_s_vs_first"] = statistics.median(
            a / c for a, c in zip(r["runs_tok_s"], b["runs_tok_s"], strict=True)
        )
    goals: dict[str, bool | None] = {}
    q4 = {r["fraction"]: r for r in rows if r["format"] == "Q4_K"}
    if q4 and formats[0] == "BF16":
        goals["bytes/token Q4_K ≤ 0.35× BF16 (25 % capacity)"] = (q4[0.25]["bytes_vs_first"] or 9) <= 0.35
        goals["tok/s at 25 % capacity Q4_K ≥ 2× BF16"] = q4[0.25]["tok_s_vs_first"] >= 2.0
    goals["token-identical at every capacity (each format vs its 100 % row)"] = all(
        r["identical_to_full"] for r in rows
    )
    _progress("goals: " + "; ".join(f"{k}: {v}" for k, v in goals.items()))
    table = [
        [
            r["format"],
            f"{r['fraction']:.0%}",
            r["tok_s"],
            r["wall_tok_s"],
            r["bytes_per_token"] / 2**20,
            r["bytes_vs_first"],
            r["tok_s_vs_first"],
            "yes" if r["identical_to_full"] else "NO",
        ]
        for r in rows
    ]
    params = {
        k: getattr(args, k)
        for k in (
            "hidden",
            "inter",
            "layers",
            "experts",
            "top_k",
            "vocab",
            "tokens",
            "prompt",
            "repeats",
            "link_gbps",
            "device",
            "formats",
        )
    }
    params["threads"] = torch.get_num_threads()
    return write_receipt(
        "engine-formats",
        params=params,
        results={"rows": rows, "goals": goals},
        columns=[
            "format",
            "capacity",
            "tok/s (CPU+link)",
            "tok/s (wall)",
            "MiB/token over link",
            f"bytes × {formats[0]}",
            f"tok/s × {formats[0]}",
            "identical",
        ],
        rows=table,
        title=f"Formats: the same model stored as {', '.join(formats)} ({args.device}, "
        + (f"link {args.link_gbps:g} GB/s emulated)" if args.link_gbps else "real link)"),
        notes=[
            f"Random-init Qwen3-MoE H={args.hidden}, I={args.inter}, {args.layers} layers × {args.experts} "
            f"experts, top-{args.top_k}, written as GGUF in each format by moetray's exporter; experts kept "
            "as stored in the host tier, decoded on each slot fill; compute in float32.",
            "bytes/token counts what slot fills moved (the stored size of each missed expert).",
            *[f"{k}: {'met' if v else ('n/a' if v is None else 'NOT met')}" for k, v in goals.items()],
            "reproduce: `.venv/bin/moetray bench engine "
            + " ".join(a for a in argv if "workdir" not in a)
            + "`",
        ],
    )
