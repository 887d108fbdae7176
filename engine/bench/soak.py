"""`moetray bench soak`: many streams for minutes, with disconnects and re-splits; the engine's RSS drift.

A long-running user's load, measured from outside: ``moetray serve`` runs as a child process,
``--streams`` clients (64) each send streaming chat completions back to back, and
``--disconnect`` of them (30 %) hang up mid-stream, after a random number of chunks. Every
``--resplit-every-s`` the KV pool is re-split to half its size and, half a period later,
back (the engine holds no request across a re-split: those arriving meanwhile get the
documented 503 ``rebuilding`` with ``retry: now`` and are sent again after ``Retry-After``,
as OpenAI's client does). psutil samples the engine's RSS every ``--sample-s``.

**RSS drift** is the engine's RSS at the end against its RSS when the warm-up ended, both
taken with the startup KV pool live and saturated by the load (so every page of it is
touched at both points): memory that grows with time served, not with the pools, is what
it shows. Goal: < 5 %. The run ends idle and is checked like the CI test: 0 KV pages in
use, 0 requests listed, 0 unexpected 5xx, every stream ended as its client chose.

The load itself (:class:`LoadPlan`, :func:`run_load`, :class:`LoadTally`) is shared with
``tests/api/test_load.py``, the CI-sized version (24 streams, one re-split in the middle).

    moetray bench soak [--streams 64] [--duration-s 300] [--model DIR]

The receipt goes to ``bench/results/soak.json``; ``moetray bench tables`` renders it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

DRIFT_GOAL_PCT = 5.0
MIB = 1 << 20
SETTLE_S = 30.0
"""Seconds after a re-split before RSS is read as a trend (the load touches the new pool first)."""
REFUSAL_RETRIES = 120
"""How many ``retry: now`` refusals one request sits out before it counts as failed."""


@dataclass(frozen=True)
class LoadPlan:
    """What the clients do. They stop after ``requests_per_stream`` each, or at ``duration_s``."""

    streams: int
    disconnect_fraction: float = 0.3
    max_tokens: tuple[int, int] = (8, 48)  # drawn per request; ignore_eos makes every reply that long
    requests_per_stream: int | None = None
    duration_s: float | None = None
    seed: int = 0

    @property
    def total(self) -> int | None:
        return None if self.requests_per_stream is None else self.streams * self.requests_per_stream


@dataclass
class LoadTally:
    """How every request ended, counted by the clients."""

    started: int = 0  # requests sent (a retried refusal counts once)
    completed: int = 0  # streams read to ``[DONE]`` with a finish reason
    disconnected: int = 0  # streams whose client hung up mid-stream on purpose
    statuses: Counter[int] = field(default_factory=Counter)  # every answer's status, retries included
    retried: Counter[str] = field(default_factory=Counter)  # ``retry: now`` refusals sat out, by kind
    server_errors: int = 0  # 5xx answers other than those documented ``retry: now`` refusals
    unexpected: list[str] = field(default_factory=list)  # other refusals, broken streams, transport errors

    def to_json(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "completed": self.completed,
            "disconnected": self.disconnected,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "retried": dict(self.retried),
            "server_errors": self.server_errors,
            "unexpected": self.unexpected[:20],
            "unexpected_count": len(self.unexpected),
        }


def _prompt(rng: random.Random, n: int) -> str:
    words = ("pages", "experts", "router", "tokens", "cache", "prefix", "stream", "memory", "split")
    return f"Request {n}: tell me about " + " ".join(rng.choice(words) for _ in range(rng.randint(4, 40)))


async def _one_request(client: httpx.AsyncClient, body: dict[str, Any], hang_up_after: int | None,
                       tally: LoadTally) -> None:
    """Send one streaming chat completion until it is served, refused for good, or hung up on."""
    for _ in range(REFUSAL_RETRIES):
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            tally.statuses[reply.status_code] += 1
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                try:
                    error = json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    error = {}
                if error.get("retry") == "now":
                    tally.retried[error.get("kind") or "?"] += 1
                    await asyncio.sleep(float(reply.headers.get("retry-after") or 1))
                    continue
                if reply.status_code >= 500:
                    tally.server_errors += 1
                tally.unexpected.append(f"HTTP {reply.status_code}: {text[:200]}")
                return
            chunks, finish, done = 0, None, False
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunks += 1
                for choice in json.loads(line[6:]).get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if hang_up_after is not None and chunks >= hang_up_after:
                    tally.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
            if done and finish is not None:
                tally.completed += 1
            else:
                tally.unexpected.append(f"stream broke after {chunks} chunks ({finish=}, {done=})")
            return
    tally.unexpected.append(f"still refused after {REFUSAL_RETRIES} retries: {dict(tally.retried)}")


async def run_load(url: str, plan: LoadPlan, tally: LoadTally | None = None) -> LoadTally:
    """Run ``plan`` against the engine at ``url``; returns (and fills) ``tally`` as requests end.

    Transport errors other than the planned hang-ups are recorded in ``tally.unexpected``,
    never raised: the tally is the verdict.
    """
    tally = tally if tally is not None else LoadTally()
    deadline = None if plan.duration_s is None else time.monotonic() + plan.duration_s
    limits = httpx.Limits(max_connections=plan.streams + 4, max_keepalive_connections=plan.streams + 4)
    timeout = httpx.Timeout(600.0, connect=30.0)

    async def stream_worker(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(plan.seed * 100003 + index)
        sent = 0
        while (plan.requests_per_stream is None or sent < plan.requests_per_stream) and (
                deadline is None or time.monotonic() < deadline):
            max_tokens = rng.randint(*plan.max_tokens)
            hangs_up = rng.random() < plan.disconnect_fraction
            hang_up = rng.randint(2, max(2, max_tokens // 2 + 1)) if hangs_up else None
            body = {"model": "default", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0.7, "seed": rng.randrange(1 << 30),
                    "messages": [{"role": "user", "content": _prompt(rng, index * 100000 + sent)}]}
            sent += 1
            tally.started += 1
            try:
                await _one_request(client, body, hang_up, tally)
            except httpx.HTTPError as exc:
                tally.unexpected.append(f"transport: {exc!r}")

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, trust_env=False) as client:
        await asyncio.gather(*(stream_worker(i, client) for i in range(plan.streams)))
    return tally


async def resplit(url: str, token: str, kv_tokens: int, *, idle_timeout_s: float = 300.0) -> dict[str, Any]:
    """``POST /admin/cache/rebuild {"kv_tokens"}`` under load; returns the outcome (raises on a refusal)."""
    async with httpx.AsyncClient(base_url=url, timeout=idle_timeout_s + 120, trust_env=False) as client:
        reply = await client.post("/admin/cache/rebuild", headers={"Authorization": f"Bearer {token}"},
                                  json={"kv_tokens": kv_tokens, "idle_timeout_s": idle_timeout_s})
    if reply.status_code != 200:
        raise RuntimeError(f"re-split to {kv_tokens} tokens: HTTP {reply.status_code} {reply.text[:300]}")
    return reply.json()


def wait_settled(url: str, token: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The engine's status once no request is listed and no KV page is in use (raises past the deadline)."""
    deadline = time.monotonic() + timeout_s
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snap = httpx.get(f"{url}/admin/status", headers={"Authorization": f"Bearer {token}"},
                         timeout=30, trust_env=False).json()
        if not snap["requests"] and snap["pools"]["kv_pages_used"] == 0:
            return snap
        time.sleep(0.2)
    raise TimeoutError(f"the engine never settled: requests {snap.get('requests')}, "
                       f"pools {snap.get('pools')}")


