"""The serving format in practice: this machine's 16-bit arithmetic, the model's dtype, int8 weights.

:func:`resolve_format` asks :func:`moetray.policy.precision.choose_format` which format to
serve (``--dtype``; ``auto`` by default) from the checkpoint's dtype and the CPU features read
here (:func:`cpu_features`). :func:`apply_format` then adapts the loaded model:

- ``int8``: every dense ``nn.Linear`` (attention, shared experts, the LM head) becomes an
  :class:`Int8Linear`: int8 weights with one bfloat16 scale per output channel, computed by
  torch's weight-only int8 kernel (``aten._weight_int8pack_mm``) on bfloat16 activations,
  so a decode step reads one byte per dense weight instead of two (the routed experts are
  made int8 the same way as the store is built: :mod:`moetray.engine.experts.int8`); a product
  of many rows (a prefill) widens the weight instead (:func:`int8_matmul`); the input embedding
  table is int8 rows too (:class:`Int8Embedding`; tied to the LM head, the head's);
- bfloat16 on a CPU: a step whose every matrix product has one row (a decode step of one
  request) runs with oneDNN off, so bfloat16 products take torch's own matrix-vector kernel
  (about 2× faster than oneDNN's at one row on an AVX512-BF16 CPU: 30 µs against 56 µs for a
  576×576 weight, 8 against 22 µs for a 128×576 one); every other step keeps oneDNN, which is
  10-100× faster from four rows up. The choice is per step, from the step's shape, so the
  same batch always takes the same kernels.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetray.engine.models import few_rows
from moetray.policy.precision import (
    ServingFormat,
    choose_format,
    measures_float16_values,
    widened_rows,
    widens_int8_product,
)

log = logging.getLogger("moetray.engine.models.precision")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` spells them (x86 ``flags``, Arm
    ``Features``); empty where they cannot be read (then ``auto`` serves float32 on the CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype the checkpoint's ``config.json`` names (``dtype`` or ``torch_dtype``), or None."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    return named if isinstance(named, str) else None


FITS_BLOCK_VALUES = 1 << 24
"""float16 values :func:`float16_fits_bfloat16` widens at a time (64 MiB of float32)."""


def float16_fits_bfloat16(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of these float16 tensors is a bfloat16 value: its float32 widening
    (exact) has zero low 16 bits, bfloat16 being float32's high half. Reads a block at a time and
    stops at the first value that is not (a model trained in float16 fails on its first matrix)."""
    for tensor in tensors:
        flat = tensor.reshape(-1)
        for lo in range(0, flat.numel(), FITS_BLOCK_VALUES):
            bits = flat[lo:lo + FITS_BLOCK_VALUES].float().view(torch.int32)
            if bool((bits & 0xFFFF).any()):
                return False
    return True


def safetensors_float16(folder: Path) -> Iterator[torch.Tensor]:
    """Every float16 tensor of a checkpoint folder's safetensors files (the loader's
    :func:`~moetray.engine.experts.loader.checkpoint_files`), one at a time."""
    from safetensors import safe_open

    from moetray.engine.experts.loader import checkpoint_files  # engine.experts imports this module

    for shard in checkpoint_files(folder):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if f.get_slice(name).get_dtype() == "F16":
                    yield f.get_tensor(name)


