"""The `moetray` command: the tray by default, engine-side subcommands by name.

`moetray serve|model|bench …` run in a process that never loads Qt; plain `moetray` runs
the tray, which never loads torch. The engine modules are imported by name at dispatch
time, so the tray process cannot pull torch in by accident (the import-linter contracts
forbid static imports from app/ into engine/; this table is the one sanctioned crossing).
"""

from __future__ import annotations

import argparse
import importlib
import sys

ENGINE_SUBCOMMANDS = {
    "serve": "moetray.engine.serve",
    "model": "moetray.engine.demo.cli",
    "bench": "moetray.engine.bench.cli",
}
"""Subcommand → engine module exposing ``add_arguments(parser)`` and ``run(args) -> int``."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ENGINE_SUBCOMMANDS:
        module = importlib.import_module(ENGINE_SUBCOMMANDS[argv[0]])
        parser = argparse.ArgumentParser(prog=f"moetray {argv[0]}")
        module.add_arguments(parser)
        return int(module.run(parser.parse_args(argv[1:])) or 0)
    from moetray.app.main import run_tray

    return run_tray(argv)


if __name__ == "__main__":
    sys.exit(main())
