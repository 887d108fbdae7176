"""The int8 and 16-bit products of a decode step's few rows: each weight row read once for all of them.

A step of a few requests multiplies every int8 matrix by a few activation rows. torch's weight-only
int8 kernel (``_weight_int8pack_mm``) and inductor's generated loop both keep one float32
accumulator per output, so each 576-weight row is a chain of dependent adds, and a second row
costs as much as the first. No library kernel on this machine does better (torch's ``_int_mm``,
oneDNN's quantized linear and inductor's C++ GEMM template were measured at 6-8 GB/s), so the
kernel is this module's: ``few_rows.cpp``, the weight row loaded once for every activation row,
the scale applied and the result rounded to bfloat16 once, as torch's kernel does (its outputs
agree with torch's to bfloat16 rounding). On a CPU with AVX512-VNNI it multiplies in integers:
each activation row rounded to int16 with one scale (15 bits, finer than the bfloat16 it arrives
in, an outlier input included), the weights widened to int16, 32 exact products an instruction
(``vpdpwssd``) into int32 lanes, the row's sum converted once; elsewhere in float32, two
accumulators per row and output.

Measured on this project's AMD EPYC host (2 cores), 140 matrices of 512×576, float32 loop:

- called eagerly, 2 threads, µs per matrix, torch's kernel against this one: 1 row 25.8 / 15.1,
  2 rows 32.2 / 21.8, 4 rows 35.7 / 27.6, 8 rows 65.9 / 44.7 (one thread: 49.6 / 20.5,
  58.1 / 33.8, 68.3 / 37.5, 101 / 80.3);
- called from one compiled graph (``bench gemv``, 4 rows): 45.8 against 47.2, even; at one row
  19.9, as inductor's loop;
- served, the demo in int8 at four requests (one process each, paired runs):
  26.4 against 29.8 and 30.6 against 38.5 ms a step (medians of 3 rounds), the LM head's 4-row
  product 2.2-2.8 against 3.2-4.1 ms.

The integer loop against the float32 one, both in one process, 12 interleaved passes over the
demo's shapes (30 layers of its attention and shared-expert matrices and both routed-expert
products, then its 49,152 × 576 head), 2 threads, medians: 4 rows, layers 12.0 against 14.2 ms
and head 2.02 against 2.88; 1 row 3.75 against 3.99 and 1.09 against 1.30. Tried and not kept:
int8 activations in blocks of 32 (llama.cpp's Q8_0 rounding) through ``vpdpbusd``, 1.0-1.3× the
float32 loop and a coarser rounding; the CPU's 512-bit integer dot products run at about half the
rate their count suggests, so the int16 loop's gain is the conversions it drops.

The same loop computes a decode step's routed int8 experts (``moetray::int8_experts_mm``, called by
the compiled experts kernel, ``engine/experts/fused.py``, from two tokens up): a step of a few
tokens routes them to overlapping experts, and the token-expert pairs of one slot are computed
together, up to eight at a time, each output row's weights loaded once for all of them.

bfloat16 and float16 weights get the same two products (``moetray::half_rows_mm``, the decoder's
16-bit linears at 2-8 rows, its bfloat16 ones at one row too, and the LM head, through
:func:`half_product`; ``moetray::half_experts_mm``, the 16-bit experts): on a CPU with AVX512-BF16,
bfloat16 activations and weights multiply in pairs (``vdpbf16ps``: 32 exact products an
instruction, summed into float32 lanes) where a row's width is whole 32-value blocks; otherwise
the weights are widened to float32. oneDNN's bfloat16 product streams a few rows slowly: the
demo's 120 attention matrices and its 49,152 × 576 head, eagerly, 2 threads, ms, oneDNN against
this kernel: 2 rows 6.46 / 2.66 and 3.42 / 1.94, 4 rows 6.77 / 3.38 and 3.73 / 2.64, 8 rows 7.65 /
3.47 and 4.18 / 3.66 (one thread, 4 rows: 9.95 / 6.51, 7.31 / 5.15).

Rules:
- Built once per machine (:func:`build`, called where an int8 model's linears are quantized, a
  compiled decode step is installed and the compiled experts kernel is made) by the C++ compiler
  inductor uses, with AVX512 (F, BW, VL), FMA and OpenMP (``at::parallel_for`` shares a product's
  output rows over the step's intra-op threads; the process's OpenMP runtime is torch's, loaded
  first), into
  ``$XDG_CACHE_HOME/moetray/kernels`` under a name that hashes the sources, torch's version and the
  flags; loaded as ``moetray::int8_rows_mm``, ``moetray::int8_experts_mm``,
  ``moetray::half_rows_mm`` and ``moetray::half_experts_mm``, with the slot table's operator
  (:data:`SOURCES`).
- Serves 1 to :data:`MAX_ROWS` rows (:func:`serves`) on a CPU whose torch capability is AVX512;
  elsewhere, or where the build fails, the reason is kept (:func:`refusal`) and torch's kernel serves.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

from moetray.engine.models.row_cache import cache_folder

log = logging.getLogger(__name__)

MAX_ROWS = 8
"""Rows the kernel takes (the C++ source's ``kMaxRows``): a decode step of up to eight requests."""

SOURCES = (Path(__file__).with_name("few_rows.cpp"),
           Path(__file__).parents[1] / "experts" / "served_calls.cpp")
"""Built into one library: the products, and the slot table's operator (``moetray::expert_slots``
on CPU, ``moetray::take_served_calls``: :mod:`~moetray.engine.experts.resident`)."""
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp", "-shared", "-fPIC",
         "-std=c++20")

