"""``moetray serve``: the engine process (HTTP server first, the model loads behind it).

    moetray serve [--model PATH|NAME] [--host 127.0.0.1] [--port N] [--device auto|cpu|cuda]
                  [--moe-capacity SLOTS|PCT%] [--kv-tokens N] [--state-slots N] [--budget-bytes N[K|M|G]] …

With no ``--model`` the embedded demo model is built (first run) and served. The server
comes up before the model loads, so ``GET /health`` reports load progress; the gate opens
(``serving``) or latches (``failed``) when loading ends. A non-loopback ``--host`` is refused
without an API key. The admin token comes from ``MOETRAY_ADMIN_TOKEN`` (the tray sets it) or
is generated and written 0600 to the runtime directory, whose path is logged here.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# OpenMP workers that spin-wait on and on between parallel regions steal the core the batch loop
# needs on a desktop shared with other programs (and on a busy CI box: 20-50x slower steps), so
# they sleep after a short spin (policy.step_threads.openmp_defaults: decode teams need the spin).
# This must be set before torch loads libgomp, so torch is imported lazily below. A user's own
# setting wins.
from moetray.policy.step_threads import openmp_defaults  # noqa: E402 - pure Python, no torch

MOETRAY_OPENMP = {name: value for name, value in openmp_defaults(os.environ.get("OMP_WAIT_POLICY")).items()
                  if name not in os.environ}
"""The OpenMP settings moetray set (the user set none of them): a peer the benches start
(llama.cpp) gets the user's environment without them (``engine.bench.targets.peer_env``)."""
os.environ.update(MOETRAY_OPENMP)

ONEDNN_CACHED_SHAPES = 64
"""Matmul shapes oneDNN, and ideep (torch's wrapper of it), each keep compiled with their buffers
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``; 1,024 each by default). A prefill
chunk's bfloat16 expert products met one shape per routed token count, and each shape stayed:
the F16 demo's engine held 217 MiB more in use by malloc after one 600-word prompt (RSS 1140 →
1418 MiB), 16 MiB at this bound (1223 MiB). At this bound those shapes were built again and again
(that prompt's first token 2.1 → 3.0 s, ``bench peer``), so 16-bit products now reach oneDNN at a
few row counts (``models.precision.half_linear``), which the bound holds. Set before torch first
calls oneDNN; a user's own setting wins."""
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, str(ONEDNN_CACHED_SHAPES))

from moetray.engine.api.security import (  # noqa: E402
    BindRefused,
    Credentials,
    HostPolicy,
    UnsafeTokenPath,
    api_key_from,
    check_bind,
    load_credentials,
)
from moetray.engine.lifeline import watch_parent  # noqa: E402
from moetray.policy.precision import FORMATS  # noqa: E402
from moetray.policy.wire import (  # noqa: E402
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    PARENT_PID_ENV,
    interrupted_by,
    is_a_stop,
)

if TYPE_CHECKING:
    from moetray.engine.core import Engine, EngineOptions

log = logging.getLogger("moetray.engine.serve")

