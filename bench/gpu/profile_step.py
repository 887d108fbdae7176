"""Where a served decode step's time goes on a GPU: the demo's twin (``bench peer --twin``) in an
in-process engine on ``$DEV`` (default cuda), ``torch.profiler`` over 20 decode steps on the generation
thread, and the step time with and without the profiler. Run from the repository root on the lent
machine after ``bench/gpu/run.sh``'s set-up lines. ``profile-cudnn-attention.txt`` predates
``engine/load.py``'s CUDA attention rule (``keep_decode_attention_planless``);
``profile-no-cudnn-attention.txt`` was taken with cuDNN attention off.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import httpx
from torch.profiler import ProfilerActivity, profile

import moetray.engine.core as core
from moetray.engine.bench import peer
from moetray.engine.bench.targets import ServedEngine

UNTIMED, TIMED, PROFILED = 15, 20, 20
"""Decode steps left alone first, then timed without the profiler, then profiled."""


def main() -> None:
    device = os.environ.get("DEV", "cuda")
    core.EngineOptions = functools.partial(core.EngineOptions, device=device)  # type: ignore[misc]
    args = peer.parser().parse_args(["--twin", ".devcarry/demo-shape", "--types", "F16"])
    [(_, gguf)] = peer._files(args, Path("/tmp/peer"))
    eng = ServedEngine(gguf, "bfloat16", kv_tokens=8192, max_requests=4)
    eng.wait_serving(300)
    assert eng.engine.pools is not None
    proc = eng.engine.pools.runner.manager.batch_processor
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=acts)
    marks: list[float] = []
    step = proc.prepare_next_batch

    def counted(*a, **k):  # noqa: ANN002, ANN003 - the substrate's signature
        n = len(marks)
        marks.append(time.perf_counter())
        if n == UNTIMED + TIMED:
            prof.__enter__()
        elif n == UNTIMED + TIMED + PROFILED:
            prof.__exit__(None, None, None)
        return step(*a, **k)

    proc.prepare_next_batch = counted
    body = {"model": "default", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 80,
            "temperature": 0}
    reply = httpx.post(f"{eng.url}/v1/chat/completions", json=body, timeout=300).json()
    a, b, c = (marks[UNTIMED + i] for i in (0, TIMED, TIMED + PROFILED))
    print("usage", reply.get("usage"))
    print(f"ms/step unprofiled {(b - a) / TIMED * 1e3:.1f}, profiled {(c - b) / PROFILED * 1e3:.1f}")
    runtime = eng.served_model().loaded.runtime
    print("experts:", runtime.decode_kernel, runtime.decode_kernel_reason)
    averages = prof.key_averages()
    print(averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    os._exit(0)  # the engine's threads are daemons of an in-process server: no orderly stop needed


if __name__ == "__main__":
    main()
