"""A real engine for the GUI tests: ``moetray serve`` as a child process on a free loopback port.

The tray only ever talks to the engine over HTTP, so the tests start it exactly as a user
(or the supervisor) would: the CLI, a tiny checkpoint, the admin token in the environment.
Also: a qasync loop that runs while pytest-qt processes events, and ``run_async`` to wait
for a coroutine without blocking Qt.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bounded import end_group

from moetray.app.supervisor import free_port
from moetray.policy import wire

ENGINE_START_TIMEOUT_S = 240.0


@dataclass
class EngineProcess:
    url: str
    token: str
    proc: subprocess.Popen
    log_path: Path
    _http: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._http = httpx.Client(base_url=self.url, timeout=30.0, trust_env=False,
                                  headers={"Authorization": f"Bearer {self.token}"})

    def get(self, route: str, **params: str) -> Any:
        reply = self._http.get(wire.route_path(route, **params))
        reply.raise_for_status()
        return reply.json()

    def status(self) -> dict:
        return self.get("status")

    def request_ids(self) -> list[str]:
        return [r["id"] for r in self.get("requests")["requests"]]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        """End the engine's whole process group (SIGTERM, then SIGKILL after 20 s)."""
        self._http.close()
        end_group(self.proc.pid, grace_s=20.0)


def engine_env(tmp: Path, token: str) -> dict[str, str]:
    env = dict(os.environ)
    env[wire.ADMIN_TOKEN_ENV] = token
    env["PYTHONUNBUFFERED"] = "1"
    # Receipts and runtime files of the engine stay inside the test's folder.
    for var, sub in (("XDG_STATE_HOME", "state"), ("XDG_RUNTIME_DIR", "run"), ("XDG_DATA_HOME", "data")):
        path = tmp / sub
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        env[var] = str(path)
    return env


def start_engine(model_dir: Path, tmp: Path, *flags: str) -> EngineProcess:
    """Start ``moetray serve`` and return once ``/health`` says serving (or raise with its log)."""
    token = secrets.token_urlsafe(16)
    port = free_port()
    log_path = tmp / "engine.log"
    argv = [sys.executable, "-m", "moetray.app.cli", "serve", "--model", str(model_dir),
            "--port", str(port), "--outbox-dir", str(tmp / "receipts"), *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=engine_env(tmp, token), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    engine = EngineProcess(f"http://127.0.0.1:{port}", token, proc, log_path)
    try:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}:\n{engine.log()[-3000:]}")
            try:
                health = httpx.get(engine.url + "/health", timeout=2.0, trust_env=False).json()
                if health.get("state") == "serving":
                    return engine
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine did not serve within {ENGINE_START_TIMEOUT_S} s:\n{engine.log()[-3000:]}")
    except BaseException:  # a failed or interrupted start leaves no engine behind
        engine.close()
        raise


class StreamingChat(threading.Thread):
    """One streaming chat completion read in a thread; records how it ended.

    It runs to ``max_tokens`` (``ignore_eos``): a random-weight model sampling at the default
    temperature can end a reply in a few tokens, before a test has clicked its Stop button.
    """

    def __init__(self, engine: EngineProcess, max_tokens: int = 400,
                 content: str = "tell me a story") -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.body = {"model": "default", "stream": True, "max_tokens": max_tokens,
                     "ignore_eos": True, "messages": [{"role": "user", "content": content}]}
        self.chunks = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None  # "cancelled" after a Stop (finish_reason is then "stop")
        self.error: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.engine.url + "/v1/chat/completions", json=self.body,
                              timeout=120.0, trust_env=False) as reply:
                if reply.status_code != 200:
                    self.error = f"HTTP {reply.status_code}: {reply.read()[:300]!r}"
                    return
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    self.chunks += 1
                    for choice in chunk.get("choices", []):
                        if choice.get("finish_reason"):
                            self.finish_reason = choice["finish_reason"]
                            self.stop_reason = choice.get("stop_reason")
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.done.set()

    def wait_ended(self, qtbot, timeout_ms: int, what: str = "the chat to end") -> None:
        """Waits (Qt processing events) until the reply has ended; a timeout says how far it got."""
        try:
            qtbot.waitUntil(self.done.is_set, timeout=timeout_ms)
        except qtbot.TimeoutError:
            raise TimeoutError(
                f"waited {timeout_ms} ms for {what}: {self.chunks} chunks read, "
                f"finish_reason {self.finish_reason!r}, error {self.error!r}; {self.engine_account()}"
            ) from None

    def engine_account(self) -> str:
        """What the engine says it finished last and the tail of its log: a chat that never ends
        must say whether the engine ended the request (its reply then stalled on the way) or not."""
        try:
            finished = self.engine.get("request_history")["requests"][:2]
        except httpx.HTTPError as exc:
            finished = [repr(exc)]
        tail = self.engine.log().splitlines()[-8:]
        return f"engine's newest finished requests {finished!r}; engine log tail {tail!r}"


def run_async(qtbot, coro: Coroutine[Any, Any, Any], timeout_ms: int = 30000) -> Any:
    """Run ``coro`` on the attached qasync loop while Qt processes events; return its result.

    Past ``timeout_ms`` the task is cancelled and ``TimeoutError`` names the coroutine."""
    what = getattr(coro, "__qualname__", repr(coro))
    task = asyncio.ensure_future(coro)
    try:
        qtbot.waitUntil(task.done, timeout=timeout_ms)
    except qtbot.TimeoutError:
        task.cancel()
        raise TimeoutError(f"waited {timeout_ms} ms for {what}") from None
    return task.result()


def pid_exists(pid: int) -> bool:
    """Whether ``pid`` is still in the process table (a zombie counts: see :func:`is_zombie`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has ended and only waits for its parent to read its status."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def private_xdg_dirs(tmp_path: Path, monkeypatch) -> None:
    """Private 0700 state, runtime and data folders, so an engine child's receipts and token files
    stay in the test's own folder."""
    for var in ("XDG_STATE_HOME", "XDG_RUNTIME_DIR", "XDG_DATA_HOME"):
        path = tmp_path / var.lower()
        path.mkdir(mode=0o700)
        monkeypatch.setenv(var, str(path))