DEFAULT_PORT = 8765
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"2G"``, ``"512MiB"``, ``"1073741824"`` → bytes (binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moetray serve", description="Serve a MoE checkpoint with an OpenAI API."
    )
    p.add_argument(
        "--model", default=None,
        help="a checkpoint folder, a .gguf file (or the first of a split set), or a name from "
        "`moetray models`: hf:ORG/NAME, ollama:NAME:TAG, lmstudio:PUBLISHER/FOLDER/FILE.gguf, demo "
        "(default: the embedded demo model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs an API key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (0: any free port)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the pools live")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=FORMATS,
        help="serving format: auto (the checkpoint's 16-bit dtype where this machine computes it, else "
        "float32 on the CPU), float32, bfloat16, float16, or int8 (weight-only, lossy)",
    )
    p.add_argument(
        "--moe-capacity",
        default=None,
        help="expert slots on the device: a count, or a share of all experts like '50%%'",
    )
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument(
        "--state-slots",
        type=int,
        default=None,
        help="recurrent-state slots of a hybrid model (requests running at once, plus snapshots kept "
        "for prefix reuse); refused for a model without linear-attention layers",
    )
    p.add_argument(
        "--budget-bytes",
        type=parse_bytes,
        default=None,
        help="memory the two pools may use (default: measured on CUDA, 10%% of RAM on CPU)",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument(
        "--max-batch-tokens", type=int, default=256, help="tokens per forward step (prefill chunk)"
    )
    p.add_argument("--max-requests", type=int, default=32, help="requests per batch")
    p.add_argument(
        "--prefix-cache",
        default=None,
        choices=["radix", "stock", "off"],
        help="prefix reuse: radix-decided eviction, the substrate's stock ledger, or none "
        "(default: radix when every layer is full attention, else stock)",
    )
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: the checkpoint's)")
    p.add_argument("--expert-policy", default=None, help="expert cache policy (default: the project's best)")
    p.add_argument("--link-gbps", type=float, default=None, help="throttle expert copies to this many GB/s")
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"file whose first line is the key /v1/* requires (or set {API_KEY_ENV})",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the key itself: other users can read it in `ps`; prefer --api-key-file or " + API_KEY_ENV,
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted; larger is 413 before it is read (default 8M)",
    )
    p.add_argument(
        "--allowed-host", action="append", default=[], help="extra accepted Host header (repeatable)"
    )
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        help="another name a request's 'model' may give (repeatable; the id, 'default', the folder work)",
    )
    p.add_argument(
        "--accept-any-model",
        action="store_true",
        help="serve whatever 'model' a request names (for clients that hard-code one)",
    )
    p.add_argument("--outbox-dir", type=Path, default=None, help="where stop receipts are written")
    p.add_argument(
        "--rebuild-idle-timeout",
        type=float,
        default=30.0,
        help="seconds a re-split waits for running requests",
    )
    p.add_argument("--test-hooks", action="store_true", help="enable the forced-token test hook (tests only)")
    p.add_argument(
        "--test-step-delay-ms",
        type=float,
        default=0.0,
        help="with --test-hooks: hold every batch step this long (tests only)",
    )
    p.add_argument(
        "--test-load-delay-ms",
        type=float,
        default=0.0,
        help="with --test-hooks: hold the load this long once the config is read (tests only)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="compute a decode step's experts with the grouped GEMMs, not the compiled kernel "
        "(16-bit and int8 formats on the CPU compile it at start)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads (default: torch's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def moe_capacity(spec: str | None, model_dir: Path | None) -> int | None:
    """``--moe-capacity``: a slot count, or ``N%`` of all experts (needs the config to count them)."""
    if spec is None:
        return None
    spec = spec.strip()
    if spec.endswith("%"):
        from moetray.engine.models.checkpoint import inspect_checkpoint

        if model_dir is None:
            raise SystemExit("--moe-capacity as a percentage needs --model")
        info = inspect_checkpoint(model_dir)
        return max(1, round(float(spec[:-1]) / 100.0 * info.max_moe_slots))
    return int(spec)


def options_from(args: argparse.Namespace) -> EngineOptions:
    from moetray.engine.core import EngineOptions

    return EngineOptions(
        model_dir=args.model,
        device=args.device,
        dtype=args.dtype,
        moe_capacity=moe_capacity(args.moe_capacity, args.model),
        kv_tokens=args.kv_tokens,
        state_slots=args.state_slots,
        budget_bytes=args.budget_bytes,
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_requests,
        prefix_policy=args.prefix_cache,
        top_k=args.top_k,
        expert_policy=args.expert_policy,
        link_gbps=args.link_gbps,
        compile_decode=not args.no_compile,
        outbox_dir=args.outbox_dir,
        rebuild_idle_timeout_s=args.rebuild_idle_timeout,
        model_aliases=tuple(args.model_alias),
        accept_any_model=args.accept_any_model,
        test_hooks=args.test_hooks,
        test_step_delay_s=args.test_step_delay_ms / 1000.0,
        test_load_delay_s=args.test_load_delay_ms / 1000.0,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (so port 0 yields a real free port before the server starts).

    Made with ``IPPROTO_TCP`` named: asyncio sets ``TCP_NODELAY`` on accepted connections
    only when the socket's protocol says TCP. With protocol 0, Nagle's algorithm meets the
    client's delayed ACK and every small reply (an SSE token, ``/v1/models``) waits ~40 ms.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def make_server(
    engine: Engine,
    credentials: Credentials,
    hosts: HostPolicy,
    *,
    log_level: str = "info",
    load_on_startup: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
):
    """A uvicorn server for the engine's app (call ``.run(sockets=[sock])``)."""
    import uvicorn

    from moetray.engine.api.app import build_app

    app = build_app(
        engine, credentials, hosts, load_on_startup=load_on_startup, max_body_bytes=max_body_bytes
    )
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False, timeout_keep_alive=30)
    return uvicorn.Server(config)