def resolve_format(spec: str, checkpoint: Path | None, device: torch.device,
                   named_dtype: str | None = None, quantized: str | None = None,
                   float16_tensors: Callable[[], Iterable[torch.Tensor]] | None = None) -> ServingFormat:
    """The format to serve ``checkpoint`` in on ``device`` (``spec`` is ``--dtype``); refuses an
    unusable spec with :class:`moetray.policy.precision.FormatRefused`. ``named_dtype`` stands in
    for the config's dtype where the checkpoint is not a config folder (a GGUF file), and
    ``quantized`` names a quantized file's block types (``choose_format``'s); ``float16_tensors``
    gives such a file's float16 tensors, read (:func:`float16_fits_bfloat16`) where the rule asks
    whether they are bfloat16 values (a folder's are read from its safetensors files)."""
    named = named_dtype if named_dtype is not None else (checkpoint_dtype(checkpoint) if checkpoint else None)
    features = cpu_features() if device.type == "cpu" else frozenset()
    fits = False
    if measures_float16_values(spec, device_kind=device.type, checkpoint_dtype=named, cpu_features=features,
                               quantized=quantized):
        if float16_tensors is not None:
            fits = float16_fits_bfloat16(float16_tensors())
        elif checkpoint is not None:
            fits = float16_fits_bfloat16(safetensors_float16(checkpoint))
    chosen = choose_format(spec, device_kind=device.type, checkpoint_dtype=named, cpu_features=features,
                           quantized=quantized, float16_is_bfloat16=fits)
    log.info("serving format: %s weights, %s compute (%s; %s)", chosen.weights, chosen.compute,
             chosen.reason, platform.machine())
    return chosen


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16`` (the compute dtypes :class:`ServingFormat` names)."""
    return _DTYPES[name]


def apply_format(fmt: ServingFormat, model: nn.Module, device: torch.device) -> None:
    """Adapt the loaded ``model`` to ``fmt`` (see the module docstring); mutates the model."""
    if fmt.weights == "int8":
        quantize_linears(model)
    if device.type == "cpu" and fmt.compute == "bfloat16":
        route_single_row_steps(model)


# --- int8 weights --------------------------------------------------------------------------------


WIDEN_BLOCK_WEIGHTS = 1 << 21
"""Int8 weights widened to bfloat16 at a time (4 MiB per thread that widens): a larger matrix (an
LM head) is widened and multiplied a block of output channels after another."""

_WIDEN = threading.local()  # .scratch: this thread's bfloat16 block


class WidenedProducts:
    """Int8 products computed by widening the weight (:func:`int8_matmul`), counted."""

    count = 0


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight · qscale)ᵀ`` for contiguous bfloat16 rows ``x`` ``[M, in]``: up to
    :data:`~moetray.engine.models.few_rows.MAX_ROWS` rows of a contiguous weight by
    ``moetray::int8_rows_mm`` where it serves (each weight row read once for all rows), else by
    torch's int8 kernel, or where :func:`~moetray.policy.precision.widens_int8_product` decides
    (many rows, eager), by oneDNN's bfloat16 product over the weight widened a block at a time
    (exact), the scale applied to its output, the rows padded to
    :func:`~moetray.policy.precision.widened_rows`. Traced in a compiled step it is never widened."""
    rows, weights = x.shape[0], qweight.numel()
    if (few_rows.serves(rows) and qscale.dtype == torch.bfloat16 and qweight.is_contiguous()
            and qscale.is_contiguous()):
        if not torch.compiler.is_compiling():
            few_rows.RowsProducts.count += 1
        return torch.ops.moetray.int8_rows_mm(x, qweight, qscale)
    if torch.compiler.is_compiling() or not widens_int8_product(rows, weights):
        return torch.ops.aten._weight_int8pack_mm(x, qweight, qscale)
    WidenedProducts.count += 1
    out_features, in_features = qweight.shape
    step = max(1, WIDEN_BLOCK_WEIGHTS // in_features)
    scratch = getattr(_WIDEN, "scratch", None)
    need = min(out_features, step) * in_features
    if scratch is None or scratch.numel() < need:
        scratch = _WIDEN.scratch = torch.empty(need, dtype=torch.bfloat16)
    x = padded_rows(x)
    blocks = []
    for lo in range(0, out_features, step):
        hi = min(lo + step, out_features)
        wide = scratch[:(hi - lo) * in_features].view(hi - lo, in_features).copy_(qweight[lo:hi])
        blocks.append(torch.mm(x, wide.t())[:rows].mul_(qscale[lo:hi]))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, in]`` with zero rows appended up to :func:`~moetray.policy.precision.widened_rows`
    (``x`` itself where it has that many): the few row counts oneDNN builds its kernels for."""
    rows = x.shape[0]
    padded = widened_rows(rows)
    return x if padded == rows else torch.cat([x, x.new_zeros((padded - rows, x.shape[1]))])


def pads_rows(x: torch.Tensor) -> bool:
    """Whether a product of ``x`` goes over :func:`padded_rows`: 16-bit activations on the CPU, whose
    products are oneDNN's, its kernels built per shape (a prefill's rows, a prompt's length, an
    expert's routed tokens would each build one and, past the bounded cache,
    ``serve.ONEDNN_CACHED_SHAPES``, build it again)."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu"


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, over :func:`padded_rows` where :func:`pads_rows`. The same values
    row by row as far as the kernel's blocking goes: lossy formats only."""
    if not pads_rows(x):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = F.linear(padded_rows(flat), weight, bias)
    return out[:flat.shape[0]].reshape(*x.shape[:-1], weight.shape[0])


