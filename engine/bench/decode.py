"""`moetray bench decode`: where decode time goes, per weight format, against the memory bound.

One process hosts one served engine per weight format (``--dtype``, default
``float32,bfloat16,int8``; ``float16`` too where the CPU computes it), each behind its own HTTP
server on loopback exactly as ``moetray serve`` builds it, every expert resident. A separate
client process (:mod:`moetray.engine.bench.loadgen`) streams greedy chat completions of
``--max-tokens`` tokens at concurrency 1, 4 and 8 (``--batch``); formats (and peers, below)
take turns round by round, so their ratios come from the same minutes of a shared machine.
Measured per format and batch:

- **tok/s**: per request (decode: tokens after the first over the time from first to last)
  and aggregate (all tokens over the wall time), at the client; and the engine's own decode
  rate (decode steps × batch over their wall time);
- **bytes of weights read per token**: the non-expert weights one step reads (the LM head
  included, the embedding table not: a step reads one row of it) plus the distinct experts
  the step routed to, divided by the tokens the step decoded;
- **memory bandwidth** measured in the same run (best of five reads of 512 MiB with the
  serving threads), and the **fraction of the bound** ``tok/s ÷ (B_mem ÷ bytes per token)``;
- **threads busy**: the engine process's CPU seconds over wall seconds (2.0 = both cores),
  and the generation and event-loop threads' shares;
- the **per-step breakdown** (:mod:`moetray.engine.bench.breakdown`): attention, experts,
  other forward, sampler, scheduler/ledger, outputs, on the generation thread; HTTP, SSE and
  detokenization as the event-loop thread's CPU ms per step;
- **correctness**: each reduced-precision format against float32 on the demo's held-out text
  (teacher-forced in chunks of ``FUSED_MAX_TOKENS`` tokens over the KV cache, so the compiled
  decode kernel computes them as it computes decode steps: max and mean |Δlogit|, argmax
  agreement) and greedy agreement on chat prompts.

A spec ``FORMAT:grouped`` serves that format with ``--no-compile`` beside the compiled one
(default: ``bfloat16:grouped``), so the compiled decode kernel's gain is measured in the same rounds.

``--peer LABEL=URL`` (repeatable) measures another OpenAI-compatible server that is already
running (for example llama.cpp's) with the same client in the same rounds, and reports the
ratios. Where llama.cpp serves a Q8_0 file and ``int8`` is among the formats, moetray also serves
that very file under ``--dtype int8`` (target ``int8 (Q8_0 file)``).
The receipt is ``bench/results/decode.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetray.engine import serve as _serve  # noqa: F401 - sets OMP_WAIT_POLICY before torch loads
from moetray.engine.bench.results import receipt_name
from moetray.engine.bench.rss_goal import RSS_GOAL, rss_goal_from_receipt
from moetray.engine.bench.targets import (
    LlamaServer,
    ServedEngine,
    demo_llama_files,
    llama_file,
    progress,
    run_client,
)

if TYPE_CHECKING:
    from moetray.engine.bench.breakdown import StepBreakdown

GB = 1e9
DEFAULT_FORMATS = "float32,bfloat16,bfloat16:grouped,int8"
GROUPED = ":grouped"
"""A format spec's suffix: that format served with ``--no-compile`` (the grouped GEMMs at every batch),
so the compiled decode kernel's gain is a ratio from the same rounds."""


def format_spec(spec: str) -> tuple[str, str, bool]:
    """``"bfloat16:grouped"`` → ``("bfloat16 (grouped GEMMs)", "bfloat16", False)``: label, format,
    whether the decode kernel is compiled."""
    if spec.endswith(GROUPED):
        fmt = spec.removesuffix(GROUPED)
        return f"{fmt} (grouped GEMMs)", fmt, False
    return spec, spec, True


# --- measurements that need no engine ----------------------------------------------------------


def read_bandwidth_gbs(repeats: int = 5, size: int = 512 << 20) -> float:
    """This machine's DRAM read rate with torch's current threads: best of ``repeats`` sums of a
    ``size``-byte float32 buffer (far larger than any cache)."""
    import torch

    buf = torch.ones(size // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return size / best / GB


def dense_bytes_per_step(model) -> int:
    """Bytes of non-expert weights one forward step reads: every parameter once (tied weights
    once), except an input embedding table that is not also the LM head (a step reads one row)."""
    def tensors(module) -> list:
        return [] if module is None else [*module.parameters(), *module.buffers()]

    head = {t.data_ptr() for t in tensors(model.get_output_embeddings())}
    table_only = {t.data_ptr() for t in tensors(model.get_input_embeddings())} - head
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *_weight_buffers(model)]:
        if tensor.data_ptr() in seen or tensor.device.type == "meta":
            continue
        seen.add(tensor.data_ptr())
        if tensor.data_ptr() not in table_only:
            total += tensor.numel() * tensor.element_size()
    return total


