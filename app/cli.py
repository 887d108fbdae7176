"""The `moetray` command: the tray by default, engine-side subcommands by name.

`moetray serve|model|bench …` run in a process that never loads Qt; plain `moetray` runs
the tray, which never loads torch. The engine modules are imported by name at dispatch
time, so the tray process cannot pull torch in by accident (the import-linter contracts
forbid static imports from app/ into engine/; this table is the one sanctioned crossing).
"""

from __future__ import annotations

import importlib
import sys

ENGINE_SUBCOMMANDS = {
    "serve": "moetray.engine.serve",
    "model": "moetray.engine.demo.cli",
    "bench": "moetray.engine.bench.cli",
}
"""Subcommand → engine module exposing ``main(argv) -> int`` (argv without the subcommand)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ENGINE_SUBCOMMANDS:
        module = importlib.import_module(ENGINE_SUBCOMMANDS[argv[0]])
        return int(module.main(argv[1:]) or 0)
    from moetray.app.main import run_tray

    return run_tray(argv)


if __name__ == "__main__":
    sys.exit(main())
