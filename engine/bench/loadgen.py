"""A streaming load generator for decode benchmarks, run as its own process.

    python -m moetray.engine.bench.loadgen --url URL --model ID --concurrency C --requests N
                                           --max-tokens T [--extra-json '{...}']

Sends ``N`` chat completions (``C`` at a time) with ``stream: true``, greedy, every request
asked for exactly ``T`` new tokens (``ignore_eos``), each a different prompt so no reply is a
copy of another (after an optional short warm-up request and a pause, :data:`SETTLE_S`), and
prints one JSON object: per request the time to the first content
token, the time of the last one and the completion tokens (from the usage chunk); overall
the wall time and aggregate tokens per second. It runs in its own process so that its SSE
parsing never competes with the measured server for that server's interpreter lock; the
same client measures every server (moetray in-process engines, llama.cpp's server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from moetray.policy.step_threads import TEAM_LEAVE_WINDOW_S

SETTLE_S = 2 * TEAM_LEAVE_WINDOW_S
"""Seconds the client waits before the timed requests (after its warm-up request, if any): its own
start-up (a Python interpreter importing httpx and asyncio, ~0.3-0.5 s of a core) is then older than
twice the longest window of load the engines read, so an engine that gives decode steps the whole
thread budget only while other programs leave the cores free (``engine/cores.py``) does not read
the load generator's start as a busy machine (it did: 40 % of the timed batch-1 steps on one
thread). Every server waits the same."""

TOPICS = ["the sea", "mountains", "a library", "trains", "gardens", "the moon", "rivers", "winter",
          "a market", "bridges", "clocks", "forests", "deserts", "islands", "cities", "music"]


def prompt(i: int, tag: str) -> list[dict[str, str]]:
    """The ``i``-th benchmark prompt: distinct per request (no shared prefix beyond the template)."""
    return [{"role": "user", "content": f"{tag} {i}: write a long story about {TOPICS[i % len(TOPICS)]}."}]


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-style event stream (its ``data:`` lines, up to ``[DONE]``)."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {r.status_code}: {text[:300]}")
        async for chunk in sse_chunks(r):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
    counted = usage.get("completion_tokens") if usage else None
    tokens = int(counted) if counted is not None else chunks
    return {"ttft_s": None if first is None else first - t0, "last_s": None if last is None else last - t0,
            "tokens": tokens, "content_chunks": chunks}


async def run(url: str, model: str, *, concurrency: int, requests: int, max_tokens: int, tag: str,
              extra: dict[str, Any], warm_up: bool = True) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)

    async def limited(i: int, client: httpx.AsyncClient) -> dict[str, Any]:
        body = {"model": model, "messages": prompt(i, tag), "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}
        body = {k: v for k, v in body.items() if v is not None}  # an extra of null drops a field
        async with sem:
            return await one_request(client, url, body)

    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        if warm_up:
            warm = {"model": model, "messages": prompt(0, "warm-up"), "max_tokens": 4, "temperature": 0,
                    "stream": True, **extra}
            await one_request(client, url, {k: v for k, v in warm.items() if v is not None})
        await asyncio.sleep(SETTLE_S)
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(limited(i, client) for i in range(requests)))
        wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in replies)
    return {"wall_s": wall, "tokens": total, "aggregate_tok_s": total / wall if wall > 0 else None,
            "requests": replies}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m moetray.engine.bench.loadgen",
                                description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=None, help="default: the concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tag", default="bench")
    p.add_argument("--no-warm-up", action="store_true", help="no 4-token request before the timed ones")
    p.add_argument("--extra-json", default="{}", help="extra request body fields (null drops a field)")
    args = p.parse_args(argv)
    out = asyncio.run(run(args.url, args.model, concurrency=args.concurrency,
                          requests=args.requests or args.concurrency, max_tokens=args.max_tokens,
                          tag=args.tag, extra=json.loads(args.extra_json), warm_up=not args.no_warm_up))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
