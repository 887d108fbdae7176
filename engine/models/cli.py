"""``moetray models [--json] [--recent PATH …]``: the models already on this machine.

Lists the Hugging Face hub cache, LM Studio, Ollama, the recent folders (the tray passes its own
with ``--recent``) and the demo, without downloading or reading any tensor. ``--json`` prints a
list of ``policy.wire.LocalModel`` objects (what the tray's Model menu reads); the plain form is a
table. Any listed ``name`` can be served: ``moetray serve --model NAME``.
"""

from __future__ import annotations

import argparse
import json
import sys

from moetray.engine.models.discovery import list_models


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return "?"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="moetray models", description="List the models already on this machine."
    )
    parser.add_argument("--json", action="store_true", help="print policy.wire.LocalModel objects as JSON")
    parser.add_argument("--recent", action="append", default=[], help="a recent folder or file to include")
    args = parser.parse_args(argv)
    rows = list_models(recent=args.recent)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        status = "servable" if r["servable"] else f"refused: {r['refusal']}"
        print(
            f"{r['name']:<{width}}  {r['source']:<11} {r['format']:<11} {r['family'] or '?':<12} "
            f"{_size(r['bytes']):>10}  {status}"
        )
    return 0
