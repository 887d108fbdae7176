"""`moetray bench demo`: how good the embedded demo MoE is, against the dense model it came from.

Measured side by side in one run, on held-out offline English (the stdlib docstrings the
calibration never saw, plus the wheel's Apache-2.0 licence), in 1024-token windows:

- perplexity of the dense model (the same bf16-rounded weights the MoE was cut from) and of the
  saved MoE checkpoint loaded at each offered top-k (Qwen2-MoE: ``num_experts_per_tok`` is a
  load-time choice, the weights are the same file);
- greedy answers to five simple chat prompts (chat template, 60 new tokens) from the dense
  model and the MoE at the default top-k and at one smaller k;
- a teacher-forced routing trace of held-out text at the default top-k and a smaller one,
  written to ``bench/traces/smollm2_moe_<layout>_k<K>.json`` for `moetray bench trace`, with
  the consecutive-token reuse statistic (share of a token's routed experts that the previous
  token also routed, per layer, against ``k/E`` by chance).

Receipt: ``bench/results/demo.json``; then `moetray bench tables`.

    moetray bench demo [--model DIR] [--tokens 6144] [--ks 16,14,12,10,8,6,4]
                       [--chat-tokens 60] [--trace-tokens 600] [--no-chat]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a computer is in two sentences.",
    "Write a short poem about the sea.",
    "What is 2 plus 2?",
]
WINDOW = 1024


def heldout_ids(tokenizer, wheel: Path | None) -> list[int]:
    """Held-out token ids: the stdlib docstrings outside the calibration split, then the licence."""
    from moetray.engine.demo.corpus import build_corpus, licence_document
    from moetray.engine.demo.source import wheel_license_text

    extra = [licence_document(wheel_license_text(wheel))] if wheel is not None and wheel.is_file() else []
    return tokenizer(build_corpus(extra).heldout, add_special_tokens=False)["input_ids"]


def perplexity(model, ids: list[int], window: int = WINDOW) -> float:
    """exp(mean next-token NLL) over non-overlapping ``window``-token windows of ``ids``."""
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start:start + window]).unsqueeze(0)
            if chunk.shape[1] < 2:
                break
            out = model(chunk, labels=chunk)
            nll += float(out.loss) * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def chat_answers(model, tokenizer, max_new_tokens: int) -> list[str]:
    """Greedy answers to :data:`CHAT_PROMPTS` through the checkpoint's chat template."""
    import torch

    answers = []
    for prompt in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def batcher_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers to ``prompts`` through the engine's own batcher, as a served request decodes:
    the compiled decode step where the model has one installed (decode steps on one thread, as
    ``policy.step_threads`` serves them), the paged KV cache. Runs every prompt to its length."""
    import asyncio

    from moetray.engine.cb import Sampling
    from moetray.engine.cb.runner import BatchRunner, RunnerConfig

    pages = sum(len(p) + max_new_tokens for p in prompts) // 16 + 2 * len(prompts)
    runner = BatchRunner(model, RunnerConfig(kv_pages=pages, page_size=16, one_thread_small_steps=True))
    runner.start()

    async def answers() -> list[list[int]]:
        finals: dict[int, list[int]] = {}
        done = asyncio.Event()

        def handler(i: int):
            def on_output(out) -> None:  # noqa: ANN001 - the substrate's GenerationOutput
                if out.is_finished():
                    finals[i] = list(out.generated_tokens)
                    if len(finals) == len(prompts):
                        done.set()
            return on_output

        for i, ids in enumerate(prompts):
            runner.submit(f"greedy-{i}", ids, max_new_tokens=max_new_tokens,
                          sampling=Sampling(temperature=0.0), on_output=handler(i))
        await asyncio.wait_for(done.wait(), timeout=600)  # a 2-core machine: 5 prompts in well under that
        return [finals[i] for i in range(len(prompts))]

    try:
        return asyncio.run(answers())
    finally:
        runner.stop()


def routing_trace(model, ids: list[int]) -> list[list[list[int]]]:
    """Teacher-forced routing: per token, per MoE layer, the sorted expert ids its router chose."""
    import torch

    per_layer: list[Any] = []
    hooks = []
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]
    for router in routers:
        hooks.append(router.register_forward_hook(lambda mod, inp, out: per_layer.append(out[2].detach())))
    try:
        with torch.no_grad():
            model(torch.tensor(ids).unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    stacked = torch.stack(per_layer, dim=1)  # [tokens, layers, k]
    return [[sorted(int(e) for e in layer) for layer in token] for token in stacked.tolist()]


def consecutive_reuse(tokens: list[list[list[int]]]) -> tuple[float, list[float]]:
    """Mean share of a token's routed experts the previous token routed too (overall, per layer)."""
    layers = len(tokens[0])
    per_layer = []
    for layer in range(layers):
        shares = [len(set(tokens[t][layer]) & set(tokens[t - 1][layer])) / len(tokens[t][layer])
                  for t in range(1, len(tokens))]
        per_layer.append(sum(shares) / len(shares))
    return sum(per_layer) / layers, per_layer