def _weight_buffers(model) -> list:
    """Quantized weights live in buffers (``int8`` format); plain models have none that count."""
    return [b for name, b in model.named_buffers() if name.endswith(("qweight", "qscale"))]


def _decode_tok_s(reply: dict[str, Any]) -> float | None:
    """One request's decode rate: tokens after the first over the time from the first to the last."""
    if reply["ttft_s"] is None or reply["last_s"] is None or reply["tokens"] < 2:
        return None
    span = reply["last_s"] - reply["ttft_s"]
    return (reply["tokens"] - 1) / span if span > 0 else None


def measure_round(target: ServedEngine | dict[str, Any], label: str, *, batch: int, max_tokens: int,
                  tag: str) -> dict[str, Any]:
    """One client round against ``target`` (a :class:`ServedEngine` or a peer), with the engine's
    own counters read around it when ``target`` is an engine."""
    import psutil

    if isinstance(target, ServedEngine):
        url, model, extra, server = target.url, target.model_id(), None, None
        proc = psutil.Process()
    else:
        url, model, extra, server = target["url"], target["model"], target.get("extra"), target.get("server")
        proc = psutil.Process(server.proc.pid) if server is not None else None
    cpu0 = proc.cpu_times() if proc is not None else None
    counters = _EngineCounters.start(target) if isinstance(target, ServedEngine) else None
    t0 = time.perf_counter()
    client = run_client(url, model, concurrency=batch, max_tokens=max_tokens, tag=tag, extra=extra,
                        warm_up=False, server=None if server is None else server.proc)
    cpu1 = proc.cpu_times() if proc is not None else None
    wall = client["wall_s"]  # the requests' window (the client's own start-up excluded)
    replies = client["requests"]
    decode_rates = [r for r in (_decode_tok_s(x) for x in replies) if r is not None]
    row: dict[str, Any] = {
        "label": label, "batch": batch, "tokens": client["tokens"],
        "aggregate_tok_s": client["aggregate_tok_s"],
        "request_decode_tok_s": statistics.median(decode_rates) if decode_rates else None,
        "ttft_ms": statistics.median(x["ttft_s"] for x in replies if x["ttft_s"] is not None) * 1e3,
        "round_wall_s": time.perf_counter() - t0,
    }
    if cpu0 is not None and cpu1 is not None:
        busy_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        row["threads_busy"] = busy_s / wall
        row["server_cpu_ms_per_token"] = busy_s / max(1, client["tokens"]) * 1e3
    if server is not None:
        row["rss_bytes"] = server.rss_bytes()
    if counters is not None:
        row.update(counters.since(wall))
    return row


