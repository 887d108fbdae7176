"""`moetray bench serve`: the HTTP serving benchmark, moetray vs `transformers serve`, side by side.

Both servers run as child processes on the same checkpoint, machine and thread count, with
the same continuous-batching geometry (page size, KV blocks, batch tokens); requests go
through HTTP exactly as a client's would. Measured in one run:

1. **aggregate throughput** at concurrency 1, 4 and 8 — completion tokens (from each
   reply's ``usage``) per second of wall time, rounds interleaved A/B;
2. **TTFT cold vs follow-up** — time to the first streamed token of a turn whose prompt
   carries a ``--prefix-tokens`` long history never seen before, against the next turn of
   the same conversation (which reuses that prefix from the cache);
3. **follow-up hit after memory pressure** — moetray with radix-decided eviction vs the
   substrate's stock ledger (``--prefix-cache stock``) on a deliberately small KV pool:
   how much of the follow-up's prompt is still cached after other traffic filled the pool;
4. **HTTP round trip** — ``GET /v1/models`` on a kept-alive connection (no generation): the
   fixed per-request cost of the HTTP layer, which every request of (1) pays once;
5. **re-split latency per byte moved** — ``POST /admin/cache/rebuild`` shifting the KV pool by
   64 MiB, 256 MiB, 1 GiB, and the expert pool between its floor and all experts;
6. **constrained decoding** — tok/s of ``json_schema`` and ``tool_choice="required"`` requests
   against the same prompts unconstrained, at concurrency 1 and 8 (``bench.constrained``).

The model is ``--model DIR``, or (default) a random-weight Qwen3-MoE generated once into the cache
with a 4096-token context so the prefix fits; random weights make outputs meaningless but the work
per token real. The receipt goes to ``bench/results/serve.json`` with the goals' status: ≥ 1.5×
`transformers serve` aggregate tok/s at concurrency 8; follow-up (radix hit) TTFT ≥ 5× faster than
cold; a 1 GiB re-split in < 250 ms."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from moetray.engine.bench.exits import exit_reason
from moetray.engine.bench.loadgen import sse_chunks
from moetray.engine.bench.random_model import CORPUS, ensure_random_model

ADMIN_TOKEN = "bench-admin-token"
GIB = 1 << 30
MIB = 1 << 20


# --- the benchmark model ----------------------------------------------------------------------


def bench_model_dir() -> Path:
    import platformdirs

    return platformdirs.user_cache_path("moetray") / "bench" / "serve-qwen3moe-4k"


def ensure_bench_model(path: Path | None = None) -> Path:
    """A random Qwen3-MoE (4 layers, 16 experts, top-2, 4096 context) with a byte-level BPE and ChatML."""
    from transformers import Qwen3MoeConfig

    cfg = {"intermediate_size": 512, "norm_topk_prob": True}
    return ensure_random_model(path or bench_model_dir(), Qwen3MoeConfig, **cfg)


# --- child servers ----------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on now (for a child server to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """One server process in its own session (stopped by signalling the group)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._fh = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, ready, timeout: float = 600.0, path: str = "/health") -> None:
        """Waits for ``ready(GET path)``; a child that fails to get there is stopped, never left behind."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if (code := self.proc.poll()) is not None:
                    raise RuntimeError(f"{self.name} exited early ({exit_reason(code)}); see {self.log}")
                with contextlib.suppress(httpx.HTTPError):
                    if ready(httpx.get(f"{self.url}{path}", timeout=2.0)):
                        return
                time.sleep(0.2)
            raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._fh.close()


def stop_process_group(proc: subprocess.Popen) -> None:
    """End a child started in its own session: SIGTERM to its group, SIGKILL if it outlives 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass  # the group ended between the poll and the signal
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETRAY_")}
    env.update(
        OMP_NUM_THREADS=str(threads),
        MOETRAY_ADMIN_TOKEN=ADMIN_TOKEN,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def start_moetray(
    model: Path,
    *,
    kv_tokens: int,
    budget: int,
    threads: int,
    prefix: str,
    logdir: Path,
    page: int,
    batch_tokens: int,
) -> Child:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "moetray.app.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--kv-tokens",
        str(kv_tokens),
        "--budget-bytes",
        str(budget),
        "--threads",
        str(threads),
        "--prefix-cache",
        prefix,
        "--page-size",
        str(page),
        "--max-batch-tokens",
        str(batch_tokens),
        "--log-level",
        "warning",
    ]
    child = Child(f"moetray[{prefix}]", cmd, port, _env(threads), logdir / f"moetray-{prefix}.log")
    child.wait_ready(engine_serving)
    return child