def tail_slope_mib_per_min(samples: list[dict[str, Any]], resplits: list[dict[str, Any]],
                           warmup_s: float) -> float | None:
    """The RSS trend (least squares, MiB per minute) from ``SETTLE_S`` after the last re-split (a new
    pool's pages are touched in that time), or from the warm-up's end: what RSS would keep doing
    with the pools left alone. None with fewer than 3 samples."""
    since = max([warmup_s] + [r["t_s"] + SETTLE_S for r in resplits])
    tail = [(s["t_s"] / 60.0, s["rss"] / MIB) for s in samples if s["t_s"] >= since]
    if len(tail) < 3:
        return None
    return round(statistics.linear_regression([t for t, _ in tail], [r for _, r in tail]).slope, 3)


# --- the bench --------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moetray bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--warmup-s", type=float, default=None, help="default: a fifth of the duration")
    p.add_argument("--disconnect", type=float, default=0.3, help="fraction of streams hung up mid-stream")
    p.add_argument("--resplit-every-s", type=float, default=60.0, help="0: no re-splits")
    p.add_argument("--kv-tokens", type=int, default=4096, help="small, so the load saturates the pool")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--model", type=Path, default=None, help="default: the serve bench's tiny MoE")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logdir", type=Path, default=None)
    return p


