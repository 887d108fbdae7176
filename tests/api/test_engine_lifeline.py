"""The engine's life is tied to its tray's: it ends when the tray is killed, and a Stop while it
loads ends it cleanly, logged as the tray's Stop (real ``moetray serve`` children)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bounded import COLD_START_S

from moetray.policy import wire

# A stand-in tray: starts the engine as the supervisor does (its own session, told its
# parent), prints the engine's pid, then waits to be killed.
FAKE_TRAY = f"""
import os, subprocess, sys, time
env = dict(os.environ)
env[{wire.PARENT_PID_ENV!r}] = str(os.getpid())
engine = subprocess.Popen(sys.argv[1:], env=env, stdout=open(os.environ["ENGINE_LOG"], "wb"),
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
print(engine.pid, flush=True)
time.sleep(600)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _engine_argv(model: Path, tmp_path: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "moetray.app.cli", "serve", "--model", str(model), "--port", str(port),
            "--budget-bytes", "256M", "--kv-tokens", "1024", "--threads", "1",
            "--outbox-dir", str(tmp_path / "out")]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETRAY_")}
    (tmp_path / "run").mkdir(mode=0o700, exist_ok=True)
    env.update(XDG_RUNTIME_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1",
               ENGINE_LOG=str(tmp_path / "engine.log"))
    return env


def test_an_engine_ends_when_its_tray_is_killed(tiny_qwen3, tmp_path):
    port = free_port()
    tray = subprocess.Popen([sys.executable, "-c", FAKE_TRAY, *_engine_argv(tiny_qwen3, tmp_path, port)],
                            env=_env(tmp_path), stdout=subprocess.PIPE, text=True)
    engine_pid = int(tray.stdout.readline())
    log = tmp_path / "engine.log"
    try:
        deadline = time.monotonic() + COLD_START_S
        while True:  # serving: the case where a dead tray's engine held memory for 30 minutes
            assert _alive(engine_pid), log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the engine never served"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).json()[
                        "state"] == "serving":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        tray.kill()  # no clean exit: no Stop, no prepare-stop
        tray.wait(10)
        deadline = time.monotonic() + 60
        while _alive(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its tray"
            time.sleep(0.1)
        text = log.read_text()
        # It stopped the graceful way (the kernel's SIGTERM, or the watch's when that came first).
        assert "Application shutdown complete" in text, text[-3000:]
    finally:
        if tray.poll() is None:
            tray.kill()
        if _alive(engine_pid):
            os.killpg(engine_pid, signal.SIGKILL)


def _stopped_while_loading(model: Path, tmp_path: Path, after_s: float, **popen) -> tuple[int, str]:
    """Start an engine as a tray's child, send its Stop (SIGINT) after ``after_s``; its exit code and
    output (it must end within 120 s)."""
    env = _env(tmp_path)
    env[wire.PARENT_PID_ENV] = str(os.getpid())
    engine = subprocess.Popen(_engine_argv(model, tmp_path, free_port()), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, **popen)
    try:
        time.sleep(after_s)
        engine.send_signal(signal.SIGINT)
        out, _ = engine.communicate(timeout=120)
    finally:
        if engine.poll() is None:
            engine.kill()
    return engine.returncode, out


def test_a_stop_while_the_engine_loads_ends_cleanly_as_the_trays_stop(tiny_qwen3, tmp_path):
    # 0.5 s: still importing torch, the moment a Stop used to print a traceback
    returncode, out = _stopped_while_loading(tiny_qwen3, tmp_path, 0.5)
    assert returncode == 0, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert f"stopped by the tray (pid {os.getpid()})" in out


def test_a_stop_reaches_an_engine_started_with_sigint_ignored(tiny_qwen3, tmp_path):
    """A tray started as a background job of a non-interactive shell passes SIGINT on as ignored,
    and Python keeps it so: the engine listens anyway. Prevents: a Stop during the load lost, the
    engine loading and serving on (found by a fresh-clone CI run started with ``&``)."""
    # 2 s: past the engine's own start-up code, still loading
    returncode, out = _stopped_while_loading(
        tiny_qwen3, tmp_path, 2.0, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert returncode == 0, out[-3000:]
    assert f"stopped by the tray (pid {os.getpid()})" in out
    # A token file written before the Stop goes with the engine, however far it got.
    assert not list((tmp_path / "run").rglob("*.token")), out[-3000:]


def test_a_stop_caught_in_a_string_exec_still_exits_with_the_engines_code(tmp_path):
    """CPython (``-m``) marks a KeyboardInterrupt that ended a string ``exec`` as unhandled even when
    caught, and then dies of SIGINT after a clean return; ``clear_caught_interrupt`` (called by the
    CLI's ``__main__``) forgets it. Prevents: a Stop in the engine's first second exiting -2 (seen
    intermittently: a SIGINT landing while dataclasses build their methods)."""
    (tmp_path / "stopped_in_exec.py").write_text(
        "import sys\n"
        "try:\n"
        "    exec('raise KeyboardInterrupt')  # how a Stop lands inside a dataclass being built\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "if sys.argv[1:] == ['clear']:\n"
        "    from moetray.app.cli import clear_caught_interrupt\n"
        "    clear_caught_interrupt()\n"
        "sys.exit(0)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    cleared = subprocess.run([sys.executable, "-m", "stopped_in_exec", "clear"], env=env, timeout=120)
    assert cleared.returncode == 0
    kept = subprocess.run([sys.executable, "-m", "stopped_in_exec"], env=env, timeout=120)
    assert kept.returncode == -signal.SIGINT  # the quirk itself, so the test above can fail


def _stop_in_a_class_body(*_args: object) -> None:
    """A Stop landing in a class body's ``__set_name__`` while a module imports, as Python raises
    it (a ``RuntimeError`` whose cause is the interrupt)."""

    class Descriptor:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    class Owner:  # noqa: F841 - defining it is the point
        attr = Descriptor()


def test_a_stop_wrapped_while_a_module_imports_ends_the_engine_quietly(monkeypatch):
    """A Stop that lands in a class body's ``__set_name__`` reaches ``serve.main`` as a
    RuntimeError caused by the interrupt (a fresh-clone CI run: a transformers module importing
    at the moment of the Stop): it ends the engine with 0 like any Stop before serving; a real
    error still propagates. Prevents: a Stop reported as a crash."""
    from moetray.engine import serve

    def failing(*_args):
        raise RuntimeError("a real failure")

    monkeypatch.delenv(wire.PARENT_PID_ENV, raising=False)
    previous = signal.getsignal(signal.SIGINT)
    try:
        monkeypatch.setattr(serve, "_serve", _stop_in_a_class_body)
        assert serve.main([]) == 0
        monkeypatch.setattr(serve, "_serve", failing)
        try:
            serve.main([])
        except RuntimeError as exc:
            assert str(exc) == "a real failure"
        else:
            raise AssertionError("a real failure was swallowed as a Stop")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_stop_during_start_up_is_held_until_the_server_takes_over(monkeypatch):
    """A Stop while the engine imports and builds is held, then raised where the server would take
    the signals over: the engine ends with 0, having run on to that point. Prevents: the interrupt
    raised inside a pybind11 callback while torch imports, and the engine aborting (exit -6: seen
    once in a fresh-clone CI run of the test above that stops it at 0.5 s)."""
    from moetray.engine import serve

    reached: list[str] = []

    def starting(args, stopper, stop):
        signal.raise_signal(signal.SIGINT)  # the Stop, as torch imports
        reached.append("built")  # raised at once, it would have unwound from the line above
        stop.release()
        reached.append("served")

    monkeypatch.delenv(wire.PARENT_PID_ENV, raising=False)
    previous = signal.getsignal(signal.SIGINT)
    try:
        monkeypatch.setattr(serve, "_serve", starting)
        assert serve.main([]) == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["built"]


def test_a_stop_wrapped_while_the_engine_module_imports_ends_the_cli_quietly(monkeypatch, capsys):
    """The same Stop one step earlier, while ``moetray serve``'s own module imports: the CLI ends
    with 0 and says who stopped it. Prevents: a Stop reported as a crash."""
    from moetray.app import cli

    monkeypatch.delenv(wire.PARENT_PID_ENV, raising=False)
    monkeypatch.setattr(cli.importlib, "import_module", _stop_in_a_class_body)
    assert cli.main(["serve"]) == 0
    assert "stopped by Ctrl-C before it started" in capsys.readouterr().err