def engine_serving(r: httpx.Response) -> bool:
    """Whether a moetray engine's ``/health`` says it serves; a failed load raises its reason."""
    if (state := r.json().get("state")) == "failed":
        raise RuntimeError(f"moetray failed to load: {r.text}")
    return state == "serving"


def start_small_moetray(args: Any, name: str) -> tuple[Child, Path, Path]:
    """The robustness benches' engine (``soak``, ``fuzz``): ``--model`` or the bench model on a
    small pool (``--kv-tokens``, a 256 MiB expert budget, 16-token pages, 64-token batches),
    logging into ``--logdir`` or a new temporary folder; the child, its model and its log folder."""
    model = args.model or ensure_bench_model()
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix=f"moetray-{name}-"))
    logdir.mkdir(parents=True, exist_ok=True)  # a --logdir given may not exist yet
    child = start_moetray(
        model, kv_tokens=args.kv_tokens, budget=256 << 20, threads=args.threads, prefix="radix",
        logdir=logdir, page=16, batch_tokens=64,
    )  # fmt: skip
    return child, model, logdir


def start_transformers(
    model: Path, *, kv_pages: int, threads: int, logdir: Path, page: int, batch_tokens: int
) -> Child:
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    cmd = [
        str(exe),
        "serve",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--continuous-batching",
        "--cb-block-size",
        str(page),
        "--cb-num-blocks",
        str(kv_pages),
        "--cb-max-batch-tokens",
        str(batch_tokens),
        "--log-level",
        "warning",
    ]
    child = Child("transformers serve", cmd, port, _env(threads), logdir / "transformers-serve.log")
    child.wait_ready(lambda r: r.status_code == 200)
    return child


# --- load generation --------------------------------------------------------------------------


async def _chat(
    client: httpx.AsyncClient, url: str, model: str, messages, max_tokens: int, extra: dict | None = None
) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **(extra or {})}
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


async def throughput(
    url: str,
    model: str,
    *,
    concurrency: int,
    requests: int,
    max_tokens: int,
    tag: str,
    extra: dict | None = None,
) -> dict[str, Any]:
    """Completion tokens per second for ``requests`` distinct prompts, ``concurrency`` at a time.

    ``extra`` fields go into every request body (``ignore_eos`` for a fixed token count; the
    constrained-decoding rows' ``response_format`` and ``tools``).
    """
    sem = asyncio.Semaphore(concurrency)
    tokens: list[int] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with sem:
            msg = [
                {"role": "user", "content": f"{tag} request {i}: tell me about experts, caches and pages."}
            ]
            reply = await _chat(client, url, model, msg, max_tokens, extra)
            tokens.append(int(reply["usage"]["completion_tokens"]))

    async with httpx.AsyncClient(timeout=600.0) as client:
        await _chat(client, url, model, [{"role": "user", "content": f"warm-up {tag}"}], 4, extra)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, client) for i in range(requests)))
        wall = time.perf_counter() - t0
    return {"tok_s": sum(tokens) / wall, "tokens": sum(tokens), "wall_s": wall, "requests": requests}


