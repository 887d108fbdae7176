"""Which number format the engine serves a checkpoint in: the weights, the activations, the KV cache.

Decode of a small batch reads every weight once per step, so its speed is bytes per weight:
float32 reads 4, bfloat16 and float16 2, weight-only int8 about 1. ``--dtype auto`` (the
default) picks, without ever rounding the checkpoint's own weights:

- on CUDA, the checkpoint's dtype (bfloat16 when it names none);
- on a CPU, the checkpoint's 16-bit dtype when this CPU computes it natively (bfloat16:
  AVX512-BF16 or AMX-BF16 on x86, the BF16 extension on Arm; float16: AVX512-FP16 or
  AMX-FP16, or Arm's half-precision arithmetic), else float32: widening is exact, and a CPU
  without the instructions emulates 16-bit arithmetic slower than float32 (float16 matrix
  products of more than one row on an AVX512-BF16 CPU run 10-100× slower than bfloat16's);
- but a float16 checkpoint on a CPU that computes bfloat16 and not float16 is served in bfloat16
  where every one of its float16 values is a bfloat16 value (measured on the file:
  :func:`measures_float16_values`), as it is when a converter wrote a model trained in bfloat16
  to an F16 file (bfloat16's 8 significant bits fit float16's 11): the same values at two bytes a
  weight, where float32 would read four (the demo's F16 file decoded at 12 tok/s in float32 against
  llama.cpp's 82, on a Zen 4 CPU without float16 arithmetic);
- float32 for a float32 checkpoint (the token-identity reference every exact path meets);
- a quantized file (GGUF Q8_0, Q4_K, …) on a CPU that computes bfloat16: its values are already
  rounded, and float32 would read four bytes a weight where the file stores one or less (the demo's
  Q8_0 file decoded at 19 tok/s in float32 against llama.cpp's 116). A file whose every quantized
  matrix is Q8_0 serves as ``int8`` (below; the per-channel step adds at most one half-step of
  rounding to the file's per-block one), any other one in bfloat16 (its experts decoded per slot).
  Without bfloat16 arithmetic, float32: both kernels need bfloat16 activations to be fast.

An explicit ``--dtype`` is served as asked: ``float32``, ``bfloat16``, ``float16``, or
``int8`` (every weight but the embedding table rounded to int8 per output channel, experts
included, computed by torch's weight-only int8 kernel on bfloat16 activations: lossy, never
chosen by ``auto`` but for a Q8_0 file, CPU only; from a GGUF file, only Q8_0 experts are re-rounded
to it). Pure:
CPU features are passed in.
"""

from __future__ import annotations

from typing import NamedTuple

from moetray.policy.refused import Refused

FORMATS = ("auto", "float32", "bfloat16", "float16", "int8")
"""What ``--dtype`` accepts."""