async def _soak(child, args, warmup_s: float) -> dict[str, Any]:
    import psutil

    from moetray.engine.bench.serve import ADMIN_TOKEN

    proc = psutil.Process(child.proc.pid)
    began = time.monotonic()
    plan = LoadPlan(streams=args.streams, disconnect_fraction=args.disconnect, duration_s=args.duration_s,
                    seed=args.seed)
    tally = LoadTally()
    samples: list[dict[str, Any]] = []
    pool = {"kv_tokens": args.kv_tokens}
    resplits: list[dict[str, Any]] = []
    marks: dict[str, int] = {}

    def sample() -> int:
        rss = int(proc.memory_info().rss)
        t_s = round(time.monotonic() - began, 1)
        samples.append({"t_s": t_s, "rss": rss, "kv_tokens": pool["kv_tokens"]})
        return rss

    async def sampler() -> None:
        while not load.done():
            sample()
            await asyncio.sleep(args.sample_s)

    async def resplitter() -> None:
        """At the end of the warm-up take the baseline, then half the pool and back, every period;
        the last period always ends on the startup pool, at least half a period before the end."""
        await asyncio.sleep(warmup_s)
        marks["baseline"] = sample()
        period = args.resplit_every_s
        if period <= 0:
            return
        while time.monotonic() - began + 1.5 * period <= args.duration_s:  # a re-split waits for idle too
            for kv_tokens in (args.kv_tokens // 2, args.kv_tokens):
                result = await resplit(child.url, ADMIN_TOKEN, kv_tokens)
                pool["kv_tokens"] = kv_tokens
                resplits.append({"t_s": round(time.monotonic() - began, 1), "kv_tokens": kv_tokens,
                                 "outcome": result.get("outcome"), "elapsed_ms": result.get("elapsed_ms")})
                await asyncio.sleep(period / 2)

    load = asyncio.ensure_future(run_load(child.url, plan, tally))
    await asyncio.gather(load, sampler(), resplitter())
    marks["end"] = sample()  # the load just stopped; the startup pool has been live and saturated since
    return {"tally": tally, "samples": samples, "resplits": resplits, "marks": marks,
            "load_s": round(time.monotonic() - began, 1)}


def main(argv: list[str]) -> int:
    from moetray.engine.bench.results import write_receipt
    from moetray.engine.bench.serve import ADMIN_TOKEN, start_small_moetray

    args = parser().parse_args(argv)
    warmup_s = args.warmup_s if args.warmup_s is not None else args.duration_s / 5
    child, model, _ = start_small_moetray(args, "soak")
    try:
        run = asyncio.run(_soak(child, args, warmup_s))
        settled = wait_settled(child.url, ADMIN_TOKEN)
        alive = child.proc.poll() is None
    finally:
        child.stop()
    tally: LoadTally = run["tally"]
    baseline, end = run["marks"]["baseline"], run["marks"]["end"]
    drift_pct = 100.0 * (end - baseline) / baseline
    after = [s for s in run["samples"] if s["t_s"] >= warmup_s]
    peak = max(s["rss"] for s in after)
    tail = tail_slope_mib_per_min(run["samples"], run["resplits"], warmup_s)
    served = tally.completed + tally.disconnected
    results = {
        "rss_baseline_bytes": baseline,
        "rss_end_bytes": end,
        "rss_peak_after_warmup_bytes": peak,
        "rss_drift_pct": round(drift_pct, 2),
        "rss_tail_slope_mib_per_min": tail,
        "goal_met": abs(drift_pct) < DRIFT_GOAL_PCT,
        "load": tally.to_json(),
        "resplits": run["resplits"],
        "settled": {"kv_pages_used": settled["pools"]["kv_pages_used"], "requests": len(settled["requests"]),
                    "requests_served": settled["throughput"]["requests_served"]},
        "engine_alive_at_end": alive,
        "load_s": run["load_s"],
        "samples": run["samples"],
    }
    rows = [[args.streams, run["load_s"], served, tally.disconnected, len(run["resplits"]),
             tally.server_errors, len(tally.unexpected), settled["pools"]["kv_pages_used"],
             round(baseline / MIB, 1), round(end / MIB, 1), round(drift_pct, 2), tail]]
    path = write_receipt(
        "soak",
        params={"streams": args.streams, "duration_s": args.duration_s, "warmup_s": warmup_s,
                "disconnect_fraction": args.disconnect, "resplit_every_s": args.resplit_every_s,
                "kv_tokens": args.kv_tokens, "threads": args.threads, "seed": args.seed, "model": str(model)},
        results=results,
        columns=["streams", "load s", "requests", "hung up", "re-splits", "5xx", "other failures",
                 "KV pages in use at end", "RSS after warm-up MiB", "RSS at end MiB", "RSS drift %",
                 "RSS trend at end MiB/min"],
        rows=rows,
        title="Soak: streams with mid-stream disconnects and re-splits, the engine's RSS drift",
        notes=[f"goal: RSS drift < {DRIFT_GOAL_PCT:g} % (end vs end of warm-up, startup KV pool live and "
               "saturated at both), 0 5xx, 0 KV pages in use once idle",
               "5xx excludes the documented 503 `rebuilding` (retry: now) answers, which the clients "
               f"sat out and sent again: {dict(tally.retried)}"],
    )  # fmt: skip
    print(f"{served} requests ({tally.disconnected} hung up), {len(run['resplits'])} re-splits, "
          f"{tally.server_errors} 5xx, {len(tally.unexpected)} other failures; RSS "
          f"{baseline / MIB:.1f} → {end / MIB:.1f} MiB ({drift_pct:+.2f} %); receipt {path}")
    ok = (alive and tally.server_errors == 0 and not tally.unexpected
          and abs(drift_pct) < DRIFT_GOAL_PCT)
    return 0 if ok else 1
