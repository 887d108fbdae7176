"""`moetray bench NAME [ARGS]`: benchmarks, each a module imported only when chosen.

Every benchmark module exposes ``main(argv) -> int`` and writes its JSON receipt through
:mod:`moetray.engine.bench.results`; `moetray bench tables` regenerates the tables.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "bw": "moetray.engine.bench.bw",  # host↔device and CPU bandwidth profile
    "trace": "moetray.engine.bench.trace",  # cache policies against Belady on routing traces
    "engine": "moetray.engine.bench.offload",  # offloading engine vs resident vs accelerate (--formats)
    "peer": "moetray.engine.bench.peer",  # the same GGUF served by llama.cpp and by moetray
    "batch": "moetray.engine.bench.batch",  # batched decode: the experts runtime vs stock implementations
    "gemv": "moetray.engine.bench.gemv",  # decode's int8 products per weight against the read bandwidth
    "decode": "moetray.engine.bench.decode",  # served decode per format: tok/s, bytes/token, bound, steps
    "serve": "moetray.engine.bench.serve",  # HTTP serving vs `transformers serve`
    "demo": "moetray.engine.bench.demo_quality",  # demo model perplexity and chat answers
    "radix_cost": "moetray.engine.bench.radix_cost",  # radix verbs' cost as the tree grows
    "ui": "moetray.engine.bench.ui",  # the tray process's RSS and CPU, measured from outside
    "fuzz": "moetray.engine.bench.fuzz",  # schemathesis against the OpenAPI schema, every check
    "soak": "moetray.engine.bench.soak",  # streams with disconnects and re-splits for minutes: RSS drift
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: moetray bench {" + ",".join([*BENCHMARKS, "tables"]) + "} [ARGS]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "tables":
        from moetray.engine.bench.results import write_tables

        print(write_tables())
        return 0
    if name not in BENCHMARKS:
        print(f"moetray bench: unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[name]).main(rest) or 0)