BF16_FEATURES = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU flags (``/proc/cpuinfo`` spelling) that compute bfloat16 in hardware."""
FP16_FEATURES = frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
"""CPU flags that compute float16 in hardware (x86 AVX512-FP16/AMX-FP16, Arm half precision)."""


class ServingFormat(NamedTuple):
    """The decision: ``compute`` is the activations' and KV cache's dtype (and the weights',
    unless ``weights`` says they are quantized); ``reason`` says why, for the status page."""

    compute: str  # "float32" | "bfloat16" | "float16"
    weights: str  # "float32" | "bfloat16" | "float16" | "int8"
    reason: str


class FormatRefused(Refused, ValueError):
    """A ``--dtype`` that cannot be served: ``unknown_dtype`` (not one of :data:`FORMATS`) or
    ``int8_needs_cpu`` (the weight-only int8 kernels the int8 format uses are the CPU's)."""

    KINDS = ("unknown_dtype", "int8_needs_cpu")


def native_16bit(cpu_features: frozenset[str]) -> tuple[str, ...]:
    """The 16-bit float formats this CPU computes in hardware, bfloat16 first. Pure."""
    out = []
    if cpu_features & BF16_FEATURES:
        out.append("bfloat16")
    if cpu_features & FP16_FEATURES:
        out.append("float16")
    return tuple(out)


def measures_float16_values(requested: str, *, device_kind: str, checkpoint_dtype: str | None,
                            cpu_features: frozenset[str], quantized: str | None = None) -> bool:
    """Whether :func:`choose_format` needs ``float16_is_bfloat16`` measured (it reads every float16
    value of the checkpoint): ``auto`` for a float16 checkpoint of plain floats on a CPU that computes
    bfloat16 but not float16. Pure."""
    native = native_16bit(cpu_features)
    return (requested == "auto" and device_kind == "cpu" and quantized is None
            and checkpoint_dtype == "float16" and native == ("bfloat16",))


def choose_format(requested: str, *, device_kind: str, checkpoint_dtype: str | None,
                  cpu_features: frozenset[str], quantized: str | None = None,
                  float16_is_bfloat16: bool = False) -> ServingFormat:
    """Decides the serving format (see the module docstring); pure, mutates nothing.

    ``checkpoint_dtype`` is the config's ``dtype``/``torch_dtype`` (None when it names
    none); ``quantized`` the block types a quantized file stores its matrices in, ``+``-joined
    (``"Q8_0"``, ``"Q4_K+Q6_K"``; None for plain floats); ``float16_is_bfloat16`` whether every
    float16 value of the checkpoint was measured to be a bfloat16 value (where
    :func:`measures_float16_values`; False: not measured, or not). Refuses with
    :class:`FormatRefused` (an unknown ``requested``; int8 off the CPU).
    """
    if requested not in FORMATS:
        raise FormatRefused("unknown_dtype", f"unknown dtype {requested!r}; one of {', '.join(FORMATS)}")
    if requested == "int8" and device_kind != "cpu":
        raise FormatRefused("int8_needs_cpu", f"--dtype int8 runs on the CPU only, not {device_kind}")
    if requested == "int8":
        return ServingFormat("bfloat16", "int8", "--dtype int8: weight-only int8 on bfloat16 activations")
    if requested != "auto":
        return ServingFormat(requested, requested, f"--dtype {requested}")
    if device_kind != "cpu":
        chosen = checkpoint_dtype if checkpoint_dtype in ("float32", "bfloat16", "float16") else None
        whose = "the checkpoint's " if chosen else ""
        chosen = chosen or "bfloat16"
        return ServingFormat(chosen, chosen, f"auto: {whose}{chosen} on {device_kind}")
    if quantized is not None:
        return _quantized_on_cpu(quantized, cpu_features)
    sixteen = checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else None
    if sixteen is None:
        named = checkpoint_dtype or "unspecified"
        return ServingFormat("float32", "float32", f"auto: the checkpoint is {named}; float32 on the CPU")
    native = native_16bit(cpu_features)
    if sixteen in native:
        flags = sorted(cpu_features & (BF16_FEATURES if sixteen == "bfloat16" else FP16_FEATURES))
        return ServingFormat(sixteen, sixteen, f"auto: the checkpoint's {sixteen}, computed natively by "
                                               f"this CPU ({', '.join(flags)})")
    if float16_is_bfloat16 and sixteen == "float16" and "bfloat16" in native:
        return ServingFormat("bfloat16", "bfloat16",
                             "auto: the checkpoint is float16 but every value of it is a bfloat16 value "
                             f"(measured) and this CPU computes bfloat16 "
                             f"({', '.join(sorted(cpu_features & BF16_FEATURES))}) but not float16; "
                             "bfloat16 (exact)")
    return ServingFormat("float32", "float32",
                         f"auto: the checkpoint is {sixteen} but this CPU has no {sixteen} arithmetic; "
                         "float32 (exact widening)")


def _quantized_on_cpu(quantized: str, cpu_features: frozenset[str]) -> ServingFormat:
    """``auto`` for a quantized file on a CPU (see the module docstring)."""
    if "bfloat16" not in native_16bit(cpu_features):
        return ServingFormat("float32", "float32", f"auto: a {quantized} file on a CPU without bfloat16 "
                                                   "arithmetic; float32")
    flags = ", ".join(sorted(cpu_features & BF16_FEATURES))
    if quantized == "Q8_0":
        return ServingFormat("bfloat16", "int8", f"auto: a Q8_0 file: weight-only int8 on bfloat16 "
                                                 f"activations ({flags})")
    return ServingFormat("bfloat16", "bfloat16", f"auto: a {quantized} file: bfloat16, its experts decoded "
                                                 f"per slot ({flags})")


INT8_KERNEL_PS_PER_ROW_WEIGHT = 12
"""Picoseconds torch's weight-only int8 kernel (``_weight_int8pack_mm``) spends per weight per
activation row: it computes row after row, so its time grows with the rows (measured, 2 cores of
this project's AVX512-BF16 CPU: a 576×576 weight 35 µs at 8 rows, 129 at 32, 628 at 160)."""

WIDEN_FIXED_US = 30
"""Microseconds a widened product costs however small (oneDNN's bfloat16 matrix product's set-up;
measured as above: a 128×576 weight 36 µs at 8 rows)."""

WIDEN_PS_PER_WEIGHT = 130
"""Picoseconds a widened product spends per weight, once for all rows: the int8 weight copied
to bfloat16 (exact: every int8 value is a bfloat16) and read by oneDNN's matrix product, which
grows little with the rows (a 576×576 weight: 73 µs at 16 rows, 136 at 160)."""


def widens_int8_product(rows: int, weights: int) -> bool:
    """Whether an int8 product of ``rows`` activation rows and a weight of ``weights`` int8 values
    widens the weight to bfloat16 for oneDNN's matrix product rather than call the int8 kernel. Pure.

    The int8 kernel reads the weight once per row; widened, the weight is converted once and the
    product's cost hardly grows with the rows. So a decode step (a few rows) keeps the int8 kernel
    and a prefill (tens to thousands of rows) widens: on the demo's 576×576 attention weights from
    about 19 rows, on a 64-neuron expert's 128×576 weight from about 45 (its rows are the tokens
    routed to it); with the weights cold in memory, as a prefill reads them, the crossovers measured
    within a few rows of these. Widening rounds the result twice (the product's bfloat16, then the
    scale), one more rounding than the kernel's, within the lossy int8 format's budget."""
    kernel_ps = rows * weights * INT8_KERNEL_PS_PER_ROW_WEIGHT
    return kernel_ps > WIDEN_FIXED_US * 1_000_000 + weights * WIDEN_PS_PER_WEIGHT


WIDEN_ROWS_STEP = 1024
"""Past this many rows a widened product's rows are padded to a multiple of it, below it to a
power of two (:func:`widened_rows`)."""


def widened_rows(rows: int) -> int:
    """The rows a widened product computes for ``rows`` (zero rows pad the rest). Pure.

    oneDNN builds a product's kernel for its exact shape, ~1 ms each on this project's CPU, and
    keeps it for the next product of that shape: every prompt length a shape of its own would
    pay that at every prefill's every matrix (measured: 980 µs against 96 µs a 576×576 product
    of 20-220 rows). Padded to a few sizes, the kernels are built once; the padding costs less
    (a 576×576 weight, 16-40 rows: 86 µs padded against the int8 kernel's 135). The 16-bit
    products of a prefill take the same sizes (``engine.models.precision.half_linear``): the F16
    demo's 600-word prompt, first token 4.3-4.6 s unpadded against 2.6-3.0 s (one process)."""
    if rows <= WIDEN_ROWS_STEP:
        return 1 << (rows - 1).bit_length()
    return -(-rows // WIDEN_ROWS_STEP) * WIDEN_ROWS_STEP