_LOCK = threading.Lock()
_REFUSAL: list[str | None] = []  # empty before build(); then [None] (loaded) or [why not]


class RowsProducts:
    """Products the kernel computed (eager calls; a compiled step's calls run in its graph)."""

    count = 0


def kernel_folder() -> Path:
    """``kernels`` in moetray's cache folder (:func:`~moetray.engine.models.row_cache.cache_folder`)."""
    return cache_folder(os.environ) / "kernels"


def _library_path() -> Path:
    key = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)
                         + torch.__version__.encode() + " ".join(FLAGS).encode())
    return kernel_folder() / f"few_rows-{key.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cmd = [os.environ.get("CXX", "g++"), *FLAGS, abi,
           *(f"-I{p}" for p in include_paths()), *map(str, SOURCES), "-o", str(partial),
           *(f"-L{p}" for p in library_paths()), "-ltorch", "-ltorch_cpu", "-lc10"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the C++ build failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    os.replace(partial, target)


def build() -> str | None:
    """Build (once per machine) and load the kernel; returns why it does not serve, or None."""
    with _LOCK:
        if _REFUSAL:
            return _REFUSAL[0]
        why: str | None = None
        if torch.backends.cpu.get_cpu_capability() != "AVX512":
            why = f"this CPU's torch capability is {torch.backends.cpu.get_cpu_capability()}, not AVX512"
        else:
            try:
                target = _library_path()
                if not target.exists():
                    _compile(target)
                torch.ops.load_library(str(target))
                torch.library.register_fake("moetray::int8_rows_mm")(_rows_shape)
                torch.library.register_fake("moetray::int8_experts_mm")(_experts_shape)
                torch.library.register_fake("moetray::half_rows_mm")(_half_rows_shape)
                torch.library.register_fake("moetray::half_experts_mm")(_half_experts_shape)
            except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: torch's kernel serves
                why = f"{type(exc).__name__}: {str(exc)[:300]}"
        if why is not None:
            log.warning("int8 products of a few rows use torch's kernel: %s", why)
        _REFUSAL.append(why)
        return why


def _rows_shape(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _experts_shape(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    return x.new_empty((slots.shape[0], slots.shape[1], qweight.shape[1]), dtype=torch.float32)


def _half_rows_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _half_experts_shape(x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return x.new_empty((slots.shape[0], slots.shape[1], weight.shape[1]), dtype=torch.float32)


def refusal() -> str | None:
    """Why the kernel does not serve (None: it does, or :func:`build` has not run)."""
    return _REFUSAL[0] if _REFUSAL else None


def loaded() -> bool:
    """Whether the kernels are built and loaded (``moetray::int8_experts_mm`` serves any batch)."""
    return _REFUSAL == [None]


def half_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of a 16-bit weight: up to :data:`MAX_ROWS` rows of a contiguous
    weight in the activations' dtype by ``moetray::half_rows_mm`` (float32 sums, the bias added
    before the one rounding) where it serves, else ``F.linear``."""
    flat = x.reshape(-1, x.shape[-1])
    if serves(flat.shape[0]) and weight.dtype == x.dtype and weight.is_contiguous():
        if not torch.compiler.is_compiling():
            RowsProducts.count += 1
        out = torch.ops.moetray.half_rows_mm(flat.contiguous(), weight)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)


def serves(rows: int) -> bool:
    """Whether the kernel computes a product of ``rows`` rows: built, loaded, at most
    :data:`MAX_ROWS` rows."""
    return loaded() and 1 <= rows <= MAX_ROWS