def _load_moe(folder: Path, top_k: int):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, num_experts_per_tok=top_k).eval()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="moetray bench demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="demo checkpoint (default: build/reuse the embedded one)")
    p.add_argument("--tokens", type=int, default=6144, help="held-out tokens for perplexity")
    p.add_argument("--ks", default=None, help="top-k values to measure (default: 16,14,12,10,8,6,4 ≤ E)")
    p.add_argument("--chat-tokens", type=int, default=60)
    p.add_argument("--trace-tokens", type=int, default=600)
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--trace-dir", type=Path, default=None, help="default: bench/traces beside bench/results")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from moetray.engine.bench.results import results_dir, write_receipt
    from moetray.engine.demo import demo_source_cache, ensure_demo_model, read_sidecar
    from moetray.engine.demo.build import load_dense
    from moetray.engine.demo.source import WHEEL_FILENAME, dense_model_dir

    folder = args.model or ensure_demo_model(lambda s, d, t: print(f"  {s} {d}/{t}", flush=True))
    meta = read_sidecar(folder)
    if meta is None:
        raise SystemExit(f"{folder} has no moetray.json: not a demo checkpoint")
    recipe = meta["recipe"]
    experts, default_k, layout = meta["num_experts"], meta["default_top_k"], meta["layout"]
    offered = [k for k in (16, 14, 12, 10, 8, 6, 4) if k <= experts]
    ks = [int(k) for k in args.ks.split(",")] if args.ks else offered
    if not meta["top_k_adjustable"]:
        ks = [default_k]
    cache = demo_source_cache()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = heldout_ids(tokenizer, cache / WHEEL_FILENAME)
    ppl_ids = ids[:args.tokens]
    trace_ids = ids[args.tokens:args.tokens + args.trace_tokens] or ids[:args.trace_tokens]

    started = time.monotonic()
    dense = load_dense(dense_model_dir(cache), recipe["dtype"])
    t = time.monotonic()
    dense_ppl = perplexity(dense, ppl_ids)
    with torch.no_grad():
        probe = torch.tensor(ppl_ids[:WINDOW]).unsqueeze(0)
        dense_logits = dense(probe).logits[0]
    rows_raw: list[dict[str, Any]] = [{"model": "dense", "top_k": None, "ppl": dense_ppl,
                                       "seconds": time.monotonic() - t}]
    chats: dict[str, list[str]] = {}
    if not args.no_chat:
        chats["dense"] = chat_answers(dense, tokenizer, args.chat_tokens)
    del dense
    print(f"dense ppl {dense_ppl:.3f}", flush=True)

    inter = 1536
    shared = recipe["shared_size"] if layout == "qwen2_moe" else 0
    per_expert = (inter - shared) // experts
    chat_ks = sorted({default_k, max(1, default_k - 4)} & set(ks) or {default_k}, reverse=True)
    traces: dict[int, dict[str, Any]] = {}
    equivalence: dict[str, Any] | None = None
    for k in ks:
        moe = _load_moe(folder, k)
        t = time.monotonic()
        ppl = perplexity(moe, ppl_ids)
        if k == experts:
            with torch.no_grad():
                got = moe(probe).logits[0]
            agree = (got.argmax(-1) == dense_logits.argmax(-1)).float().mean()
            equivalence = {"max_abs_logit_diff": float((got - dense_logits).abs().max()),
                           "argmax_agreement": float(agree), "tokens": WINDOW}
        row = {"model": f"MoE {layout}", "top_k": k, "ppl": ppl, "seconds": time.monotonic() - t,
               "routed_skipped": 1 - k / experts, "ffn_active": (shared + k * per_expert) / inter}
        rows_raw.append(row)
        print(f"k={k} ppl {ppl:.3f}", flush=True)
        if k in chat_ks and not args.no_chat:
            chats[f"k={k}"] = chat_answers(moe, tokenizer, args.chat_tokens)
        if k in chat_ks and args.trace_tokens:
            tokens = routing_trace(moe, trace_ids)
            reuse, per_layer = consecutive_reuse(tokens)
            traces[k] = {"num_layers": len(tokens[0]), "num_experts": experts, "top_k": k,
                         "source": f"{meta['label']}; teacher-forced held-out stdlib docstrings",
                         "layout": layout, "consecutive_reuse": round(reuse, 4),
                         "chance_reuse": k / experts, "per_layer_reuse": [round(r, 4) for r in per_layer],
                         "tokens": tokens}
        del moe

    trace_dir = args.trace_dir or results_dir().parent / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace_files = {}
    for k, trace in traces.items():
        path = trace_dir / f"smollm2_moe_{layout}_k{k}.json"
        path.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
        trace_files[k] = str(path)

    goal = [r for r in rows_raw[1:] if r["routed_skipped"] >= 0.25 and r["ppl"] <= 1.5 * dense_ppl]
    columns = ["model", "top-k", "routed experts skipped", "FFN active", "ppl", "ppl / dense"]
    rows = [[r["model"], r["top_k"], None if r["top_k"] is None else f"{r['routed_skipped']:.0%}",
             "100%" if r["top_k"] is None else f"{r['ffn_active']:.0%}", round(r["ppl"], 2),
             round(r["ppl"] / dense_ppl, 3)] for r in rows_raw]
    notes = [f"Held-out: {len(ppl_ids)} tokens of stdlib docstrings outside the calibration split "
             f"(+ Apache-2.0 licence), {WINDOW}-token windows; dense = the same bf16-rounded weights.",
             f"Default top-k {default_k} of {experts} routed experts"
             + (f" + a shared expert of {shared} neurons" if shared else "") + ".",
             "Goal (≥ 25 % routed experts skipped at ≤ 1.5× dense ppl) met at k = "
             + (", ".join(str(r["top_k"]) for r in goal) or "none") + "."]
    if equivalence is not None:
        notes.append(f"All {experts} experts active against dense on {WINDOW} tokens: max |Δlogit| "
                     f"{equivalence['max_abs_logit_diff']:.4f}, argmax agreement "
                     f"{equivalence['argmax_agreement']:.2%}.")
    for name, answers in chats.items():
        # Both models compute in float32 here; a served default (`--dtype auto`: bfloat16 on CPUs
        # that compute it) answers differently, as `moetray bench decode`'s quality notes measure.
        notes.append(f"Chat, {name} (float32, greedy): "
                     + " | ".join(a.replace("\n", " ")[:160] for a in answers))
    for k, trace in traces.items():
        notes.append(f"Trace k={k}: {len(trace['tokens'])} tokens, consecutive-token reuse "
                     f"{trace['consecutive_reuse']:.2f} (chance {trace['chance_reuse']:.2f}); "
                     f"`{trace_files[k]}`.")
    path = write_receipt(
        "demo", title="Demo model quality: MoEfied SmolLM2-135M against its dense source",
        params={"model": str(folder), "recipe_id": meta["recipe_id"], "recipe": recipe,
                "tokens": len(ppl_ids), "ks": ks, "chat_tokens": args.chat_tokens,
                "trace_tokens": len(trace_ids), "threads": torch.get_num_threads()},
        results={"dense_ppl": dense_ppl, "rows": rows_raw, "chat": {"prompts": CHAT_PROMPTS, **chats},
                 "goal_met_at": [r["top_k"] for r in goal], "all_experts_vs_dense": equivalence,
                 "traces": trace_files,
                 "reuse": {k: tr["consecutive_reuse"] for k, tr in traces.items()},
                 "seconds": time.monotonic() - started},
        columns=columns, rows=rows, notes=notes)
    print(f"wrote {path}")
    return 0
