"""The `moetray` command: the tray by default, engine-side subcommands by name.

`moetray serve|model|models|bench …` run in a process that never loads Qt; plain `moetray` runs
the tray, which never loads torch. The engine modules are imported by name at dispatch
time, so the tray process cannot pull torch in by accident (the import-linter contracts
forbid static imports from app/ into engine/; this table is the one sanctioned crossing).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping

ENGINE_SUBCOMMANDS = {
    "serve": "moetray.engine.serve",
    "model": "moetray.engine.demo.cli",
    "models": "moetray.engine.models.cli",
    "bench": "moetray.engine.bench.cli",
}
"""Subcommand → engine module exposing ``main(argv) -> int`` (argv without the subcommand)."""


def has_display(environ: Mapping[str, str], platform: str) -> bool:
    """Whether a Qt window can open: on Linux only with an X or Wayland display (or a Qt
    platform chosen explicitly, e.g. ``offscreen``); elsewhere a desktop is assumed."""
    if not platform.startswith("linux"):
        return True
    return any(environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ENGINE_SUBCOMMANDS:
        try:
            module = importlib.import_module(ENGINE_SUBCOMMANDS[argv[0]])
        except BaseException as exc:  # a Stop while the engine's modules still import: end quietly
            from moetray.policy.wire import PARENT_PID_ENV, interrupted_by, is_a_stop

            if not is_a_stop(exc):
                raise
            print(f"moetray {argv[0]}: stopped by {interrupted_by(os.environ.get(PARENT_PID_ENV))} "
                  "before it started", file=sys.stderr)
            return 0
        return int(module.main(argv[1:]) or 0)
    from moetray.app.main import parse_args  # no Qt: argparse only

    args = parse_args(argv)  # an unknown argument or subcommand exits 2 here, never serves
    if not has_display(os.environ, sys.platform):
        # Qt would abort with a platform-plugin error. One click still means "serve the
        # default model": do that headless, exactly as `moetray serve` would.
        if args.attach:
            print("moetray: no display (DISPLAY and WAYLAND_DISPLAY are unset), so there is no "
                  "dashboard to attach; use `curl` on the engine's API instead.", file=sys.stderr)
            return 2
        print("moetray: no display (DISPLAY and WAYLAND_DISPLAY are unset), so no tray: serving "
              "the default model headless, as `moetray serve` does. Ctrl-C stops it.", file=sys.stderr)
        return main(["serve"])
    from moetray.app.main import run_tray

    return run_tray(argv)


def clear_caught_interrupt() -> None:
    """Forget a Stop that was caught and answered, so ``python -m`` exits with our code.

    CPython marks a KeyboardInterrupt that ends a *string* ``exec`` (dataclasses and namedtuple
    build their methods that way while modules import) as unhandled, even when a caller catches
    it, and under ``-m`` it then kills itself with SIGINT after a clean return (exit -2 instead of
    0: a Stop in the first second, intermittently). The flag is reset at the start of every string
    evaluation, so one empty one clears it; an interrupt nobody caught never gets here.
    """
    exec("")


if __name__ == "__main__":  # how the tray starts its engine: python -m moetray.app.cli serve
    code = main()
    clear_caught_interrupt()
    sys.exit(code)
