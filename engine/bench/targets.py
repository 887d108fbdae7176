"""What `moetray bench decode` measures: in-process engines behind real HTTP servers, llama.cpp's
server as a child process, and the load generator that drives both (its own process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetray.engine.bench.exits import exit_reason

if TYPE_CHECKING:
    from moetray.engine.bench.breakdown import StepBreakdown
    from moetray.engine.load import ServedModel


def progress(msg: str) -> None:
    print(f"[bench decode] {msg}", file=sys.stderr, flush=True)


# --- one served engine --------------------------------------------------------------------------


def peer_env(**extra: str) -> dict[str, str]:
    """The environment a peer server (llama.cpp) starts with: the user's, without the OpenMP waits
    moetray set for itself (llama.cpp's OpenMP build decoded 5x slower under passive waits on 2
    cores: 12.6 against 67 tok/s, which made every earlier comparison flatter moetray), plus
    ``extra``."""
    from moetray.engine import serve as engine_serve

    env = {name: value for name, value in os.environ.items() if name not in engine_serve.MOETRAY_OPENMP}
    env.update(extra)
    return env


class ServedEngine:
    """An engine for one weight format behind a real HTTP server on loopback, in this process.

    Built as ``moetray serve`` builds it (``Engine`` + the FastAPI app under uvicorn), the
    server on its own thread so the bench can read the engine's insides while it serves.
    """

    def __init__(self, model_dir: Path | None, fmt: str, *, kv_tokens: int, max_requests: int,
                 compile_decode: bool = True) -> None:
        from moetray.engine.api.security import Credentials, HostPolicy
        from moetray.engine.core import Engine, EngineOptions
        from moetray.engine.serve import bind_socket, make_server

        self.format = fmt
        opts = EngineOptions(model_dir=model_dir, dtype=fmt, kv_tokens=kv_tokens, budget_bytes=4 << 30,
                             max_requests_per_batch=max_requests, compile_decode=compile_decode)
        self.engine = Engine(opts)
        self.engine.options.moe_capacity = None
        server = make_server(self.engine, Credentials(admin_token="bench", api_key=None, token_file=None),
                             HostPolicy(frozenset()), log_level="warning")
        self.server = server
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.loop_thread: int | None = None

        def serve() -> None:
            self.loop_thread = threading.get_native_id()
            server.run(sockets=[sock])

        self.thread = threading.Thread(target=serve, name=f"bench-http-{fmt}", daemon=True)
        self.thread.start()
        self.breakdown: StepBreakdown | None = None  # install_breakdown() sets it

    def wait_serving(self, timeout: float = 900.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{self.url}/health", timeout=5.0).json()
            except httpx.HTTPError:
                health = {}
            if health.get("state") == "serving":
                break
            if health.get("state") == "failed":
                raise RuntimeError(f"{self.format} engine failed to load: {health.get('error')}")
            time.sleep(0.2)
        else:
            raise TimeoutError(f"{self.format} engine not serving after {timeout:.0f}s")
        runtime = self.served_model().loaded.runtime
        every = runtime.num_layers * runtime.num_experts
        if runtime.capacity < every:
            runner = self.engine.pools.runner if self.engine.pools is not None else None
            if runner is None:
                raise RuntimeError(f"{self.format} engine serves without a batch runner")
            with runner.paused():
                runtime.resize(every)

    def served_model(self) -> ServedModel:
        """The model the engine serves (loaded once :meth:`wait_serving` has returned)."""
        served = self.engine.served
        if served is None:
            raise RuntimeError(f"{self.format} engine has not loaded its model")
        return served

    def model_id(self) -> str:
        return self.served_model().model_id

    def model_info(self) -> dict[str, Any]:
        """``policy.wire.ModelInfo`` of the served model."""
        info = self.engine.model_info()
        if info is None:
            raise RuntimeError(f"{self.format} engine has not loaded its model")
        return info

    def team_steps(self) -> tuple[int, int] | None:
        """(decode steps on the whole thread budget, on one thread) so far; None where decode steps
        keep their thread count (no one-thread rule: float32, --no-compile)."""
        pools = self.engine.pools
        team = None if pools is None or pools.runner is None else pools.runner.decode_team
        return None if team is None else (team.team_steps, team.one_thread_steps)

    def install_breakdown(self):
        from moetray.engine.bench.breakdown import StepBreakdown

        processor = self.engine.pools.runner.manager.batch_processor
        loaded = self.engine.served.loaded
        self.breakdown = StepBreakdown(loaded.model, loaded.runtime, processor).install()
        return self.breakdown

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


class LlamaServer:
    """llama.cpp's OpenAI-compatible server (llama-cpp-python's ``llama_cpp.server``) on one GGUF
    file, as a child process in its own session: the engine a user would otherwise run. It
    decodes one sequence at a time, so concurrent requests queue behind one another."""

    def __init__(self, label: str, gguf: Path, *, threads: int, ctx: int = 4096) -> None:
        from moetray.engine.bench.serve import Child, free_port

        port = free_port()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", label,
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
               "--host", "127.0.0.1", "--port", str(port), "--verbose", "False",
               "--interrupt_requests", "False"]  # queue concurrent requests (its default drops the older)
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"moetray-bench-llama-{port}.log"
        env = peer_env(OMP_NUM_THREADS=str(threads))
        self.child = Child(f"llama.cpp[{label}]", cmd, port, env, log)
        self.label, self.url, self.model, self.proc = label, self.child.url, label, self.child.proc

    def as_target(self, eos_ids: tuple[int, ...]) -> dict[str, Any]:
        """The round's target: llama.cpp's server has no ``ignore_eos``; a -100 bias on the end
        tokens keeps its replies at ``max_tokens`` as moetray's are."""
        return {"label": self.label, "url": self.url, "model": self.model, "server": self,
                "extra": {"ignore_eos": None, "logit_bias": {str(t): -100.0 for t in eos_ids}}}

    def wait_ready(self, timeout: float = 300.0) -> None:
        self.child.wait_ready(lambda r: r.status_code == 200, timeout, path="/v1/models")

    def rss_bytes(self) -> int | None:
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return None

    def stop(self) -> None:
        self.child.stop()