@dataclass(frozen=True)
class _EngineCounters:
    """A served engine's own counters at the start of a round: its step breakdown (reset then),
    experts routed, the generation and event-loop threads' CPU seconds, and the decode steps
    the engine ran on its whole thread budget and on one thread (``engine.cores.DecodeTeam``)."""

    served: ServedEngine
    breakdown: StepBreakdown
    routed: int
    gen_cpu_s: float | None
    loop_cpu_s: float | None
    team_steps: tuple[int, int] | None

    @classmethod
    def start(cls, served: ServedEngine) -> _EngineCounters:
        from moetray.engine.bench.breakdown import thread_cpu_seconds

        bd = served.breakdown
        if bd is None:
            raise RuntimeError(f"{served.format} engine: install_breakdown() before measuring a round")
        bd.reset()
        return cls(
            served, bd, bd_routed(served),
            thread_cpu_seconds(bd.generation_thread) if bd.generation_thread else None,
            thread_cpu_seconds(served.loop_thread) if served.loop_thread else None,
            served.team_steps(),
        )

    def since(self, wall: float) -> dict[str, Any]:
        """The round's engine columns, ``wall`` seconds after :meth:`start`."""
        from moetray.engine.bench.breakdown import thread_cpu_seconds

        bd, gen0, loop0 = self.breakdown, self.gen_cpu_s, self.loop_cpu_s
        totals = bd.totals()
        gen1 = thread_cpu_seconds(bd.generation_thread) if bd.generation_thread else None
        loop1 = thread_cpu_seconds(self.served.loop_thread) if self.served.loop_thread else None
        steps = totals.decode_steps
        team0, team1 = self.team_steps, self.served.team_steps()
        ran = None if team0 is None or team1 is None else (team1[0] - team0[0], sum(team1) - sum(team0))
        return {
            "team_decode_share": ran[0] / ran[1] if ran and ran[1] else None,
            "generation_thread_busy": None if gen0 is None or gen1 is None else (gen1 - gen0) / wall,
            "loop_thread_busy": None if loop0 is None or loop1 is None else (loop1 - loop0) / wall,
            "decode_steps": steps, "prefill_steps": totals.prefill_steps,
            "engine_decode_tok_s": (totals.decode_tokens / totals.decode_wall_s
                                    if totals.decode_wall_s else None),
            "step_ms": totals.per_step_ms(),
            "http_sse_detok_ms_per_step": (None if loop0 is None or loop1 is None or not steps
                                           else (loop1 - loop0) / (steps + totals.prefill_steps) * 1e3),
            "routed_experts_per_decode_step": ((bd_routed(self.served) - self.routed) / steps
                                               if steps else None),
        }


def bd_routed(target: ServedEngine) -> int:
    """Distinct experts routed so far in decode and prefill steps alike (hits + misses)."""
    stats = target.served_model().loaded.runtime.cache.per_layer_stats()
    return sum(s.hits + s.misses for s in stats)


# --- correctness of the reduced-precision formats ----------------------------------------------


