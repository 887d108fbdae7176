"""`moetray` (no subcommand): the tray. Bootstrap in two phases, FeelUOwn-style.

1. :func:`prepare` needs no Qt: parse and check the arguments, read the attach token,
   set up logging. A refusal is one sentence and exit code 2.
2. :func:`start_app` runs on the qasync loop: build and initialise the app, start it,
   then await one shutdown future. Every exit path sets that future, once:

   - the tray's Quit and the window's Quit button (``MoetrayApp.quit_requested``);
   - closing the window when there is no tray (the "last window" path);
   - SIGTERM and Ctrl-C (loop signal handlers);
   - the session ending (``QApplication.aboutToQuit``, which can fire more than once).

   Then :meth:`MoetrayApp.shutdown` (idempotent) stops a supervised engine with its
   receipt, and the loop ends.

One tray per user and settings file: a second launch forwards "show" to the first one
(which raises its window) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from moetray.policy import wire

APP_ID = "io.github.moetray.Moetray"


@dataclass(frozen=True)
class Prepared:
    hidden: bool
    attach: str | None
    admin_token: str | None
    no_tray: bool
    settings_file: Path | None


class PrepareRefused(Exception):
    pass


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moetray",
        description="Tray app serving Mixture-of-Experts models locally. "
                    "Subcommands: moetray serve | model | bench (run without Qt).")
    parser.add_argument("--hidden", action="store_true",
                        help="start in the tray without opening the dashboard")
    parser.add_argument("--attach", metavar="URL",
                        help="watch and control an engine that is already running at URL")
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the attached engine's admin token (else ${wire.ADMIN_TOKEN_ENV} "
                             f"or ${wire.ADMIN_TOKEN_FILE_ENV})")
    parser.add_argument("--no-tray", action="store_true",
                        help="run as a window only, even where a system tray exists")
    parser.add_argument("--settings", metavar="FILE", type=Path,
                        help="settings file to use instead of the user's (one tray per file)")
    return parser.parse_args(argv)


def _read_token(path: str) -> str:
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise PrepareRefused(f"Cannot read the admin token file {path}: {exc.strerror}.") from exc
    if not token:
        raise PrepareRefused(f"The admin token file {path} is empty.")
    return token


def prepare(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Prepared:
    """Phase one: everything that needs no Qt. Refuses with :class:`PrepareRefused`."""
    env = os.environ if environ is None else environ
    token = None
    if args.attach:
        url = urlparse(args.attach)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise PrepareRefused(f"--attach needs an http(s) URL such as http://127.0.0.1:8080, "
                                 f"not {args.attach!r}.")
        if args.token_file:
            token = _read_token(args.token_file)
        elif env.get(wire.ADMIN_TOKEN_ENV):
            token = env[wire.ADMIN_TOKEN_ENV]
        elif env.get(wire.ADMIN_TOKEN_FILE_ENV):
            token = _read_token(env[wire.ADMIN_TOKEN_FILE_ENV])
    elif args.token_file:
        raise PrepareRefused("--token-file only applies with --attach.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s moetray %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per 0.5 s health poll is noise
    return Prepared(args.hidden, args.attach, token, args.no_tray, args.settings)


async def start_app(qapp, settings, prepared: Prepared, single, sentinel: asyncio.Future[int] | None = None,
                    started: Callable[[Any], None] | None = None, early_exit: Any = None):
    """Phase two, on the running qasync loop; returns the exit code.

    ``sentinel`` (a future to await instead of a fresh one) and ``started`` (called with
    the app once it runs) let a test drive the real bootstrap.
    """
    from moetray.app import compat
    from moetray.app.application import AppOptions, MoetrayApp

    app = MoetrayApp(qapp, settings, AppOptions(hidden=prepared.hidden, attach=prepared.attach,
                                                admin_token=prepared.admin_token,
                                                no_tray=prepared.no_tray))
    app.initialize()
    loop = asyncio.get_running_loop()
    sentinel = sentinel if sentinel is not None else loop.create_future()

    def shutdown() -> None:
        if not sentinel.done():  # aboutToQuit may fire more than once
            sentinel.set_result(0)

    app.quit_requested.connect(shutdown)
    qapp.aboutToQuit.connect(shutdown)
    signals = compat.install_exit_signals(shutdown)
    if early_exit is not None and early_exit.requested:  # a signal arrived during start-up
        shutdown()
    single.message_received.connect(lambda message: app.open_dashboard() if message == "show" else None)
    await app.start()
    if started is not None:
        started(app)
    try:
        code = await sentinel
    finally:
        compat.remove_exit_signals(signals)
        await app.shutdown()
        single.close()
    return code


def run_tray(argv: list[str]) -> int:
    """The ``moetray`` entry point for the tray (``app/cli.py`` dispatches here)."""
    args = parse_args(argv)
    try:
        prepared = prepare(args)
    except PrepareRefused as refused:
        print(f"moetray: {refused}", file=sys.stderr)
        return 2
    from moetray.app import compat

    early_exit = compat.EarlyExit()
    from PySide6.QtWidgets import QApplication

    from moetray.app.settings import Settings
    from moetray.app.single_instance import SHOW, SingleInstance, server_name
    from moetray.ui.icons import app_icon

    existing = QApplication.instance()
    qapp = existing if isinstance(existing, QApplication) else QApplication(sys.argv[:1])
    qapp.setApplicationName("moetray")
    qapp.setOrganizationName("moetray")
    qapp.setDesktopFileName(APP_ID)
    qapp.setWindowIcon(app_icon())
    compat.prepare_qt(qapp)
    settings = Settings.at(prepared.settings_file) if prepared.settings_file else Settings()
    single = SingleInstance(server_name(settings.path))
    if single.forward(SHOW):
        print("moetray is already running: its dashboard was raised.", file=sys.stderr)
        return 0
    if not single.listen():
        print("moetray: could not claim the single-instance socket; continuing without it.",
              file=sys.stderr)
    return compat.run(qapp, lambda: start_app(qapp, settings, prepared, single, early_exit=early_exit))
