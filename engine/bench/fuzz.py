"""`moetray bench fuzz`: schemathesis against a live engine, every check on, from its own OpenAPI schema.

The engine documents every status each route can return (``engine/api/openapi.py``); this
run holds it to that. schemathesis generates schema-valid and schema-violating requests for
every operation (its examples, coverage, fuzzing and stateful phases) and applies every
check it has: no server error, documented status codes, content types, response schemas and
headers, negative data rejected, positive data accepted, 405 for undocumented methods, auth
not ignored. Goal: 0 failures of any check.

Left out of the run: ``GET /admin/events`` (an endless SSE stream; a client reads it for as
long as it likes) and ``POST /admin/prepare-stop`` (the first success stops the engine for
good, so every later case would test a stopped engine); the API tests cover both.

One rule is configured rather than inferred: a schema-valid request may still be refused by a
rule the schema cannot state, because it depends on the loaded model (the expert floor, the
vocabulary, the context, what the chat template accepts). Those are 400s with a named kind,
so ``positive_data_acceptance`` counts 400 among the expected answers.

    moetray bench fuzz [--examples 3000] [--model DIR] [--seed N]

The receipt (``bench/results/fuzz.json``) records the cases generated, the failures by check
and the operations covered. :func:`run_schemathesis` is what the CI test calls (a bounded run).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EXCLUDED_PATHS = ("/admin/events", "/admin/prepare-stop")
CONFIG = """\
# A schema-valid request the loaded model refuses (floors, vocabulary, context, template) is a 400
# with a named kind: the schema cannot state those rules.
[checks.positive_data_acceptance]
expected-statuses = ["2XX", "400", "401", "403", "404", "409", "429", "5XX"]
"""


def run_schemathesis(
    base_url: str,
    admin_token: str,
    *,
    max_examples: int,
    seed: int = 1,
    workdir: Path,
    phases: str | None = None,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Run the schemathesis CLI (every check) against ``base_url``; returns its JSON report, plus ``output``.

    ``max_examples`` is per operation and phase. Raises ``RuntimeError`` when schemathesis
    itself could not run (no report written).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    report = workdir / "report.json"
    report.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
        "run", f"{base_url}/openapi.json",
        "--checks", "all",
        "--max-examples", str(max_examples),
        "--seed", str(seed),
        "--workers", "1",
        "--request-timeout", "300",
        "--max-response-time", "120",  # a CPU reply generating up to the whole context is slow, not wrong
        "--header", f"Authorization: Bearer {admin_token}",
        "--report", "json", "--report-json-path", str(report),
        "--output-sanitize", "false",
        "--suppress-health-check", "all",
    ]  # fmt: skip
    for path in EXCLUDED_PATHS:
        cmd += ["--exclude-path", path]
    if phases:
        cmd += ["--phases", phases]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if not report.is_file():
        raise RuntimeError(
            f"schemathesis wrote no report (exit {done.returncode}):\n{done.stdout[-4000:]}"
            f"\n{done.stderr[-4000:]}"
        )
    result = json.loads(report.read_text())
    result["output"] = done.stdout
    result["returncode"] = done.returncode
    return result


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers a receipt keeps from a schemathesis report."""
    cases = report.get("test_cases", {})
    return {
        "generated": cases.get("generated"),
        "with_failures": cases.get("with_failures"),
        "unique_failures": cases.get("unique_failures"),
        "errored": cases.get("errored"),
        "operations": report.get("operations"),
        "failures": [
            {
                "code": f.get("code"),
                "title": f.get("title"),
                "count": f.get("count"),
                "operations": f.get("operations"),
            }
            for f in report.get("failures", [])
        ],
        "errors": report.get("errors"),
        "exit_code": report.get("returncode"),
        "running_time_s": report.get("running_time"),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moetray bench fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=3000, help="at least this many cases in all")
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: the serve bench's tiny MoE)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kv-tokens", type=int, default=512, help="small, so any generation is short")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--logdir", type=Path, default=None)
    return p


def main(argv: list[str]) -> int:
    from moetray.engine.bench.results import write_receipt
    from moetray.engine.bench.serve import ADMIN_TOKEN, start_small_moetray

    args = parser().parse_args(argv)
    child, model, logdir = start_small_moetray(args, "fuzz")
    started = time.monotonic()
    try:
        operations = len(json.loads(_get(f"{child.url}/openapi.json"))["paths"]) or 1
        # Four phases each draw up to max_examples per operation; aim well past the target.
        per_op = max(1, math.ceil(args.examples / operations))
        report = run_schemathesis(child.url, ADMIN_TOKEN, max_examples=per_op, seed=args.seed, workdir=logdir)
        alive = child.proc.poll() is None
    finally:
        child.stop()
    results = summary(report)
    results.update(
        engine_alive_at_end=alive, wall_s=round(time.monotonic() - started, 1), per_operation=per_op
    )
    failures = sum(f["count"] or 0 for f in results["failures"])
    rows = [
        [
            results["generated"],
            results["operations"].get("tested"),
            failures,
            results["errored"],
            "yes" if alive else "no",
            results["wall_s"],
        ]
    ]
    path = write_receipt(
        "fuzz",
        params={"examples_target": args.examples, "seed": args.seed, "kv_tokens": args.kv_tokens,
                "model": str(model), "excluded_paths": list(EXCLUDED_PATHS), "checks": "all"},
        results=results,
        columns=["cases", "operations", "failures (all checks)", "errors", "engine alive", "wall s"],
        rows=rows,
        title="Fuzzing the HTTP API from its OpenAPI schema (schemathesis, every check)",
        notes=["goal: 0 failures of any check, the engine still serving at the end",
               f"excluded: {', '.join(EXCLUDED_PATHS)} (endless stream; stops the engine)"],
    )  # fmt: skip
    print(f"{results['generated']} cases, {failures} failures; receipt {path}")
    if results["generated"] is not None and results["generated"] < args.examples:
        print(f"warning: only {results['generated']} cases generated (< {args.examples})", file=sys.stderr)
    return 0 if failures == 0 and alive else 1


def _get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=30).text
