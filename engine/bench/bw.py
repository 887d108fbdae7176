"""`moetray bench bw`: this machine's link and CPU expert bandwidth, saved as its profile.

Measures, for one expert geometry (default: a Qwen3-30B-A3B expert, H=2048, I=768, bf16):

- **link**: expert rows copied host → device through the engine's own slot-pool write path
  (:class:`moetray.engine.experts.slots.SlotPool`), from pinned and from pageable host
  memory. On a machine without a GPU the "device" is host memory and the copy is a memcpy;
  the profile then says so (``link_label``) and never calls it PCIe;
- **cpu**: a batch-1 expert forward (gate_up GEMV, SiLU gate, down GEMV) computed on the CPU
  from host memory, as bytes of weights read per second; the experts rotate through a window
  larger than the last-level cache so the figure is DRAM-bound, as in decode;
- **overlapped**: both at once from a common start for the same duration (they share DRAM),
  the pair the q* split prefers.

Writes the device's profile with :func:`moetray.policy.moe.bench_profile.save_profile` (the
engine reads it at load to choose offload or hybrid and the q* fraction) and a receipt with
:mod:`moetray.engine.bench.results`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F

from moetray.engine.bench.results import receipt_name, write_receipt
from moetray.engine.experts.hybrid import cache_directory, device_identity
from moetray.engine.experts.slots import SlotPool
from moetray.policy.moe.bench_profile import BandwidthProfile, save_profile
from moetray.policy.moe.qstar import recommend_backend

GB = 1e9


def _progress(msg: str) -> None:
    print(f"[bench bw] {msg}", file=sys.stderr, flush=True)


def _bank(experts: int, hidden: int, inter: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    row = 3 * hidden * inter
    bank = torch.empty((experts, row), dtype=dtype, pin_memory=pinned)
    bank.normal_(0, 0.02)
    return bank


def measure_link(device: torch.device, bank: torch.Tensor, seconds: float, slots: int = 8,
                 stop: threading.Event | None = None) -> dict[str, float]:
    """Copy rows of ``bank`` into a slot pool on ``device`` for ``seconds``; GB/s and per-copy µs."""
    pool = SlotPool(slots, bank.shape[1], bank.dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(min(slots, bank.shape[0])):  # warm-up
        pool.write(i, bank[i])
    sync()
    copies, start = 0, time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
        for _ in range(16):
            pool.write(copies % slots, bank[copies % bank.shape[0]])
            copies += 1
        sync()
    elapsed = time.perf_counter() - start
    return {"gbs": copies * pool.row_bytes / elapsed / GB, "copy_us": elapsed / copies * 1e6,
            "copies": copies}


def measure_cpu(bank: torch.Tensor, hidden: int, inter: int, seconds: float,
                stop: threading.Event | None = None) -> dict[str, float]:
    """Batch-1 expert forwards on the CPU from ``bank`` for ``seconds``: weight bytes read per second."""
    x = torch.randn(1, hidden, dtype=bank.dtype)
    times: list[float] = []
    start = time.perf_counter()
    deadline = start + seconds
    i = 0
    with torch.no_grad():
        while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
            row = bank[i % bank.shape[0]]
            t0 = time.perf_counter()
            gate_up = row[: 2 * inter * hidden].view(2 * inter, hidden)
            down = row[2 * inter * hidden:].view(hidden, inter)
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, down)
            times.append(time.perf_counter() - t0)
            i += 1
    row_bytes = bank.shape[1] * bank.element_size()
    median = statistics.median(times)
    return {"gbs": row_bytes / median / GB, "expert_ms": median * 1e3, "experts": len(times),
            "mean_gbs": row_bytes * len(times) / (time.perf_counter() - start) / GB}


def measure_overlapped(device: torch.device, link_bank: torch.Tensor, cpu_bank: torch.Tensor, hidden: int,
                       inter: int, seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """Link copies and CPU expert forwards running at the same time, from a common barrier."""
    barrier = threading.Barrier(2)
    out: dict[str, dict[str, float]] = {}

    def run_link():
        barrier.wait()
        out["link"] = measure_link(device, link_bank, seconds)

    thread = threading.Thread(target=run_link)
    thread.start()
    barrier.wait()
    cpu = measure_cpu(cpu_bank, hidden, inter, seconds)
    thread.join()
    # Under contention the CPU figure is the achieved mean rate, not the best-case median.
    return out["link"], {**cpu, "gbs": cpu["mean_gbs"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moetray bench bw", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--window-mb", type=int, default=256,
                        help="host bank the measurements rotate through (exceed the last-level cache)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    parser.add_argument("--profile-dir", default=None, help="default: $MOETRAY_CACHE_DIR or the user cache")
    parser.add_argument("--receipt", default=None, type=receipt_name,
                        help="receipt name (default: bw or bw-cuda)")
    parser.add_argument("--no-profile", action="store_true", help="measure and report only")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, args.dtype)
    row_bytes = 3 * args.hidden * args.inter * dtype.itemsize
    experts = max(4, args.window_mb * 2**20 // row_bytes)
    cuda = device.type == "cuda"
    link_label = (f"pinned host→device copies ({torch.cuda.get_device_name(device)})" if cuda
                  else "memcpy into host-memory slots (CPU device tier, no GPU link)")
    _progress(f"device {device} ({'GPU' if cuda else 'no GPU: the device tier is host RAM'}); "
              f"expert {row_bytes / 2**20:.2f} MiB {args.dtype}, window {experts} experts, "
              f"{torch.get_num_threads()} CPU threads")

    _progress("1/4 filling host banks")
    pinned_bank = _bank(experts, args.hidden, args.inter, dtype, pinned=cuda)
    cpu_bank = _bank(experts, args.hidden, args.inter, dtype, pinned=False)
    _progress("2/4 link: " + ("pinned and pageable host→device" if cuda else "host memcpy"))
    link = measure_link(device, pinned_bank, args.seconds)
    pageable = measure_link(device, cpu_bank, args.seconds) if cuda else None
    _progress(f"    link {link['gbs']:.2f} GB/s ({link['copy_us']:.0f} µs per expert)"
              + (f", pageable {pageable['gbs']:.2f} GB/s" if pageable else ""))
    _progress("3/4 CPU expert forward (batch 1)")
    cpu = measure_cpu(cpu_bank, args.hidden, args.inter, args.seconds)
    _progress(f"    cpu {cpu['gbs']:.2f} GB/s ({cpu['expert_ms']:.3f} ms per expert)")
    _progress("4/4 both at once")
    link_ov, cpu_ov = measure_overlapped(device, pinned_bank, cpu_bank, args.hidden, args.inter, args.seconds)
    _progress(f"    overlapped: link {link_ov['gbs']:.2f} GB/s, cpu {cpu_ov['gbs']:.2f} GB/s")

    profile = BandwidthProfile(device=device_identity(device), link_gbs=link["gbs"], cpu_gbs=cpu["gbs"],
                               link_overlap_gbs=link_ov["gbs"], cpu_overlap_gbs=cpu_ov["gbs"],
                               expert_bytes=row_bytes, measured_unix=int(time.time()), link_label=link_label)
    path = None
    if not args.no_profile:
        path = save_profile(args.profile_dir or cache_directory(), profile)
        _progress(f"profile written: {path}")
    standalone_backend = recommend_backend(cpu["gbs"], link["gbs"], profile.threshold)
    results: dict[str, Any] = {
        "device": {"kind": profile.device.kind, "name": profile.device.name, "uuid": profile.device.uuid},
        "link_label": link_label, "link": link, "link_pageable": pageable, "cpu": cpu,
        "link_overlapped": link_ov, "cpu_overlapped": cpu_ov,
        "backend": profile.backend, "backend_standalone": standalone_backend,
        "fetch_fraction": profile.fetch_fraction, "profile_path": path,
    }
    rows: list[list[Any]] = [
        ["link (" + ("pinned H2D" if cuda else "memcpy") + ")", link["gbs"], link_ov["gbs"]],
        ["link pageable H2D", pageable["gbs"] if pageable else None, None],
        ["CPU expert forward", cpu["gbs"], cpu_ov["gbs"]]]
    receipt = write_receipt(
        args.receipt or ("bw-cuda" if cuda else "bw"),
        params={"hidden": args.hidden, "inter": args.inter, "dtype": args.dtype, "window_experts": experts,
                "expert_bytes": row_bytes, "seconds": args.seconds, "threads": torch.get_num_threads()},
        results=results, columns=["path", "GB/s alone", "GB/s overlapped"], rows=rows,
        title=f"Bandwidth profile ({'GPU' if cuda else 'CPU device tier'})",
        notes=[f"link: {link_label}",
               f"backend chosen from the overlapped pair: {profile.backend}; q* fetch fraction "
               f"{profile.fetch_fraction:.3f}" if profile.fetch_fraction is not None else
               f"backend: {profile.backend}",
               "reproduce: `" + " ".join([".venv/bin/moetray bench bw", *argv]) + "`"])
    _progress(f"receipt: {receipt}")
    print(f"backend {profile.backend}, fetch fraction {profile.fetch_fraction}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