def int8_product(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """:class:`Int8Linear`'s product ``x @ (qweight · qscale)ᵀ (+ bias)`` by torch's weight-only int8
    kernel (:func:`int8_matmul`), over bfloat16 activations (cast there and back); any slice of the
    output rows too."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if flat.dtype != torch.bfloat16 or not flat.is_contiguous():
        flat = flat.to(torch.bfloat16).contiguous()
    out = int8_matmul(flat, qweight, qscale)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], qweight.shape[0]).to(x.dtype)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, cols]`` → int8 ``[rows, cols]`` and one bfloat16 scale per row (symmetric, round to
    nearest against the stored scale: the kernel's dtype)."""
    wide = weight.detach().float()
    scale = (wide.abs().amax(dim=1).clamp_min(1e-30) / 127.0).to(torch.bfloat16)
    q = torch.round(wide / scale.float()[:, None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and one scale per output channel (symmetric, round to
    nearest): ``y = x @ (qweight · qscale)ᵀ + bias``, computed by ``aten._weight_int8pack_mm``.

    The activations must be bfloat16 (the kernel's fast path, and the dtype the scales are
    kept in); other dtypes are cast to it and back.
    """

    qweight: torch.Tensor  # [out, in] int8 (a buffer)
    qscale: torch.Tensor  # [out] bfloat16 (a buffer)
    bias: nn.Parameter | None  # [out] bfloat16

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, qscale = int8_rows(linear.weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("qscale", qscale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.qweight, self.qscale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int8Embedding(nn.Module):
    """An embedding table as int8 rows with one bfloat16 scale per row: row ``i`` is
    ``qweight[i] · qscale[i]``, rounded once to bfloat16. A step looks up a few rows, so the table
    need not be kept in 16 bits: on the demo (vocabulary 49,152 × 576) that is 54 MiB against 28,
    as llama.cpp keeps an 8-bit table. A table tied to the LM head reads the head's own int8 rows
    (the head's scales are per output channel, that is per row of the table)."""

    qweight: torch.Tensor  # [vocab, hidden] int8 (a buffer; a tied head's own)
    qscale: torch.Tensor  # [vocab] bfloat16 (a buffer; a tied head's own)

    def __init__(self, qweight: torch.Tensor, qscale: torch.Tensor, padding_idx: int | None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("qscale", qscale)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(ids, self.qweight).float()
        return (rows * self.qscale[ids].float().unsqueeze(-1)).to(self.qscale.dtype)


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` with an :class:`Int8Linear`; returns how many.
    A plain input embedding table becomes an :class:`Int8Embedding` (tied to the LM head: the
    head's int8 rows); an embedding of its own kind (one that scales its rows) stays as it is.
    Builds the few-rows kernel their products of up to eight rows take (:mod:`.few_rows`)."""
    few_rows.build()
    lm: Any = model  # a transformers model: its embedding accessors
    table, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    tied = type(table) is nn.Embedding and type(head) is nn.Linear and head.weight is table.weight
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child))
                count += 1
    if type(table) is nn.Embedding:
        int8_head = lm.get_output_embeddings()
        qweight, qscale = ((int8_head.qweight, int8_head.qscale) if tied and isinstance(int8_head, Int8Linear)
                           else int8_rows(table.weight))
        lm.set_input_embeddings(Int8Embedding(qweight, qscale, table.padding_idx))
    if count:
        # The LM head no longer shares the embedding's parameter: stop transformers re-tying them.
        config: Any = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for cfg in {id(config): config, id(text): text}.values():
            if getattr(cfg, "tie_word_embeddings", False):
                cfg.tie_word_embeddings = False
    log.info("int8 weights: %d linear layers quantized per output channel", count)
    return count


# --- bfloat16 on the CPU -------------------------------------------------------------------------


def route_single_row_steps(model: nn.Module) -> None:
    """Run one-row forwards (a decode step of one request) with oneDNN off, so bfloat16 matrix
    products take torch's own matrix-vector kernel; other forwards are untouched. Idempotent.

    ``torch.backends.mkldnn`` is process-wide: while a one-row step runs, a bfloat16 product
    on another thread also skips oneDNN (slower, never wrong); float32 products never use it.
    """
    if getattr(model, "_moetray_single_row_routing", False):
        return
    forward = model.forward

    @functools.wraps(forward)
    def routed(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.numel() != 1 or not torch.backends.mkldnn.enabled:
            return forward(*args, **kwargs)
        torch.backends.mkldnn.enabled = False
        try:
            return forward(*args, **kwargs)
        finally:
            torch.backends.mkldnn.enabled = True

    model.forward = routed
    setattr(model, "_moetray_single_row_routing", True)  # noqa: B010 - a flag nn.Module does not declare