async def metered_throughput(child: Child, model: str, **round_: Any) -> dict[str, Any]:
    """One :func:`throughput` round on ``child``, plus ``server_cpu_ms_per_token``: the server's
    user + system CPU seconds over the round (all its threads) per completion token."""
    import psutil

    server = psutil.Process(child.proc.pid)
    cpu0 = sum(server.cpu_times()[:2])
    res = await throughput(child.url, model, **round_)
    res["server_cpu_ms_per_token"] = (sum(server.cpu_times()[:2]) - cpu0) / max(1, res["tokens"]) * 1e3
    return res


async def ttft(
    url: str, model: str, messages, max_tokens: int = 8
) -> tuple[float, dict[str, Any] | None, str]:
    """Seconds to the first streamed content token; the usage chunk (when sent) and the text."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, usage, text = None, None, []
    async with httpx.AsyncClient(timeout=600.0) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for chunk in sse_chunks(r):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        if first is None:
                            first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), usage, "".join(text)


def _long_history(tag: str, n_tokens: int, tokenizer) -> str:
    words, text = [], ""
    sentences = CORPUS.split(". ")
    i = 0
    while len(tokenizer.encode(text)) < n_tokens:
        words.append(f"[{tag}:{i}] {sentences[i % len(sentences)]}.")
        text = " ".join(words)
        i += 1
    return text


async def cold_vs_followup(
    url: str, model: str, tokenizer, *, prefix_tokens: int, rounds: int, tag: str
) -> dict[str, Any]:
    colds, follows, cached = [], [], []
    for r in range(rounds):
        history = [{"role": "user", "content": _long_history(f"{tag}{r}", prefix_tokens, tokenizer)}]
        cold_s, _, answer = await ttft(url, model, history)
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
        follow_s, usage, _ = await ttft(url, model, history)
        colds.append(cold_s)
        follows.append(follow_s)
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached.append(details.get("cached_tokens"))
    return {
        "cold_ms": [c * 1000 for c in colds],
        "followup_ms": [f * 1000 for f in follows],
        "cold_ms_median": statistics.median(colds) * 1000,
        "followup_ms_median": statistics.median(follows) * 1000,
        "cached_tokens": cached,
    }


async def pressure_followup(
    url: str, model: str, tokenizer, *, prefix_tokens: int, fillers: int, filler_tokens: int
) -> dict[str, Any]:
    """A conversation, then other traffic that overflows the pool, then the conversation's next turn."""
    history = [{"role": "user", "content": _long_history("keep", prefix_tokens, tokenizer)}]
    _, _, answer = await ttft(url, model, history)
    async with httpx.AsyncClient(timeout=600.0) as client:
        for i in range(fillers):
            msg = [{"role": "user", "content": _long_history(f"filler{i}", filler_tokens, tokenizer)}]
            await _chat(client, url, model, msg, 4)
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Continue."}]
    follow_s, usage, _ = await ttft(url, model, history)
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "followup_ms": follow_s * 1000,
        "cached_tokens": details.get("cached_tokens"),
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
    }


