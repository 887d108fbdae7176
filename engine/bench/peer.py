"""`moetray bench peer`: the same GGUF served by llama.cpp and by moetray, side by side.

llama.cpp runs through llama-cpp-python (an optional extra, ``pip install 'moetray[peer]'``: it
compiles llama.cpp; skipped with a message where it is not installed), in a child process of its
own so its RSS is its own; moetray runs as ``moetray serve --model FILE`` in another child, driven
over HTTP with streaming. Same file, same prompts, same thread count, greedy decode; measured at
concurrency 1 and 4: decode tok/s per request (tokens after the first / time after the first),
aggregate tok/s, TTFT, and each process's RSS (and its parts, :func:`rss_parts`). Both are up at
once and take turns, round by round (``--rounds``): this project's 2-core hosts drift by a third in
speed within minutes, so each ratio is the median of its rounds' own ratios (:func:`paired_ratio`).
llama-cpp-python's ``Llama`` decodes one sequence at a time, so its concurrent requests queue behind
one another: its concurrency-4 figures show that.

``--llama-server BIN`` runs llama.cpp's own OpenAI server instead (a CUDA build on a GPU), driven by
the same client as moetray, one slot per concurrent request (it batches them). On a GPU,
``--device cuda`` serves moetray there too, each server's device memory is read from NVML, and
``--offload CAPACITY:N`` adds rows with experts off the GPU: moetray's expert cache at that capacity
against llama.cpp's ``--n-cpu-moe N`` (the first N layers' experts kept and computed on the CPU).
Both clients send ``logit_bias`` banning the file's control tokens (:func:`text_only_bias`), so each
request decodes ``--tokens`` tokens on both servers. ``--twin DIR`` serves a seeded random-weight
model of DIR's config and tokenizer where the demo cannot be built (``bench/gpu/run.sh``: a lent
GPU takes 64 MiB of files).

The receipt states the RSS goal per file (``engine.bench.rss_goal``).

The default file is the demo exported with :func:`~moetray.engine.models.gguf_export.export_gguf`,
avoiding two llama.cpp traps the demo meets: its shared-expert gates are exactly zero (llama.cpp's
qwen2moe graph computes the gate's sigmoid as ``silu(x)/x``: NaN at 0; they are written as 1e-30,
whose sigmoid is 0.5 as well), and its tied embeddings get an explicit ``output.weight``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetray.engine.bench.exits import exit_reason
from moetray.engine.bench.results import receipt_name, write_receipt
from moetray.engine.bench.rss_goal import RSS_GOAL, rss_goal, rss_goal_note, rss_goal_summary
from moetray.engine.bench.serve import Child, engine_serving, stop_process_group
from moetray.engine.bench.targets import peer_env
from moetray.policy.footprint import RSS_PARTS, own_memory, parse_status_rss_parts

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a cat who learns to code.",
    "List three uses of a paperclip, one per line.",
    "What is the capital of France, and what river runs through it?",
]
LONG_PROMPT_WORDS = 600
"""Words of the long prompt (``--long-prompt-words``; ~1,200 tokens of the demo's tokenizer): a
pasted document's prefill, where the short prompts' first token mostly measures a prefix-cache hit."""


def long_prompt(words: int) -> str:
    """A prompt of ``words`` numbered words sharing no prefix with :data:`PROMPTS`, the same for both
    servers."""
    vocabulary = ("river", "stone", "lantern", "harbor", "meadow", "copper", "signal", "orchard")
    body = " ".join(f"{vocabulary[(i * 5) % len(vocabulary)]}{i % 10}" for i in range(words))
    return f"Summarize these field notes in one line: {body}."


CONTROL_TOKEN = 3
"""``tokenizer.ggml.token_type`` of a control token (end of text, end of turn, …): gguf-py's
``TokenType.CONTROL``."""


def text_only_bias(model: Path) -> dict[str, float]:
    """``logit_bias`` banning every control token of ``model``'s vocabulary, sent by both servers'
    clients: each request then decodes exactly ``--tokens`` tokens of text. Greedy decoding in two
    arithmetics (llama.cpp's F16 or Q8_0, moetray's bfloat16 or int8) ends the same prompt at
    different lengths (19 against 31 tokens on the first prompt), so without it the two servers
    would do different work, and four requests ending one by one would leave moetray's batch
    partly empty: the same amount of work on both sides is what a speed ratio compares."""
    from moetray.engine.cb.sampling import BIAS_BAN
    from moetray.engine.models.gguf import read_headers

    _, metadata, _ = read_headers(model)
    types = metadata.get("tokenizer.ggml.token_type") or []
    return {str(token): BIAS_BAN for token, kind in enumerate(types) if kind == CONTROL_TOKEN}


LLAMA_CONTEXT = 2048
"""llama.cpp's context per request (llama-cpp-python's ``n_ctx``; llama-server gets one per slot)."""
LONG_TOKENS = 4
"""Tokens asked of the long prompt: its first token is what is measured."""

_LLAMA_CHILD = r"""
import json, sys, time
import psutil
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
bias = {int(token): value for token, value in cfg["logit_bias"].items()}  # JSON keys are strings
llm = Llama(model_path=cfg["model"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            n_ctx=cfg["n_ctx"], verbose=False, seed=0)
def one(prompt, sent, tokens=cfg["tokens"]):
    msgs = [{"role": "user", "content": prompt}]
    first = None; n = 0
    for chunk in llm.create_chat_completion(msgs, max_tokens=tokens, temperature=0.0, stream=True,
                                            logit_bias=bias):
        if chunk["choices"][0]["delta"].get("content"):
            n += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": (first or end) - sent, "tokens": n, "decode_s": end - (first or end)}
one(cfg["prompts"][0], time.perf_counter())  # warm-up
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    if "concurrency" in ask:
        start = time.perf_counter()  # a round's requests are all sent now and answered in turn
        results = [one(p, start) for p in cfg["prompts"][:ask["concurrency"]]]
        out = {"requests": results, "wall_s": time.perf_counter() - start}
    elif "long_prompt" in ask:
        out = one(ask["long_prompt"], time.perf_counter(), ask["tokens"])
    else:
        out = {"rss": psutil.Process().memory_info().rss}
    print(json.dumps(out), flush=True)
"""
"""llama-cpp-python's side of a run, in a child of its own that answers one JSON line per command on
its stdin (a round at one concurrency, the long prompt, its RSS). One ``Llama`` decodes one sequence
at a time, so a round's requests are answered one after another, each first token timed from the
round's start (when a server would have received them all). They run on the child's main thread:
called from another thread, llama.cpp decoded the demo ~3× slower on this project's third 2-core host
(22 against 74 tok/s, Q8_0, 2 threads), and earlier receipts of this bench, which called it so, took
that as its speed."""


def _progress(msg: str) -> None:
    print(f"[bench peer] {msg}", file=sys.stderr, flush=True)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _round_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One round's figures: per-request decode tok/s (median), aggregate tok/s, TTFT (median)."""
    reqs = run["requests"]
    decode = [(r["tokens"] - 1) / r["decode_s"] for r in reqs if r["tokens"] > 1 and r["decode_s"] > 0]
    return {
        "decode_tok_s": statistics.median(decode) if decode else None,
        "aggregate_tok_s": sum(r["tokens"] for r in reqs) / run["wall_s"],
        "ttft_ms": statistics.median(r["ttft"] for r in reqs) * 1e3,
        "tokens": [r["tokens"] for r in reqs],
    }


def summary(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per concurrency, each figure's median over the rounds (:func:`_round_figures`), and the rounds'
    own figures beside them."""
    out = {}
    for conc, runs in rounds.items():
        each = [_round_figures(run) for run in runs]
        figures: dict[str, Any] = {"rounds": each}
        for key in ("decode_tok_s", "aggregate_tok_s", "ttft_ms"):
            values = [f[key] for f in each if f[key] is not None]
            figures[key] = statistics.median(values) if values else None
        out[conc] = figures
    return out


def paired_ratio(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str) -> float | None:
    """The median over rounds of moetray's figure ÷ llama.cpp's in the same round (rounds alternate the
    two, so a machine whose speed drifts between rounds moves both figures of a pair alike)."""
    pairs = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True) if a[key] and b[key]]
    return statistics.median(pairs) if pairs else None


SPEED_GOALS = (("decode_tok_s_ratio", 1, ">=", 1.0, "one request's decode tok/s"),
               ("aggregate_tok_s_ratio", 4, ">=", 1.5, "aggregate tok/s at four requests"),
               ("ttft_ms_ratio", 1, "<=", 1.0, "a short prompt's first token"))
"""Issue 15's speed goals, as (row ratio, concurrency, comparison, bound, what it measures)."""


def speed_goals_note(rows: list[dict[str, Any]]) -> str:
    """The speed goals per file, from the rows' paired ratios: met or NOT met, by how much."""
    cells = []
    for key, conc, cmp, bound, what in SPEED_GOALS:
        for row in rows:
            ratio = row.get(key)
            if row["concurrency"] != conc or row["setting"] != "resident" or ratio is None:
                continue
            met = "met" if (ratio >= bound if cmp == ">=" else ratio <= bound) else "NOT met"
            cells.append(f"{row['file']} {what} {ratio:.2f}× (goal {cmp} {bound}: {met})")
    return "Speed goals (issue 15), moetray ÷ llama.cpp: " + ("; ".join(cells) or "none measured") + "."


LONG_TTFT_GOAL = "long_prompt_ttft_le_1.0x"
"""The goal's name in receipts: moetray's first token of the long prompt no later than llama.cpp's."""


def long_prompt_ttft(llama: dict[str, Any], ours: dict[str, Any], words: int) -> dict[str, Any]:
    """The long prompt's first-token times (ms), their ratio and whether the goal is met."""
    a, b = ours["ttft"] * 1e3, llama["ttft"] * 1e3
    return {"words": words, "llama_cpp_ttft_ms": b, "moetray_ttft_ms": a, "ratio": a / b, "met": a <= b}


def long_prompt_note(long: dict[str, dict[str, Any]]) -> str:
    if not long:
        return "Long prompt: not measured (--long-prompt-words 0)."
    cells = "; ".join(f"{label}: llama.cpp {v['llama_cpp_ttft_ms']:.0f} ms, moetray "
                      f"{v['moetray_ttft_ms']:.0f} ms ({v['ratio']:.2f}×)" for label, v in long.items())
    met = "met" if all(v["met"] for v in long.values()) else "NOT met"
    words = next(iter(long.values()))["words"]
    return (f"Goal {LONG_TTFT_GOAL} (first token of one {words}-word prompt after the rounds, sharing no "
            f"prefix with them, moetray's no later than llama.cpp's): {met}: {cells}.")


class _LlamaChild:
    """llama-cpp-python in a child process, driven a command at a time (:data:`_LLAMA_CHILD`)."""

    def __init__(self, model: Path, args, bias: dict[str, float]) -> None:
        cfg = {"model": str(model), "threads": args.threads, "n_ctx": LLAMA_CONTEXT, "tokens": args.tokens,
               "prompts": PROMPTS, "logit_bias": bias}
        self.timeout = args.timeout
        self.log = Path(tempfile.mkdtemp(prefix="moetray-peer-")) / "llama-cpp-python.log"
        self._err = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-c", _LLAMA_CHILD, json.dumps(cfg)], env=peer_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both piped above
        self._in, self._out = self.proc.stdin, self.proc.stdout
        self._answer()  # loaded and warmed up

    def _answer(self) -> dict[str, Any]:
        """The child's next line, within the run's timeout; a child that dies or stalls is named."""
        done: list[str] = []
        reader = threading.Thread(target=lambda: done.append(self._out.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout)
        if not done or not done[0]:
            code = self.proc.poll()
            why = exit_reason(code) if code is not None else f"no answer within {self.timeout:.0f} s"
            self.stop()
            raise RuntimeError(f"llama.cpp child failed ({why}): see {self.log}")
        return json.loads(done[0])

    def _ask(self, **command: Any) -> dict[str, Any]:
        self._in.write(json.dumps(command) + "\n")
        self._in.flush()
        return self._answer()

    def round(self, conc: int) -> dict[str, Any]:
        return self._ask(concurrency=conc)

    def long(self, words: int) -> dict[str, Any]:
        return self._ask(long_prompt=long_prompt(words), tokens=LONG_TOKENS)

    def footprint(self) -> dict[str, Any]:
        return {"rss": self._ask(rss=True)["rss"], **rss_parts(self.proc.pid)}

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._in.close()
        self._err.close()


def _stream_one(url: str, prompt: str, tokens: int, bias: dict[str, float]) -> dict[str, Any]:
    """One streamed chat request, timed from its sending: the HTTP client is built before the clock
    starts (building one, its TLS context included, took ~20 ms of a short prompt's first token on
    this project's 2-core hosts; llama-cpp-python's figures, called in its own process, pay nothing
    alike)."""
    import httpx

    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "logit_bias": bias,
    }
    first, n = None, 0
    with httpx.Client(timeout=600) as client:
        t0 = time.perf_counter()
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    n += 1
                    first = first or time.perf_counter()
        end = time.perf_counter()
    return {"ttft": (first or end) - t0, "tokens": n, "decode_s": end - (first or end)}


def _round(url: str, conc: int, tokens: int, bias: dict[str, float]) -> dict[str, Any]:
    """One round: ``conc`` requests at once, their results and the round's wall time."""
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    threads = [threading.Thread(target=lambda p=p: results.append(_stream_one(url, p, tokens, bias)))
               for p in PROMPTS[:conc]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": results, "wall_s": time.perf_counter() - start}


def rss_parts(pid: int) -> dict[str, int | None]:
    """``pid``'s RSS by ``policy.footprint.RSS_PARTS``, in bytes; None each where the kernel does not
    say (no such process, not Linux)."""
    from moetray.engine.telemetry import read_text

    return parse_status_rss_parts(read_text(f"/proc/{pid}/status"))


def _footprint(pid: int, before: int | None) -> dict[str, Any]:
    """A serving child's memory, read after its last request: RSS and :func:`rss_parts`, and on an
    NVIDIA GPU its device memory (NVML's figure for the process where the driver names it, and the
    device's use over ``before``, read before the child started)."""
    import psutil

    from moetray.engine.telemetry import nvml_process_bytes, nvml_used_bytes

    used = nvml_used_bytes(0)
    return {
        "rss": psutil.Process(pid).memory_info().rss,
        **rss_parts(pid),
        "device_process_bytes": nvml_process_bytes(0, pid),
        "device_delta_bytes": used - before if used is not None and before is not None else None,
    }


class _Server:
    """A server child (moetray serve, or llama.cpp's own server) driven over HTTP like a client would:
    ready, warmed up with one request, then a round or the long prompt at a time; its log goes to a
    folder of its own."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str],
                 ready: Callable[[Any], bool], args: argparse.Namespace, bias: dict[str, float],
                 about: Callable[[str], dict[str, Any]] | None = None) -> None:
        from moetray.engine.telemetry import nvml_used_bytes

        self.tokens, self.bias, self.about = args.tokens, bias, about
        log = Path(tempfile.mkdtemp(prefix="moetray-peer-")) / f"{name.replace(' ', '-')}.log"
        self.before = nvml_used_bytes(0)
        self.child = Child(name, cmd, port, env, log)
        self.child.wait_ready(ready, args.timeout)
        try:
            _stream_one(self.child.url, PROMPTS[0], args.tokens, bias)
        except BaseException:
            self.child.stop()
            raise

    def round(self, conc: int) -> dict[str, Any]:
        return _round(self.child.url, conc, self.tokens, self.bias)

    def long(self, words: int) -> dict[str, Any]:
        return _stream_one(self.child.url, long_prompt(words), LONG_TOKENS, self.bias)

    def footprint(self) -> dict[str, Any]:
        out = _footprint(self.child.proc.pid, self.before)
        if self.about is not None:
            out.update(self.about(self.child.url))
        return out

    def stop(self) -> None:
        self.child.stop()


def _interleaved(llama, ours, args) -> tuple[dict[str, Any], dict[str, Any]]:
    """``args.rounds`` rounds of every concurrency, the two servers taking turns (which goes first
    alternates), then the long prompt on each and their footprints; returns (llama.cpp's, moetray's)
    rounds per concurrency, long prompt and footprint."""
    runs: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    for r in range(args.rounds):
        for conc in args.concurrency:
            order = ((0, llama), (1, ours)) if r % 2 == 0 else ((1, ours), (0, llama))
            for i, engine in order:
                runs[i].setdefault(str(conc), []).append(engine.round(conc))
    out = []
    for i, engine in enumerate((llama, ours)):
        done: dict[str, Any] = {"rounds": runs[i]}
        if args.long_prompt_words:
            done["long"] = engine.long(args.long_prompt_words)
        done.update(engine.footprint())
        out.append(done)
    return out[0], out[1]


def _start_moetray(model: Path, args, capacity: str | None, bias: dict[str, float]) -> _Server:
    import httpx

    from moetray.engine.serve import DEFAULT_PORT

    port = args.port or DEFAULT_PORT + 7
    env = {**os.environ, "MOETRAY_ADMIN_TOKEN": "bench-peer", "OMP_NUM_THREADS": str(args.threads)}
    cmd = [
        sys.executable, "-m", "moetray.app.cli", "serve", "--model", str(model), "--port", str(port),
        "--threads", str(args.threads), "--log-level", "warning", "--device", args.device,
    ]
    if capacity:
        cmd += ["--moe-capacity", capacity]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.kv_tokens:
        cmd += ["--kv-tokens", str(args.kv_tokens)]

    def served(url: str) -> dict[str, Any]:
        status = httpx.get(f"{url}/admin/status", headers={"Authorization": "Bearer bench-peer"}).json()
        model = status.get("model") or {}
        dtype, weights = model.get("dtype"), model.get("weights")
        return {"expert_store_format": status["experts"]["expert_store_format"],
                "dtype": dtype if weights in (None, dtype) else f"{weights} weights on {dtype}",
                "moe_slots": status["pools"]["moe_slots"]}

    return _Server("moetray serve", cmd, port, env, engine_serving, args, bias, about=served)


def _start_llama_server(model: Path, args, n_cpu_moe: int | None, bias: dict[str, float]) -> _Server:
    """llama.cpp's own OpenAI server (``--llama-server``) on ``model``, driven like moetray: one slot per
    request of the largest concurrency (it batches them), the same context as moetray's KV pool."""
    from moetray.engine.bench.serve import free_port

    port = free_port()
    cmd = [
        str(args.llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(args.threads), "-tb", str(args.threads), "-np", str(max(args.concurrency)),
        "-c", str(args.kv_tokens or LLAMA_CONTEXT * max(args.concurrency)), *shlex.split(args.llama_args),
    ]
    if n_cpu_moe is not None:
        cmd += ["--n-cpu-moe", str(n_cpu_moe)]
    return _Server("llama-server", cmd, port, peer_env(), lambda r: r.status_code == 200, args, bias)


def _settings(args) -> list[tuple[str, int | None, str | None]]:
    """The rows' settings: (label, llama.cpp's ``--n-cpu-moe``, moetray's ``--moe-capacity``); the first
    keeps every expert on the device, each ``--offload CAPACITY:N`` pair then moves some off it."""
    out: list[tuple[str, int | None, str | None]] = [("resident", None, args.moe_capacity)]
    for pair in filter(None, args.offload.split(",")):
        capacity, _, n_cpu_moe = pair.partition(":")
        out.append((f"moetray {capacity} / llama.cpp --n-cpu-moe {n_cpu_moe}", int(n_cpu_moe), capacity))
    return out


def _files(args, workdir: Path) -> list[tuple[str, Path]]:
    """The GGUF files both serve: ``--gguf``, else the demo (or with ``--twin DIR`` a random-weight
    model of DIR's config and tokenizer) exported in each of ``--types``."""
    if args.gguf is not None:
        return [(args.gguf.name, args.gguf)]
    from moetray.engine.models.gguf_export import export_gguf

    if args.twin is not None:
        from moetray.engine.bench.random_model import ensure_random_twin

        name, source = "twin", ensure_random_twin(args.twin, workdir / "twin")
    else:
        from moetray.engine.demo import ensure_demo_model

        name, source = "demo", ensure_demo_model()
    files = []
    for qtype in args.types.split(","):
        dest = workdir / f"{name}-{qtype}.gguf"
        if not dest.exists():
            _progress(f"exporting the {name} as {qtype}")
            export_gguf(source, dest, qtype, output_weight=True, gate_floor=1e-30)
        files.append((f"{name} {qtype}", dest))
    return files


def _mib(value: int | None) -> float | None:
    return value / 2**20 if value is not None else None


def _device_mib(run: dict[str, Any]) -> float | None:
    """A child's device memory: NVML's per-process figure, else the device's use over the start."""
    return _mib(run.get("device_process_bytes") or run.get("device_delta_bytes"))


def _without_workdir(argv: list[str]) -> list[str]:
    """``argv`` less ``--workdir`` and its value (a scratch folder of this run, not a setting)."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--workdir="):
            skip = False
        elif arg == "--workdir":
            skip = True
        else:
            out.append(arg)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moetray bench peer", description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, default=None,
                   help="the file both serve (default: the demo, exported)")
    p.add_argument("--twin", type=Path, default=None, metavar="DIR",
                   help="instead of the demo: a seeded random-weight model of DIR's config and tokenizer "
                   "(where the demo cannot be built, such as a lent GPU)")
    p.add_argument("--types", default="F16,Q8_0", help="with the demo: the GGUF types to export and compare")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every concurrency, the two servers taking turns (ratios: paired medians)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--long-prompt-words", type=int, default=LONG_PROMPT_WORDS,
                   help="words of the long prompt whose first token is timed after the rounds (0: none)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--moe-capacity", default="100%", help="moetray's expert slots (default: every expert)")
    p.add_argument("--dtype", default=None, help="moetray serve's --dtype (default: its own default, auto)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="moetray serve's --device")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="moetray's KV pool in tokens, and llama-server's context (default: each its own)")
    p.add_argument("--llama-server", type=Path, default=None, metavar="BIN",
                   help="llama.cpp's own server binary in place of llama-cpp-python (a CUDA build on a GPU)")
    p.add_argument("--llama-args", default="", help="extra llama-server arguments, e.g. '-ngl 99'")
    p.add_argument("--offload", default="", metavar="CAPACITY:N,…",
                   help="with --llama-server: also compare moetray at --moe-capacity CAPACITY with "
                   "llama-server --n-cpu-moe N (e.g. 50%%:15 for half of 30 layers' experts off the GPU)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--workdir", default=None)
    p.add_argument("--receipt", default="peer", type=receipt_name)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.offload and args.llama_server is None:
        print("moetray bench peer: --offload needs --llama-server (llama-cpp-python has no --n-cpu-moe)",
              file=sys.stderr)
        return 2
    if args.llama_server is None and not llama_cpp_available():
        print(
            "moetray bench peer: skipped: llama-cpp-python is not installed (an optional extra that "
            "compiles llama.cpp: pip install 'moetray[peer]'), and no --llama-server was given",
            file=sys.stderr,
        )
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="moetray-bench-peer-"))
    rows, table, rss, long = [], [], {}, {}
    files = _files(args, workdir)
    for label, path in files:
        bias = text_only_bias(path)
        for setting, n_cpu_moe, capacity in _settings(args):
            _progress(f"{label}, {setting}: starting llama.cpp and moetray")
            llama_engine = (_start_llama_server(path, args, n_cpu_moe, bias) if args.llama_server is not None
                            else _LlamaChild(path, args, bias))
            try:
                ours_engine = _start_moetray(path, args, capacity, bias)
                try:
                    _progress(f"{label}, {setting}: {args.rounds} rounds, taking turns")
                    llama, ours = _interleaved(llama_engine, ours_engine, args)
                finally:
                    ours_engine.stop()
            finally:
                llama_engine.stop()
            ls, ms = summary(llama["rounds"]), summary(ours["rounds"])
            if n_cpu_moe is None:
                rss[label] = rss_goal(ours["rss"], llama["rss"], ours.get("dtype"),
                                      moetray_own=own_memory(ours), llama_own=own_memory(llama))
                if "long" in ours and "long" in llama:
                    long[label] = long_prompt_ttft(llama["long"], ours["long"], args.long_prompt_words)
                    _progress(f"  long prompt: TTFT llama.cpp {long[label]['llama_cpp_ttft_ms']:.0f} vs "
                              f"moetray {long[label]['moetray_ttft_ms']:.0f} ms")
            for conc in map(str, args.concurrency):
                row = {
                    "file": label,
                    "setting": setting,
                    "concurrency": int(conc),
                    "llama_cpp": ls[conc],
                    "moetray": ms[conc],
                    "llama_rss": llama["rss"],
                    "moetray_rss": ours["rss"],
                    "llama_device_mib": _device_mib(llama),
                    "moetray_device_mib": _device_mib(ours),
                    "moetray_store": ours.get("expert_store_format"),
                    "moetray_dtype": ours.get("dtype"),
                    "moetray_slots": ours.get("moe_slots"),
                    "rss_ratio": ours["rss"] / llama["rss"],
                    **{f"{side}_{part}": footprint.get(part) for part in RSS_PARTS.values()
                       for side, footprint in (("llama", llama), ("moetray", ours))},
                }
                for key in ("decode_tok_s", "aggregate_tok_s", "ttft_ms"):
                    row[f"{key}_ratio"] = paired_ratio(ms[conc]["rounds"], ls[conc]["rounds"], key)
                rows.append(row)
                table.append([
                    label, setting, int(conc), ls[conc]["decode_tok_s"], ms[conc]["decode_tok_s"],
                    row["decode_tok_s_ratio"], ls[conc]["aggregate_tok_s"], ms[conc]["aggregate_tok_s"],
                    ls[conc]["ttft_ms"], ms[conc]["ttft_ms"], _mib(llama["rss"]), _mib(ours["rss"]),
                    row["rss_ratio"], row["llama_device_mib"], row["moetray_device_mib"],
                ])
                lc, mc = ls[conc], ms[conc]
                _progress(
                    f"  c={conc}: decode llama.cpp {lc['decode_tok_s']} vs moetray "
                    f"{mc['decode_tok_s']} tok/s; "
                    f"TTFT {lc['ttft_ms']:.0f} vs {mc['ttft_ms']:.0f} ms"
                )
    goal = rss_goal_summary(rss)
    peer = (f"llama-server ({args.llama_server.name} {args.llama_args})".replace(" )", ")")
            if args.llama_server is not None else "llama-cpp-python")
    path = write_receipt(
        args.receipt,
        params={
            "threads": args.threads,
            "rounds": args.rounds,
            "tokens": args.tokens,
            "concurrency": args.concurrency,
            "moe_capacity": args.moe_capacity,
            "dtype": args.dtype,
            "device": args.device,
            "kv_tokens": args.kv_tokens,
            "peer": peer,
            "offload": args.offload or None,
            "files": [label for label, _ in files],
        },
        results={"rows": rows, "goals": {RSS_GOAL: goal, LONG_TTFT_GOAL: long}},
        columns=[
            "file", "setting", "concurrency", "llama.cpp decode tok/s", "moetray decode tok/s",
            "moetray ÷ llama.cpp", "llama.cpp aggregate tok/s", "moetray aggregate tok/s",
            "llama.cpp TTFT ms", "moetray TTFT ms", "llama.cpp RSS MiB", "moetray RSS MiB",
            "RSS moetray ÷ llama.cpp", "llama.cpp device MiB", "moetray device MiB",
        ],
        rows=table,
        title=f"moetray vs llama.cpp on the same GGUF ({peer}, moetray on --device {args.device})",
        notes=[
            "Same file, prompts, thread count and greedy decode; each server in its own child process, both "
            f"up at once, taking turns round by round ({args.rounds} rounds of each concurrency; figures: "
            "medians over the rounds; ratios: the median of each round's moetray ÷ llama.cpp). "
            "Decode tok/s: per request, tokens after the first over the time after the first (median). "
            f"Every request decodes exactly {args.tokens} tokens of text on both servers (logit_bias bans "
            "the file's control tokens: the two arithmetics end a prompt at different lengths). "
            + ("llama-cpp-python's Llama decodes one sequence at a time: a round's requests are answered "
               "in turn on its main thread, each first token timed from the round's start."
               if args.llama_server is None else
               "llama-server batches its concurrent requests (one slot each, --parallel)."),
            "Device MiB: NVML's figure for the server's process where the driver names it, else the "
            "GPU's memory in use while it served over before it started (— without an NVIDIA GPU).",
            speed_goals_note(rows),
            rss_goal_note(goal),
            long_prompt_note(long),
            f"reproduce: `.venv/bin/moetray bench peer {shlex.join(_without_workdir(argv))}`",
        ],
    )
    _progress(f"receipt: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