def run_client(url: str, model: str, *, concurrency: int, max_tokens: int, tag: str,
               extra: dict[str, Any] | None = None, warm_up: bool = True,
               server: subprocess.Popen | None = None) -> dict[str, Any]:
    """One round of :mod:`moetray.engine.bench.loadgen` in its own process; its JSON result. Where the
    round fails because ``server`` (a peer's process) died, the error says how it died."""
    cmd = [sys.executable, "-m", "moetray.engine.bench.loadgen", "--url", url, "--model", model,
           "--concurrency", str(concurrency), "--requests", str(concurrency), "--max-tokens", str(max_tokens),
           "--tag", tag, "--extra-json", json.dumps(extra or {})] + ([] if warm_up else ["--no-warm-up"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"the server died during the round ({exit_reason(server.returncode)})")
        raise RuntimeError(f"load generator failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_file(spec: str) -> tuple[str, Path]:
    label, _, path = spec.partition("=")
    return (label, Path(path)) if path else (f"llama.cpp {Path(label).stem}", Path(label))


def demo_llama_files(model_dir: Path) -> list[tuple[str, Path]]:
    """The demo exported as F16 and Q8_0 GGUF (cached), for llama.cpp; none (with a message) where
    llama-cpp-python's server or the exporter is missing."""
    try:
        import llama_cpp.server.app  # noqa: F401

        from moetray.engine.models.gguf_export import export_gguf
    except ImportError as exc:
        progress(f"no llama.cpp peer: {exc} (pip install 'llama-cpp-python[server]')")
        return []
    import platformdirs

    out = platformdirs.user_cache_path("moetray") / "bench" / "demo-gguf"
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for qtype in ("F16", "Q8_0"):
        dest = out / f"demo-{qtype}.gguf"
        if not dest.exists():
            progress(f"exporting the demo as {qtype} GGUF")
            tmp = dest.with_suffix(".partial.gguf")
            export_gguf(model_dir, tmp, qtype, output_weight=True, gate_floor=1e-30)
            tmp.rename(dest)
        files.append((f"llama.cpp {qtype}", dest))
    return files