def resplits(
    url: str,
    bytes_per_page: int,
    bytes_per_slot: int,
    floor_slots: int,
    max_slots: int,
    base_kv_pages: int,
    page: int,
) -> list[dict[str, Any]]:
    """Re-split the live engine by given byte amounts; HTTP wall time and the server's own ``elapsed_ms``."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    out = []

    def post(body):
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/admin/cache/rebuild", headers=headers, json=body, timeout=600)
        wall = (time.perf_counter() - t0) * 1000
        r.raise_for_status()
        return r.json(), wall

    for moved in (64 * MIB, 256 * MIB, GIB):
        pages = moved // bytes_per_page
        for direction, target in (("grow", base_kv_pages + pages), ("shrink", base_kv_pages)):
            result, wall = post({"kv_tokens": target * page})
            real = abs(result["after"]["kv_pages"] - result["before"]["kv_pages"]) * bytes_per_page
            out.append(
                {
                    "pool": "kv",
                    "direction": direction,
                    "bytes_moved": real,
                    "elapsed_ms": result["elapsed_ms"],
                    "http_ms": wall,
                    "outcome": result["outcome"],
                }
            )
    for direction, target in (("shrink", floor_slots), ("grow", max_slots)):
        result, wall = post({"moe_slots": target})
        real = abs(result["after"]["moe_slots"] - result["before"]["moe_slots"]) * bytes_per_slot
        out.append(
            {
                "pool": "moe",
                "direction": direction,
                "bytes_moved": real,
                "elapsed_ms": result["elapsed_ms"],
                "http_ms": wall,
                "outcome": result["outcome"],
            }
        )
    return out


def http_round_trip_ms(url: str, n: int = 20) -> float:
    """Median wall ms of ``GET /v1/models`` on one kept-alive connection (after one warm-up)."""
    times = []
    with httpx.Client(timeout=60.0) as client:
        client.get(f"{url}/v1/models").raise_for_status()
        for _ in range(n):
            t0 = time.perf_counter()
            client.get(f"{url}/v1/models").raise_for_status()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --- main -------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moetray bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: a generated 4k-context tiny MoE)"
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads for each server")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="interleaved A/B rounds per level (median reported)")
    p.add_argument("--prefix-tokens", type=int, default=1536)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--skip-transformers", action="store_true", help="measure moetray only")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--logdir", type=Path, default=None)
    p.add_argument(
        "--constrained-only",
        action="store_true",
        help="only the constrained-decoding rows (moetray alone; receipt serve-constrained.json)",
    )
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="serve a generated hybrid (Gated DeltaNet + attention) model: state snapshots vs cold, "
        "throughput vs transformers' generate (receipt serve-hybrid)",
    )
    return p


def main(argv: list[str]) -> int:
    from moetray.engine.bench.constrained import CONSTRAINED_NOTE, constrained, constrained_rows

    args = parser().parse_args(argv)
    if args.hybrid:
        from moetray.engine.bench.serve_hybrid import run

        return run(args)
    from transformers import AutoTokenizer

    print("preparing the benchmark model…", flush=True)
    model_dir = ensure_bench_model() if args.model is None else args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    logdir = args.logdir or Path(os.environ.get("TMPDIR", "/tmp")) / f"moetray-bench-serve-{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    page, kv_pages = args.page_size, args.kv_tokens // args.page_size
    common = dict(threads=args.threads, logdir=logdir, page=page, batch_tokens=args.max_batch_tokens)
    if args.constrained_only:
        from moetray.engine.bench.constrained import constrained_main

        return constrained_main(args, model_dir, common)
    results: dict[str, Any] = {
        "throughput": {}, "http_rtt_ms": {}, "ttft": {}, "pressure": {}, "resplit": [], "constrained": {}
    }
    children: list[Child] = []
    try:
        print("starting moetray serve…", flush=True)
        mt = start_moetray(model_dir, kv_tokens=args.kv_tokens, budget=4 * GIB, prefix="radix", **common)
        children.append(mt)
        served_id = httpx.get(f"{mt.url}/v1/models").json()["data"][0]["id"]
        servers = [("moetray", mt, served_id)]
        if not args.skip_transformers:
            print("starting transformers serve…", flush=True)
            ts = start_transformers(model_dir, kv_pages=kv_pages, **common)
            children.append(ts)
            servers.append(("transformers serve", ts, str(model_dir)))
        for c in (1, 4, 8):
            for name, _, _ in servers:
                results["throughput"].setdefault(name, {})[str(c)] = []
            for rnd in range(args.rounds):
                order = servers if rnd % 2 == 0 else list(reversed(servers))
                for name, child, mid in order:
                    print(f"throughput c={c} round {rnd} {name}…", flush=True)
                    res = asyncio.run(
                        metered_throughput(
                            child,
                            mid,
                            concurrency=c,
                            requests=args.requests,
                            max_tokens=args.max_tokens,
                            tag=f"{name}-{c}-{rnd}",
                        )
                    )
                    results["throughput"][name][str(c)].append(res)
        for c in (1, 8):
            results["constrained"][str(c)] = asyncio.run(
                constrained(
                    mt, served_id, concurrency=c, requests=args.requests, max_tokens=args.max_tokens,
                    rounds=args.rounds,
                )
            )
        for name, child, _ in servers:
            print(f"HTTP round trip on {name}…", flush=True)
            results["http_rtt_ms"][name] = http_round_trip_ms(child.url)
        for name, child, mid in servers:
            print(f"TTFT cold vs follow-up ({args.prefix_tokens}-token prefix) on {name}…", flush=True)
            results["ttft"][name] = asyncio.run(
                cold_vs_followup(
                    child.url, mid, tokenizer, prefix_tokens=args.prefix_tokens, rounds=3, tag=name[:3]
                )
            )
        status = httpx.get(
            f"{mt.url}/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ).json()
        pools = status["pools"]
        print("re-split latency…", flush=True)
        results["resplit"] = resplits(
            mt.url,
            pools["bytes_per_page"],
            pools["bytes_per_slot"],
            pools["floors"]["moe_slots"],
            pools["limits"]["moe_slots"]["max"],
            pools["kv_pages"],
            page,
        )
        for child in children:
            child.stop()
        children.clear()
        small_kv = args.prefix_tokens * 3
        for prefix in ("radix", "stock"):
            print(f"follow-up after pressure, {prefix} ledger…", flush=True)
            child = start_moetray(model_dir, kv_tokens=small_kv, budget=GIB, prefix=prefix, **common)
            children.append(child)
            results["pressure"][prefix] = asyncio.run(
                pressure_followup(
                    child.url,
                    served_id,
                    tokenizer,
                    prefix_tokens=args.prefix_tokens,
                    fillers=3,
                    filler_tokens=args.prefix_tokens // 2,
                )
            )
            child.stop()
            children.remove(child)
    finally:
        for child in children:
            child.stop()

    def med(name: str, c: int, key: str = "tok_s") -> float | None:
        runs = results["throughput"].get(name, {}).get(str(c))
        return statistics.median(r[key] for r in runs) if runs else None

    rows: list[list[Any]] = []  # [label, moetray, stock, ratio]
    notes: list[str] = []
    for c in (1, 4, 8):
        a, b = med("moetray", c), med("transformers serve", c)
        rows.append([f"aggregate tok/s, concurrency {c}", a, b, (a / b) if a and b else None])
    for c in (1, 4, 8):
        key = "server_cpu_ms_per_token"
        a, b = med("moetray", c, key), med("transformers serve", c, key)
        rows.append([f"server CPU ms per generated token, concurrency {c} (B/A: CPU efficiency)", a, b,
                     (b / a) if a and b else None])
    rtt_a, rtt_b = (results["http_rtt_ms"].get(n) for n in ("moetray", "transformers serve"))
    rows.append(["HTTP round trip ms, GET /v1/models (median of 20, no generation)", rtt_a, rtt_b,
                 (rtt_a / rtt_b) if rtt_a and rtt_b else None])
    for name, label in (("moetray", "moetray"), ("transformers serve", "transformers serve")):
        t = results["ttft"].get(name)
        if t:
            rows.append(
                [
                    f"TTFT ms cold / follow-up ({label})",
                    t["cold_ms_median"],
                    t["followup_ms_median"],
                    t["cold_ms_median"] / t["followup_ms_median"],
                ]
            )
    pr, ps = results["pressure"].get("radix"), results["pressure"].get("stock")
    if pr and ps:
        rows.append(
            [
                "follow-up cached tokens after pressure (radix / stock ledger)",
                pr["cached_tokens"],
                ps["cached_tokens"],
                None,
            ]
        )
        rows.append(
            [
                "follow-up TTFT ms after pressure (radix / stock ledger)",
                pr["followup_ms"],
                ps["followup_ms"],
                ps["followup_ms"] / pr["followup_ms"] if pr["followup_ms"] else None,
            ]
        )
    gib_runs = [r for r in results["resplit"] if r["pool"] == "kv" and r["bytes_moved"] >= GIB * 0.99]
    for r in results["resplit"]:
        rows.append(
            [
                f"re-split {r['pool']} {r['direction']} {r['bytes_moved'] / MIB:.0f} MiB (ms server / HTTP)",
                r["elapsed_ms"],
                r["http_ms"],
                None,
            ]
        )
    c_rows, c_goals = constrained_rows(results["constrained"])
    rows += c_rows
    notes.append(CONSTRAINED_NOTE)
    ratio8 = rows[2][3]
    t = results["ttft"].get("moetray")
    speedup = t["cold_ms_median"] / t["followup_ms_median"] if t else None
    worst_gib = max((r["elapsed_ms"] for r in gib_runs), default=None)
    goals = {
        "tok_s_ratio_c8_ge_1.5": None if ratio8 is None else ratio8 >= 1.5,
        "radix_hit_ttft_speedup_ge_5": None if speedup is None else speedup >= 5.0,
        "resplit_1gib_lt_250ms": None if worst_gib is None else worst_gib < 250.0,
        **c_goals,
    }
    notes.append(
        f"Goals: {json.dumps(goals)} (c=8 ratio {ratio8}, follow-up speed-up {speedup}, "
        f"slowest 1 GiB re-split {worst_gib} ms)."
    )
    notes.append(
        "Same checkpoint, CPU threads and CB geometry for both servers; requests over HTTP; rounds "
        "interleaved A/B, medians reported. Random weights: outputs are meaningless, the work per token "
        "is real."
    )
    notes.append(
        "Server CPU ms per token: the server process's user+system CPU seconds (all its threads) over a "
        "throughput run, per completion token; a second clock beside wall time that other processes on a "
        "shared machine disturb less. moetray computes its experts with its default arithmetic "
        "(stock grouped_mm's, bit for bit) and, with two threads, shares a decode step's small expert "
        "GEMMs over both; transformers serve runs stock grouped_mm with every expert resident."
    )
    notes.append(
        "HTTP round trip: a request that needs no generation, so it is the HTTP layer alone; every "
        "throughput request pays it once. A ~40 ms round trip is Nagle's algorithm meeting the client's "
        "delayed ACK: the server's connections lack TCP_NODELAY."
    )
    notes.append(
        "Re-split ms is the server's elapsed_ms (gate → validate → idle wait → txn); HTTP ms adds the "
        "round trip. KV re-splits re-create the paged cache (stop loop, free, allocate zeroed pool, start)."
    )
    results["goals"] = goals
    return report(
        "serve", args, model_dir, baseline="transformers serve", results=results, rows=rows,
        title="Serving: moetray vs transformers serve (HTTP, CPU)", notes=notes,
    )  # fmt: skip


def report(
    name: str, args: Any, model_dir: Path, *, baseline: str, results: dict[str, Any], rows: list[list[Any]],
    title: str, notes: list[str],
) -> int:  # fmt: skip
    """Write a serving bench's receipt (its parsed ``args`` as the params, ``model_dir`` as the
    model; columns moetray (A) against ``baseline`` (B)) and print its rows; the exit status."""
    from moetray.engine.bench.results import write_receipt

    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    params["model"] = str(model_dir)
    columns = ["measure", "moetray (A)", f"{baseline} / other (B)", "A/B"]
    path = write_receipt(
        name, params=params, results=results, columns=columns, rows=rows, title=title, notes=notes
    )
    print(f"receipt: {path}")
    for row in rows:
        print(" | ".join("—" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)) for v in row))
    return 0
