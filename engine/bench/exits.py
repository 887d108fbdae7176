"""How a benchmark's child process ended, by name (a peer server, a llama.cpp child), for the error
that reports it: the exit code, or the signal that killed it with its likely cause."""

from __future__ import annotations

import signal

AMX_FREE_BUILD = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
                  "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF' "
                  "pip install --force-reinstall --no-deps --no-cache-dir 'llama-cpp-python[server]'")
"""A llama-cpp-python build without ggml's AMX kernels. A native build on a CPU that lists AMX compiles
them in, and a virtual machine that does not grant the AMX tile state kills the process with SIGILL at
its first multi-token batch (seen on this project's 2-core CI machine: loading and one-token prompts
worked, a prompt of a dozen words died at ``tilezero``)."""


def exit_reason(returncode: int) -> str:
    """A child's exit status by name: ``exit code N``, or the signal that killed it; for SIGILL, the
    likely cause and the rebuild that avoids it (:data:`AMX_FREE_BUILD`)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"killed by signal {-returncode}"
    if name == "SIGILL":
        return (f"killed by {name}: an instruction this CPU or VM refuses (a native llama.cpp build "
                f"with AMX kernels on a VM without AMX state, for one); rebuild with {AMX_FREE_BUILD}")
    return f"killed by {name}"
