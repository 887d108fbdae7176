"""The constrained-decoding rows of `moetray bench serve`: grammar-forced output vs free output.

The same prompts as unconstrained chat requests, with a ``json_schema`` ``response_format``
or ``tool_choice="required"``, against one moetray server in one run; kinds interleaved per
round, medians reported. Every request runs to ``max_tokens`` (``ignore_eos``), so each kind
generates the same number of tokens. Goal: constrained decoding costs at most 10 % tok/s at
concurrency 1 and 8. ``moetray bench serve --constrained-only`` runs these rows alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from pathlib import Path
from typing import Any

import httpx

from moetray.engine.bench.serve import GIB, Child, metered_throughput, start_moetray

_NOTE_SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string"}, "notes": {"type": "string"}},
    "required": ["topic", "notes"],
}
_TOOLS = [{"type": "function", "function": {"name": "save_note", "parameters": _NOTE_SCHEMA}}]
CONSTRAINED_KINDS: dict[str, dict[str, Any]] = {
    "unconstrained": {},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "note", "schema": _NOTE_SCHEMA}}
    },
    "tools_auto": {"tools": _TOOLS, "tool_choice": "auto"},
    "tool_required": {"tools": _TOOLS, "tool_choice": "required"},
}
"""The constrained-decoding rows' request kinds: the same prompts, unconstrained or forced by grammar.
Every request runs to ``max_tokens`` (``ignore_eos``), so each kind generates the same tokens.
``tools_auto`` carries the same tools as ``tool_required`` with no grammar (the model decides):
its prompt is as long, so the pair isolates what the grammar costs from what the tool block costs."""

BASELINES = {"json_schema": "unconstrained", "tool_required": "tools_auto"}
"""Which kind each constrained kind is measured against."""


async def constrained(child: Child, model: str, *, concurrency: int, requests: int, max_tokens: int,
                      rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Throughput of each :data:`CONSTRAINED_KINDS` kind, rounds interleaved (kind order rotates).

    Each run also records the server's CPU ms per generated token, a clock that other work on
    a shared machine disturbs less than wall time.
    """
    out: dict[str, list[dict[str, Any]]] = {kind: [] for kind in CONSTRAINED_KINDS}
    kinds = list(CONSTRAINED_KINDS)
    for rnd in range(rounds):
        for kind in kinds[rnd % len(kinds):] + kinds[: rnd % len(kinds)]:
            extra = {**CONSTRAINED_KINDS[kind], "ignore_eos": True}
            print(f"constrained c={concurrency} round {rnd} {kind}…", flush=True)
            run = await metered_throughput(
                child, model, concurrency=concurrency, requests=requests, max_tokens=max_tokens,
                tag=f"constrained-{rnd}", extra=extra,
            )
            out[kind].append(run)
    return out


def constrained_rows(results: dict[str, Any]) -> tuple[list[list[Any]], dict[str, bool | None]]:
    """Rows (constrained tok/s vs unconstrained, same prompts, same run) and the ≤ 10 % cost goal."""
    rows, goals = [], {}
    for c, kinds in results.items():
        med = {k: statistics.median(r["tok_s"] for r in runs) for k, runs in kinds.items() if runs}
        cpu = {
            k: statistics.median(r["server_cpu_ms_per_token"] for r in runs)
            for k, runs in kinds.items()
            if runs
        }
        for kind, baseline in BASELINES.items():
            a, base = med.get(kind), med.get(baseline)
            ratio = a / base if a and base else None
            label = f"constrained decoding tok/s, {kind} vs {baseline}, concurrency {c}"
            rows.append([label, a, base, ratio])
            goals[f"constrained_{kind}_c{c}_cost_le_10pct"] = None if ratio is None else ratio >= 0.9
            a, base = cpu.get(kind), cpu.get(baseline)
            label = f"server CPU ms per token, {kind} vs {baseline}, concurrency {c} (B/A: CPU efficiency)"
            rows.append([label, a, base, base / a if a and base else None])
    return rows, goals


def constrained_main(args, model_dir: Path, common: dict[str, Any]) -> int:
    """``--constrained-only``: the constrained-decoding rows alone, in their own receipt."""
    from moetray.engine.bench.results import write_receipt

    load_before = os.getloadavg()
    child = start_moetray(model_dir, kv_tokens=args.kv_tokens, budget=4 * GIB, prefix="radix", **common)
    try:
        served_id = httpx.get(f"{child.url}/v1/models").json()["data"][0]["id"]
        results = {
            str(c): asyncio.run(
                constrained(
                    child, served_id, concurrency=c, requests=args.requests,
                    max_tokens=args.max_tokens, rounds=args.rounds,
                )
            )
            for c in (1, 8)
        }
    finally:
        child.stop()
    rows, goals = constrained_rows(results)
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    params["model"] = str(model_dir)
    path = write_receipt(
        "serve-constrained",
        params=params,
        results={"constrained": results, "goals": goals, "loadavg": [load_before, os.getloadavg()]},
        columns=["measure", "constrained (A)", "unconstrained (B)", "A/B"],
        rows=rows,
        title="Serving: constrained decoding (llguidance masks) vs unconstrained, moetray (HTTP, CPU)",
        notes=[
            CONSTRAINED_NOTE,
            f"Goals: {json.dumps(goals)}.",
            f"Machine load average (1/5/15 min) before and after: {load_before} / {os.getloadavg()}; "
            "wall-clock tok/s on a shared machine swings with it, server CPU ms per token much less.",
        ],
    )
    print(f"receipt: {path}")
    for row in rows:
        print(" | ".join("—" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)) for v in row))
    return 0


CONSTRAINED_NOTE = (
    "Constrained decoding: the same prompts, with a json_schema response_format against none, and "
    "tool_choice='required' against the same tools with tool_choice='auto' (same prompt length: the tool "
    "block is in both), a two-string-field schema; every request run to max_tokens (ignore_eos) so each "
    "kind generates the same number of tokens; kinds interleaved per round, medians reported. "
    "Goal: constrained costs at most 10 % tok/s (A/B >= 0.9) at concurrency 1 and 8."
)