def precision_report(model_dir: Path, formats: list[str], *, tokens: int = 512, chat_tokens: int = 32,
                     q8_file: Path | None = None) -> dict[str, Any]:
    """Each format against float32: teacher-forced logits on held-out text (chunks of up to 8
    tokens through the experts' decode kernel, eager), greedy chat answers through the engine's
    batcher (decode steps as served: the compiled step where installed) against float32 through the
    same batcher; with ``q8_file`` (the model exported as Q8_0 GGUF) that file served under
    ``--dtype int8`` too."""
    import torch

    from moetray.engine.bench.demo_quality import CHAT_PROMPTS, batcher_greedy, heldout_ids
    from moetray.engine.cb.compiled_step import install_decode_step_where_served
    from moetray.engine.experts import load_offloaded_model
    from moetray.engine.experts.fused import FUSED_MAX_TOKENS
    from moetray.engine.models.checkpoint import (
        apply_top_k,
        inspect_checkpoint,
        load_checkpoint,
        load_tokenizer,
        serving_format,
    )
    from moetray.engine.models.precision import apply_format, resolve_format, torch_dtype

    tokenizer = load_tokenizer(model_dir)
    ids = heldout_ids(tokenizer, None)[:tokens]
    sidecar = model_dir / "moetray.json"
    top_k = json.loads(sidecar.read_text()).get("default_top_k") if sidecar.is_file() else None

    every = inspect_checkpoint(model_dir).max_moe_slots
    cpu = torch.device("cpu")

    def load(spec: str):
        _, fmt, compiled = format_spec(spec)
        chosen = resolve_format(fmt, model_dir, cpu)
        off = load_offloaded_model(model_dir, dtype=torch_dtype(chosen.compute), capacity=every,
                                   expert_format="int8" if chosen.weights == "int8" else None,
                                   compile_decode=compiled)
        apply_format(chosen, off.model, cpu)
        if top_k:
            apply_top_k(off.model, off.runtime, top_k)
        return as_served(off.model, off.runtime, compiled)

    def load_file(path: Path):
        info = inspect_checkpoint(path)
        loaded = load_checkpoint(info, device=cpu, fmt=serving_format("int8", info, cpu), capacity=every,
                                 top_k=top_k or info.top_k, progress=lambda *_: None, compile_decode=True)
        return as_served(loaded.model, loaded.runtime, True)

    def as_served(model, runtime, compiled: bool):  # noqa: ANN001, ANN202 - a causal LM and its runtime
        """The decode kernel and the compiled decode step, where the engine would serve them."""
        runtime.warm_up()
        install_decode_step_where_served(model, wanted=compiled, kernel_serves=runtime.fused is not None,
                                         max_tokens=FUSED_MAX_TOKENS)
        return model

    def logits(model) -> torch.Tensor:
        """Teacher-forced over the KV cache in decode-sized chunks (the decode kernel's batches)."""
        out, cache = [], None
        with torch.no_grad():
            for i in range(0, len(ids), FUSED_MAX_TOKENS):
                chunk = torch.tensor([ids[i:i + FUSED_MAX_TOKENS]])
                step = model(chunk, cache=cache, use_cache=True)
                cache = step.cache
                out.append(step.logits[0].float())
        return torch.cat(out)

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for text in CHAT_PROMPTS]

    reference = load("float32")
    # The float32 reference through the same batcher: on the demo (near-tied router logits by
    # design) transformers' own continuous batching and its generate() already part ways in float32
    # (measured: 4 of 5 chat prompts), and the batcher is what the engine serves and is tested
    # token-identical to.
    ref_logits, ref_greedy = logits(reference), batcher_greedy(reference, prompts, chat_tokens)
    del reference
    report: dict[str, Any] = {"heldout_tokens": len(ids), "chat_prompts": len(CHAT_PROMPTS),
                              "chat_tokens": chat_tokens, "formats": {}}
    candidates: dict[str, Callable[[], Any]] = {
        format_spec(spec)[0]: functools.partial(load, spec) for spec in formats if spec != "float32"
    }
    if q8_file is not None:
        candidates[Q8_FILE] = functools.partial(load_file, q8_file)
    for fmt, make in candidates.items():
        model = make()
        got, answers = logits(model), batcher_greedy(model, prompts, chat_tokens)  # as served
        del model
        diff = (got - ref_logits).abs()
        agree = [sum(1 for _ in _common_prefix(a, b)) for a, b in zip(answers, ref_greedy, strict=True)]
        report["formats"][fmt] = {
            "max_abs_logit_diff": float(diff.max()),
            "mean_abs_logit_diff": float(diff.mean()),
            "argmax_agreement": float((got.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "greedy_prefix_tokens": agree,
            "greedy_identical_prompts": sum(1 for n in agree if n == chat_tokens),
        }
    return report


def _common_prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


# --- main ---------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moetray bench decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the embedded demo model)")
    p.add_argument("--dtype", default=DEFAULT_FORMATS,
                   help="weight formats, comma-separated: float32, bfloat16, float16, int8; FORMAT:grouped "
                   "serves FORMAT with --no-compile too (the compiled decode kernel's gain, same rounds)")
    p.add_argument("--batch", default="1,4,8", help="concurrent requests (decode batch), comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engines")
    p.add_argument("--peer", action="append", default=[], metavar="LABEL=URL[@MODEL]",
                   help="an OpenAI-compatible server already running, measured in the same rounds")
    p.add_argument("--llama", action="append", default=[], metavar="LABEL=FILE.gguf",
                   help="serve this GGUF with llama.cpp (llama-cpp-python's server) in the same rounds; "
                   "default with the demo model: the demo exported as F16 and Q8_0, where llama-cpp-python "
                   "and the GGUF exporter are installed")
    p.add_argument("--no-llama", action="store_true", help="no llama.cpp peer")
    p.add_argument("--no-quality", action="store_true", help="skip the logit comparison against float32")
    p.add_argument("--receipt", default="decode", type=receipt_name)
    return p


def _peers(specs: list[str]) -> list[dict[str, Any]]:
    peers = []
    for spec in specs:
        label, _, rest = spec.partition("=")
        url, _, model = rest.partition("@")
        peers.append({"label": label, "url": url.rstrip("/"), "model": model or "default"})
    return peers


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import torch

    from moetray.engine.bench.results import write_receipt

    torch.set_num_threads(args.threads)
    formats = [f.strip() for f in args.dtype.split(",") if f.strip()]
    batches = [int(b) for b in args.batch.split(",")]
    peers = _peers(args.peer)
    llama_files = [llama_file(spec) for spec in args.llama]
    model_dir = args.model
    if model_dir is None:
        from moetray.engine.demo import ensure_demo_model

        model_dir = ensure_demo_model()
    from moetray.engine.models.precision import resolve_format

    served_auto = resolve_format("auto", model_dir, torch.device("cpu")).weights
    progress(f"memory bandwidth ({args.threads} threads)")
    bw = read_bandwidth_gbs()
    load_before = os.getloadavg()[0]  # other processes' share of the cores: wall-clock ratios need it
    progress(f"    {bw:.1f} GB/s")

    if not llama_files and args.model is None and not args.no_llama:
        llama_files = demo_llama_files(model_dir)
    engines: dict[str, ServedEngine] = {}
    llamas: list[LlamaServer] = []
    try:
        for label, path in llama_files:
            progress(f"starting llama.cpp on {path.name}")
            llamas.append(LlamaServer(label, path, threads=args.threads))
        for server in llamas:
            server.wait_ready()
        for spec in formats:
            label, fmt, compiled = format_spec(spec)
            progress(f"loading {label}")
            served = ServedEngine(model_dir, fmt, kv_tokens=max(batches) * (args.max_tokens + 128) * 2,
                                  max_requests=max(batches), compile_decode=compiled)
            served.wait_serving()
            engines[label] = served
        q8_file = next((path for label, path in llama_files if label == EQUAL_BYTES[Q8_FILE]), None)
        if q8_file is not None and "int8" in engines:  # the same Q8_0 file llama.cpp serves
            progress(f"loading int8 from {q8_file.name}")
            served = ServedEngine(q8_file, "int8", kv_tokens=max(batches) * (args.max_tokens + 128) * 2,
                                  max_requests=max(batches))
            served.wait_serving()
            engines[Q8_FILE] = served
        eos = next(iter(engines.values())).served_model().eos_ids
        peers += [server.as_target(eos) for server in llamas]
        targets: list[tuple[str, Any]] = [*engines.items(), *((p["label"], p) for p in peers)]
        for peer in peers:  # warm-up
            run_client(peer["url"], peer["model"], concurrency=1, max_tokens=8, tag="warm",
                       extra=peer.get("extra"))
        for served in engines.values():  # warm-up: the allocator, the first steps
            run_client(served.url, served.model_id(), concurrency=max(batches), max_tokens=8, tag="warm")
            served.install_breakdown()
        rows: list[dict[str, Any]] = []
        for batch in batches:
            for rnd in range(args.rounds):
                order = targets if rnd % 2 == 0 else targets[::-1]
                for label, target in order:
                    row = measure_round(target, label, batch=batch, max_tokens=args.max_tokens,
                                        tag=f"r{rnd}b{batch}")
                    row["round"] = rnd
                    rows.append(row)
                    progress(f"batch {batch} round {rnd} {label}: {row['request_decode_tok_s'] or 0:.1f} "
                             f"tok/s per request, {row['aggregate_tok_s']:.1f} aggregate")
        dense = {label: dense_bytes_per_step(s.served_model().loaded.model) for label, s in engines.items()}
        expert_bytes = {label: s.served_model().loaded.runtime.bytes_per_slot for label, s in engines.items()}
        dtypes = {label: s.model_info()["dtype"] for label, s in engines.items()}
    finally:
        for served in engines.values():
            served.stop()
        for server in llamas:
            server.stop()

    quality = None if args.no_quality else precision_report(
        model_dir, formats, q8_file=q8_file if Q8_FILE in engines else None)
    results = summarize(rows, targets=[label for label, _ in targets], batches=batches, bandwidth=bw,
                        dense=dense, expert_bytes=expert_bytes)
    table, notes = render(results, peers=[p["label"] for p in peers], quality=quality, bandwidth=bw,
                          dtypes=dtypes, argv=argv)
    met = goals(results, served_auto)
    load_after = os.getloadavg()[0]
    notes.insert(0, cpu_per_token_note(results))
    notes.insert(0, f"Load average (1 min) on this {os.cpu_count()}-core machine: {load_before:.1f} at the "
                 f"start, {load_after:.1f} at the end; above the core count, wall-clock tok/s is shared "
                 "with other processes and server CPU ms / token is the steadier comparison.")
    notes.insert(0, "Goals (issue 15; ratio, met): " + "; ".join(
        f"{name} {g['ratio']:.2f} {'met' if g['met'] else 'NOT met'}"
        + (f" (measured by {g['source']})" if g.get("source") else "") if g["ratio"] is not None
        else f"{name} not measured" for name, g in met.items()) + ".")
    path = write_receipt(
        args.receipt,
        params={"model": str(model_dir), "formats": formats, "batches": batches,
                "max_tokens": args.max_tokens, "rounds": args.rounds, "threads": args.threads,
                "peers": [{k: v for k, v in p.items() if k != "server"} for p in peers],
                "llama_files": [str(path) for _, path in llama_files],
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "load_average": [load_before, load_after]},
        results={"bandwidth_gbs": bw, "rows": rows, "summary": results, "quality": quality, "goals": met,
                 "auto_format": served_auto,
                 "dense_bytes_per_step": dense, "expert_bytes": expert_bytes, "dtypes": dtypes},
        columns=TABLE_COLUMNS, rows=table,
        title="Decode speed per weight format: tok/s, bytes per token, the memory bound, where a step goes",
        notes=notes)
    progress(f"receipt: {path}")
    return 0


TABLE_COLUMNS = ["format", "batch", "tok/s per request", "aggregate tok/s", "engine tok/s", "TTFT ms",
                 "MB weights / token", "bound tok/s", "× bound", "threads busy", "server CPU ms / token",
                 "step ms: attention / experts / other / sampler / sched / outputs / HTTP"]


def summarize(rows: list[dict[str, Any]], *, targets: list[str], batches: list[int], bandwidth: float,
              dense: dict[str, int], expert_bytes: dict[str, int]) -> list[dict[str, Any]]:
    """Medians over rounds per (target, batch), the bytes per token and the bound."""
    out = []
    for label in targets:
        for batch in batches:
            mine = [r for r in rows if r["label"] == label and r["batch"] == batch]
            if not mine:
                continue

            def med(key: str, sub: str | None = None, rows_=mine):
                values = [(r.get(key) or {}).get(sub) if sub else r.get(key) for r in rows_]
                present = [v for v in values if v is not None]
                return statistics.median(present) if present else None

            entry: dict[str, Any] = {
                "label": label, "batch": batch,
                "request_decode_tok_s": med("request_decode_tok_s"),
                "aggregate_tok_s": med("aggregate_tok_s"), "ttft_ms": med("ttft_ms"),
                "spread_request_tok_s": _spread([r.get("request_decode_tok_s") for r in mine]),
                "threads_busy": med("threads_busy"),
                "server_cpu_ms_per_token": med("server_cpu_ms_per_token"),
                "rss_bytes": med("rss_bytes"),
            }
            if label in dense:
                routed = med("routed_experts_per_decode_step")
                step_bytes = None if routed is None else dense[label] + routed * expert_bytes[label]
                per_token = None if step_bytes is None else step_bytes / batch
                bound = None if per_token is None else bandwidth * GB / per_token
                engine_rate = med("engine_decode_tok_s")
                entry.update({
                    "engine_decode_tok_s": engine_rate,
                    "generation_thread_busy": med("generation_thread_busy"),
                    "team_decode_share": med("team_decode_share"),
                    "loop_thread_busy": med("loop_thread_busy"),
                    "routed_experts_per_decode_step": routed, "bytes_per_token": per_token,
                    "bound_tok_s": bound,
                    "fraction_of_bound": (None if bound is None or entry["aggregate_tok_s"] is None
                                          else entry["aggregate_tok_s"] / bound),
                    "engine_fraction_of_bound": (None if bound is None or engine_rate is None
                                                 else engine_rate / bound),
                    "step_ms": {k: med("step_ms", k) for k in (*_STEP_KEYS, "step")},
                    "http_sse_detok_ms_per_step": med("http_sse_detok_ms_per_step"),
                })
            out.append(entry)
    return out


_STEP_KEYS = ("attention", "experts", "forward_other", "sampler", "scheduler", "outputs")


def _spread(values: list[float | None]) -> float | None:
    """(max − min) / median over rounds: how noisy this cell was."""
    vals = [v for v in values if v]
    if len(vals) < 2:
        return None
    return (max(vals) - min(vals)) / statistics.median(vals)


def render(summary: list[dict[str, Any]], *, peers: list[str], quality: dict[str, Any] | None,
           bandwidth: float, dtypes: dict[str, str], argv: list[str]) -> tuple[list[list[Any]], list[str]]:
    table = []
    for e in summary:
        step = e.get("step_ms")
        parts = None
        if step and step.get("step") is not None:
            parts = " / ".join("—" if step[k] is None else f"{step[k]:.1f}" for k in _STEP_KEYS)
            http = e.get("http_sse_detok_ms_per_step")
            parts += f" / {http:.1f}" if http is not None else " / —"
            parts += f" (step {step['step']:.1f})"
        per_token = e.get("bytes_per_token")
        table.append([e["label"], e["batch"], e["request_decode_tok_s"], e["aggregate_tok_s"],
                      e.get("engine_decode_tok_s"), e["ttft_ms"],
                      None if per_token is None else per_token / 1e6, e.get("bound_tok_s"),
                      e.get("fraction_of_bound"), e.get("threads_busy"), e.get("server_cpu_ms_per_token"),
                      parts])
    notes = [f"Memory bandwidth measured in this run: {bandwidth:.1f} GB/s (best of 5 reads of 512 MiB). "
             "Bound tok/s = bandwidth ÷ bytes of weights read per token (non-expert weights once per step "
             "plus the distinct experts the step routed, over the batch); × bound uses the aggregate tok/s.",
             "tok/s per request: a streamed request's tokens after the first over first-to-last token time "
             "(client side, its own process); aggregate: all tokens over the round's wall time; engine "
             "tok/s: decode steps × batch over the steps' wall time inside the engine. Medians over rounds; "
             "formats take turns round by round.",
             "Step ms (per decode step, generation thread, wall): attention / experts / other forward / "
             "sampler / scheduler+ledger / outputs handed to the event loop / HTTP+SSE+detokenize "
             "(event-loop thread CPU ms per step); (step) is the whole step. Where the decode step is "
             "compiled (engine/cb/compiled_step.py) attention runs inside its graph and is not timed apart "
             "(—): it is part of other forward.",
             "Server CPU ms / token: the serving process's CPU time (all threads) over the round per token "
             "generated, a clock that other load on a shared machine disturbs less than wall time; threads "
             "busy: that CPU time over the round's wall time (2.0 = both cores).",
             "Formats served: " + ", ".join(f"{k} → {v}" for k, v in dtypes.items()) + "."]
    teams = [f"{e['label']} b{e['batch']} {e['team_decode_share']:.0%}" for e in summary
             if e.get("team_decode_share") is not None]
    if teams:
        notes.append("Decode steps on the whole thread budget (engine/cores.py: while other programs leave "
                     "the cores free; else one thread): " + ", ".join(teams) + ".")
    noisy = [e for e in summary if (e.get("spread_request_tok_s") or 0) > 0.25]
    notes.append("Noise: (max−min)/median of per-request tok/s over rounds is "
                 + ", ".join(f"{e['label']} b{e['batch']} {e['spread_request_tok_s']:.0%}"
                             for e in summary if e.get("spread_request_tok_s") is not None)
                 + (f"; {len(noisy)} cells above 25 %." if noisy else "."))
    if quality:
        for fmt, q in quality["formats"].items():
            notes.append(
                f"{fmt} vs float32 on {quality['heldout_tokens']} held-out tokens: max |Δlogit| "
                f"{q['max_abs_logit_diff']:.3g}, mean {q['mean_abs_logit_diff']:.3g}, argmax agreement "
                f"{q['argmax_agreement']:.2%}; greedy chat ({quality['chat_prompts']} prompts × "
                f"{quality['chat_tokens']} tokens): {q['greedy_identical_prompts']} identical, common "
                f"prefixes {q['greedy_prefix_tokens']}.")
    for peer in peers:
        for batch in sorted({e["batch"] for e in summary}):
            base = next((e for e in summary if e["label"] == peer and e["batch"] == batch), None)
            if base is None:
                continue
            ratios = []
            for e in summary:
                if e["label"] in peers or e["batch"] != batch:
                    continue
                r1 = _ratio(e["request_decode_tok_s"], base["request_decode_tok_s"])
                r2 = _ratio(e["aggregate_tok_s"], base["aggregate_tok_s"])
                ratios.append(f"{e['label']} {r1:.2f}× / {r2:.2f}×" if r1 and r2 else f"{e['label']} —")
            notes.append(f"vs {peer} at batch {batch} (per request / aggregate): " + "; ".join(ratios) + ".")
    notes.append(kernel_gain_note(summary))
    notes.append("reproduce: `.venv/bin/moetray bench decode" + (" " + " ".join(argv) if argv else "") + "`")
    return table, notes


Q8_FILE = "int8 (Q8_0 file)"
"""moetray serving llama.cpp's own Q8_0 file under ``--dtype int8`` (its blocks re-rounded per channel)."""
EQUAL_BYTES = {"bfloat16": "llama.cpp F16", "float16": "llama.cpp F16", "int8": "llama.cpp Q8_0",
               Q8_FILE: "llama.cpp Q8_0"}
"""Each moetray target and the llama.cpp file reading as many bytes per weight."""


def goals(summary: list[dict[str, Any]], served: str | None) -> dict[str, Any]:
    """The issue's goals from this run's medians: True / False, or None where not measured.

    ``served`` is the format ``--dtype auto`` serves on this machine (the bound goal's format).
    """
    def cell(label: str, batch: int) -> dict[str, Any] | None:
        return next((e for e in summary if e["label"] == label and e["batch"] == batch), None)

    out: dict[str, Any] = {}
    for fmt, peer in EQUAL_BYTES.items():
        ours1, theirs1 = cell(fmt, 1), cell(peer, 1)
        if ours1 and theirs1:
            r = _ratio(ours1["request_decode_tok_s"], theirs1["request_decode_tok_s"])
            out[f"{fmt}_c1_vs_{peer}_ge_1.0"] = {"ratio": r, "met": None if r is None else r >= 1.0}
            t = _ratio(ours1["ttft_ms"], theirs1["ttft_ms"])
            out[f"{fmt}_ttft_vs_{peer}_le_1.0"] = {"ratio": t, "met": None if t is None else t <= 1.0}
        ours4, theirs4 = cell(fmt, 4), cell(peer, 4)
        if ours4 and theirs4:
            r = _ratio(ours4["aggregate_tok_s"], theirs4["aggregate_tok_s"])
            out[f"{fmt}_c4_aggregate_vs_{peer}_ge_1.5"] = {"ratio": r, "met": None if r is None else r >= 1.5}
    if served:
        best = max((e.get("fraction_of_bound") or 0 for e in summary if e["label"] == served), default=None)
        out[f"{served}_fraction_of_bound_ge_0.8"] = {"ratio": best or None,
                                                     "met": None if not best else best >= 0.8}
    out[RSS_GOAL] = rss_goal_from_receipt() or {
        "ratio": None, "met": None,
        "note": "not measured: this run's engines share its process; `moetray bench peer` measures it"}
    return out


def kernel_gain_note(summary: list[dict[str, Any]]) -> str:
    """Compiled decode (the experts' kernel and the whole step's graph) against eager steps on the grouped
    GEMMs (``--no-compile``), per format and batch, from the same rounds."""
    parts = []
    for e in summary:
        if not e["label"].endswith(" (grouped GEMMs)"):
            continue
        base = e["label"].removesuffix(" (grouped GEMMs)")
        ours = next((b for b in summary if b["label"] == base and b["batch"] == e["batch"]), None)
        if ours is None:
            continue
        r = _ratio(ours["aggregate_tok_s"], e["aggregate_tok_s"])
        s = _ratio((ours.get("step_ms") or {}).get("experts"), (e.get("step_ms") or {}).get("experts"))
        if r is not None:
            parts.append(f"{base} b{e['batch']} {r:.2f}× tok/s" + (f", experts ms {s:.2f}×" if s else ""))
    return ("Compiled decode (the experts' kernel and the step's graph) ÷ --no-compile (eager steps, grouped "
            "GEMMs) (aggregate tok/s; a step's experts ms), same rounds: "
            + ("; ".join(parts) if parts else "not measured") + ".")


def cpu_per_token_note(summary: list[dict[str, Any]]) -> str:
    """Server CPU ms per token, moetray over llama.cpp at equal bytes per weight, per batch: the
    cost of a token with other processes' load taken out of the clock (below 1: moetray spends less)."""
    parts = []
    for ours, theirs in EQUAL_BYTES.items():
        for e in summary:
            if e["label"] != ours:
                continue
            base = next((b for b in summary if b["label"] == theirs and b["batch"] == e["batch"]), None)
            theirs_ms = None if base is None else base["server_cpu_ms_per_token"]
            r = _ratio(e["server_cpu_ms_per_token"], theirs_ms)
            if r is not None:
                parts.append(f"{ours} / {theirs} b{e['batch']} {r:.2f}")
    return ("Server CPU ms per token, moetray ÷ llama.cpp at equal bytes per weight (below 1: moetray "
            "spends less CPU per token): " + ("; ".join(parts) if parts else "not measured") + ".")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