def forget_on_signal(credentials: Credentials) -> None:
    """Remove the token file when SIGTERM ends the process, then die of the signal as before.

    uvicorn shuts down gracefully on SIGTERM and then re-raises it under the handler that was
    installed before it started: this one (SIGINT arrives as ``KeyboardInterrupt`` instead).
    """

    def on_term(signum, frame) -> None:
        credentials.forget()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, on_term)


class HeldStop:
    """Holds a Stop (SIGINT) that lands while the engine imports and builds, and raises it once
    that is done (``release``), just before the server takes the signals over.

    Raised at once, a ``KeyboardInterrupt`` can land inside a C++→Python callback (torch and
    transformers import through pybind11), which cannot unwind it: the process aborts (exit -6)
    instead of stopping. The start-up is bounded (imports and building, no model load), so a Stop
    waits at most that long. Installed whatever SIGINT's disposition was: a background job of a
    non-interactive shell inherits it ignored, and a Stop while loading was then lost.
    """

    def __init__(self) -> None:
        self.held = False
        signal.signal(signal.SIGINT, self._hold)

    def _hold(self, signum, frame) -> None:
        self.held = True

    def release(self) -> None:
        """Give SIGINT back to Python's handler; raise the Stop that came meanwhile, if one did."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.held:
            raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tray = os.environ.get(PARENT_PID_ENV)
    stopper = interrupted_by(tray)  # under a tray, SIGINT is its Stop
    stop = HeldStop()
    watch_parent(tray)
    try:
        return _serve(args, stopper, stop)
    except BaseException as exc:  # a Stop before the server took over the signals (HeldStop.release)
        if not is_a_stop(exc):
            raise
        log.info("stopped by %s before serving", stopper)
        return 0


def _serve(args: argparse.Namespace, stopper: str, stop: HeldStop) -> int:
    if args.api_key:
        log.warning(
            "--api-key puts the key on the command line, where other users can read it (ps); "
            "use --api-key-file or %s instead",
            API_KEY_ENV,
        )
    try:
        api_key = api_key_from(flag=args.api_key, file=args.api_key_file)
        check_bind(args.host, api_key)
    except (BindRefused, OSError, ValueError) as exc:
        print(f"moetray serve: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from moetray.engine.models.checkpoint import CheckpointError
    from moetray.engine.models.names import resolve_model

    try:
        args.model = resolve_model(args.model)  # a name → the files it names, read in place
    except CheckpointError as exc:
        print(f"moetray serve: {exc} ({exc.kind})", file=sys.stderr)
        return 2
    options = options_from(args)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"moetray serve: cannot listen on {args.host}:{args.port}: {exc.strerror} "
              "(another engine there? pass --port)", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    try:
        credentials = load_credentials(api_key=api_key, port=port)
    except (UnsafeTokenPath, OSError) as exc:
        print(f"moetray serve: cannot keep the admin token safely: {exc}", file=sys.stderr)
        return 2
    try:  # the token file goes with the engine, however it ends (a Stop while it imports too)
        if credentials.token_file is not None:
            log.info("admin token written to %s (mode 0600)", credentials.token_file)
        else:
            log.info("admin token taken from the environment")
        from moetray.engine.core import Engine

        engine = Engine(options)
        server = make_server(
            engine,
            credentials,
            HostPolicy(frozenset(h.lower() for h in args.allowed_host)),
            log_level=args.log_level,
            max_body_bytes=args.max_body_bytes,
        )
        shown = f"[{args.host}]" if ":" in args.host else args.host
        log.info("moetray engine listening on http://%s:%d (model loads in the background; see /health)",
                 shown, port)
        forget_on_signal(credentials)
        stop.release()
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn already shut down gracefully, then re-raised the signal
            log.info("stopped by %s", stopper)
    finally:
        credentials.forget()
    return 0
