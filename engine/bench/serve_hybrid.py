"""`moetray bench serve --hybrid`: serving a hybrid model (Gated DeltaNet + attention) with its state pool.

A random-weight Qwen3.5-MoE-style model (three linear-attention layers and one full-attention
layer, 16 experts, top-2, 4096-token context) is generated once into the cache, then measured
in one run:

1. **TTFT cold vs follow-up** — time to the first streamed token of a turn carrying a
   ``--prefix-tokens`` long history never seen before, against the next turn of the same
   conversation, which moetray resumes from the state snapshot at the last page boundary of
   the first turn (``usage.prompt_tokens_details.cached_tokens`` says how far);
2. **aggregate throughput** at concurrency 1, 4 and 8 — completion tokens per second of wall
   time through moetray's HTTP API, against transformers' own ``generate`` over a left-padded
   batch of the same size on the same model (in a child process with the server's thread count
   and environment, rounds interleaved with moetray's): ``transformers serve`` cannot serve this
   model (its continuous batching has no linear-attention cache), so ``generate`` is the stock
   baseline;
3. **re-split of the state pool** — ``POST /admin/cache/rebuild {"state_slots"}`` growing and
   shrinking the third pool (server ``elapsed_ms``).

Every request runs exactly ``--max-tokens`` tokens (``ignore_eos`` over HTTP,
``min_new_tokens`` for ``generate``), so both sides do the same work. The receipt goes to
``bench/results/serve-hybrid.json``; the goal is a follow-up TTFT ≥ 5× faster than cold.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from moetray.engine.bench.random_model import ensure_random_model
from moetray.engine.bench.serve import (
    ADMIN_TOKEN,
    GIB,
    Child,
    _env,
    cold_vs_followup,
    metered_throughput,
    report,
    start_moetray,
    stop_process_group,
)


def hybrid_bench_model_dir() -> Path:
    import platformdirs

    return platformdirs.user_cache_path("moetray") / "bench" / "serve-qwen35moe-4k"


def ensure_hybrid_bench_model(path: Path | None = None) -> Path:
    """A random Qwen3.5-MoE text model (4 layers: 3 Gated DeltaNet + 1 attention) with a ChatML BPE."""
    from transformers import Qwen3_5MoeTextConfig

    return ensure_random_model(
        path or hybrid_bench_model_dir(),
        Qwen3_5MoeTextConfig,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        shared_expert_intermediate_size=256,
    )


class GenerateBaseline:
    """transformers' own ``generate`` over left-padded batches of distinct chat prompts."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(self, *, batch: int, max_tokens: int, tag: str) -> dict[str, Any]:
        """One batch of ``batch`` prompts, ``max_tokens`` new tokens each; tokens per second of wall time."""
        import torch

        texts = [
            self.tok.apply_chat_template(
                [{"role": "user", "content": f"{tag} request {i}: tell me about experts, caches and pages."}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for i in range(batch)
        ]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                **enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
        wall = time.perf_counter() - t0
        tokens = (out.shape[1] - enc["input_ids"].shape[1]) * batch
        return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests": batch}


class GenerateChild:
    """A :class:`GenerateBaseline` in its own process, with the server's environment (threads,
    passive OpenMP waits: spinning workers on a shared machine would slow it for no reason of its
    own); one JSON job per line in, one JSON result per line out."""

    def __init__(self, model_dir: Path, threads: int, log: Path) -> None:
        env = {**_env(threads), "OMP_WAIT_POLICY": "PASSIVE"}
        cmd = [
            sys.executable,
            "-m",
            "moetray.engine.bench.serve_hybrid",
            "--generate-worker",
            str(model_dir),
            str(threads),
        ]
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )

    def run(self, **job: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the generate worker exited; see {self._log.name}")
        return json.loads(line)

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._log.close()


def _generate_worker(model_dir: str, threads: str) -> int:
    baseline = GenerateBaseline(Path(model_dir), int(threads))
    for line in sys.stdin:
        print(json.dumps(baseline.run(**json.loads(line))), flush=True)
    return 0


def state_resplits(url: str, slots: int) -> list[dict[str, Any]]:
    """Grow the state pool by half and back; the server's ``elapsed_ms`` and the bytes moved."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    out = []
    for direction, target in (("grow", slots + max(1, slots // 2)), ("shrink", slots)):
        r = httpx.post(
            f"{url}/admin/cache/rebuild", headers=headers, json={"state_slots": target}, timeout=600
        )
        r.raise_for_status()
        body = r.json()
        out.append(
            {
                "direction": direction,
                "elapsed_ms": body["elapsed_ms"],
                "before": body["before"],
                "after": body["after"],
                "outcome": body["outcome"],
            }
        )
    return out


def run(args: Any) -> int:
    """The hybrid serving benchmark with ``moetray bench serve``'s parsed arguments."""
    from transformers import AutoTokenizer

    print("preparing the hybrid benchmark model…", flush=True)
    model_dir = ensure_hybrid_bench_model() if args.model is None else args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    logdir = args.logdir or Path("/tmp") / f"moetray-bench-serve-hybrid-{int(time.time())}"
    logdir.mkdir(parents=True, exist_ok=True)
    common = dict(
        threads=args.threads, logdir=logdir, page=args.page_size, batch_tokens=args.max_batch_tokens
    )
    results: dict[str, Any] = {"throughput": {"moetray": {}, "transformers generate": {}}, "ttft": {}}
    children: list[Child | GenerateChild] = []
    try:
        print("starting moetray serve…", flush=True)
        mt = start_moetray(model_dir, kv_tokens=args.kv_tokens, budget=4 * GIB, prefix="radix", **common)
        children.append(mt)
        served_id = httpx.get(f"{mt.url}/v1/models").json()["data"][0]["id"]
        print(f"TTFT cold vs follow-up ({args.prefix_tokens}-token prefix)…", flush=True)
        results["ttft"]["moetray"] = asyncio.run(
            cold_vs_followup(
                mt.url, served_id, tokenizer, prefix_tokens=args.prefix_tokens, rounds=3, tag="hy"
            )
        )
        baseline = GenerateChild(model_dir, args.threads, logdir / "generate.log")
        children.append(baseline)
        baseline.run(batch=1, max_tokens=4, tag="warm-up")
        for c in (1, 4, 8):
            ours = results["throughput"]["moetray"][str(c)] = []
            theirs = results["throughput"]["transformers generate"][str(c)] = []
            for rnd in range(args.rounds):  # interleaved: a busy machine slows both alike
                print(f"throughput c={c} round {rnd}: moetray, then generate…", flush=True)
                res = asyncio.run(
                    metered_throughput(
                        mt,
                        served_id,
                        concurrency=c,
                        requests=max(c, args.requests // 2),
                        max_tokens=args.max_tokens,
                        tag=f"hy-{c}-{rnd}",
                        extra={"ignore_eos": True},
                    )
                )
                ours.append(res)
                theirs.append(baseline.run(batch=c, max_tokens=args.max_tokens, tag=f"gen-{c}-{rnd}"))
        status = httpx.get(
            f"{mt.url}/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ).json()
        results["pools"] = status["pools"]
        print("state pool re-split…", flush=True)
        results["state_resplit"] = state_resplits(mt.url, status["pools"]["state_slots"])
    finally:
        for child in children:
            child.stop()

    def med(name: str, c: int) -> float | None:
        runs = results["throughput"][name].get(str(c))
        return statistics.median(r["tok_s"] for r in runs) if runs else None

    rows = []
    t = results["ttft"]["moetray"]
    speedup = t["cold_ms_median"] / t["followup_ms_median"]
    rows.append(
        [
            "TTFT ms cold / follow-up from a state snapshot",
            t["cold_ms_median"],
            t["followup_ms_median"],
            speedup,
        ]
    )
    rows.append(["follow-up cached tokens (per round)", str(t["cached_tokens"]), None, None])
    for c in (1, 4, 8):
        a, b = med("moetray", c), med("transformers generate", c)
        rows.append(
            [f"aggregate tok/s, concurrency {c} (B: generate, batch {c})", a, b, (a / b) if a and b else None]
        )
    for r in results["state_resplit"]:
        rows.append(
            [
                f"re-split state {r['direction']} {r['before']['state_slots']}→{r['after']['state_slots']} "
                "slots (server ms)",
                r["elapsed_ms"],
                None,
                None,
            ]
        )
    goals = {"snapshot_ttft_speedup_ge_5": speedup >= 5.0}
    notes = [
        f"Goals: {goals} (follow-up speed-up {speedup:.3g}).",
        "A: moetray serve over HTTP (radix prefix cache with state snapshots, experts offloaded at its "
        "planned capacity). B: transformers' generate in a child process (same threads and environment) "
        "on a left-padded batch of the same size, every expert resident; transformers serve cannot serve "
        "a linear-attention model. Every request generates exactly max_tokens tokens on both sides. "
        "Random weights: the work per token is real.",
    ]
    results["goals"] = goals
    return report(
        "serve-hybrid", args, model_dir, baseline="transformers generate", results=results, rows=rows,
        title="Serving a hybrid model (Gated DeltaNet + attention): snapshots and throughput (CPU)",
        notes=notes,
    )

if __name__ == "__main__":
    if sys.argv[1:2] == ["--generate-worker"]:
        sys.exit(_generate_worker(*sys.argv[2:4]))
