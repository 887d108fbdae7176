"""Hugging Face checkpoints whose experts are quantized: MXFP4 (gpt-oss) and fine-grained FP8.

``quantization_config.quant_method``:

- ``"mxfp4"`` (gpt-oss): each Experts module's ``gate_up_proj`` and ``down_proj`` are stored as
  ``*_blocks`` (``[E, rows, cols/32, 16]`` uint8, two E2M1 values a byte) and ``*_scales``
  (``[E, rows, cols/32]`` E8M0); biases stay bf16. The store keeps blocks and scales; a fill
  decodes them with transformers' own unpacking into the module's (transposed) layout.
- ``"fp8"`` with ``weight_block_size`` (Qwen3-…-FP8, DeepSeek-V3): every quantized linear's
  ``weight`` is ``float8_e4m3fn`` beside a ``weight_scale_inv`` tile grid. Expert weights stay FP8
  in the store (with their scales); other weights are dequantized at load.

Every other method (GPTQ, AWQ, bitsandbytes, …) is refused by name (``quantized_checkpoint``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from moetray.engine.experts.codecs import Part, RowCodec, fp8_block_decoder, mxfp4_hf_decoder, plain_decoder
from moetray.engine.experts.store import ExpertStoreError, StoreLayer

__all__ = ["SERVED_METHODS", "dequantize_fp8", "expert_sources", "fp8_block", "quant_method"]

SERVED_METHODS = ("mxfp4", "fp8")
_FP8_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
}


def quant_method(config) -> str | None:
    """The checkpoint's quantization method, or None; the served ones only. Raises ``ValueError``
    naming any other (the loader turns it into ``quantized_checkpoint``)."""
    quant = getattr(config, "quantization_config", None)
    if quant is None and hasattr(config, "get_text_config"):
        quant = getattr(config.get_text_config(), "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    method = getattr(method, "value", method)
    if method not in SERVED_METHODS:
        raise ValueError(str(method or "unknown method"))
    if method == "fp8" and fp8_block(config) is None:
        raise ValueError("fp8 without weight_block_size (per-tensor FP8)")
    return method


def fp8_block(config) -> tuple[int, int] | None:
    quant = getattr(config, "quantization_config", None) or {}
    block = (
        quant.get("weight_block_size")
        if isinstance(quant, dict)
        else getattr(quant, "weight_block_size", None)
    )
    return (int(block[0]), int(block[1])) if block else None


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A fine-grained FP8 weight in float32: each ``block`` tile times its ``weight_scale_inv``."""
    rows, cols = weight.shape
    decode, _ = fp8_block_decoder(rows, cols, block)
    raw = torch.cat(
        [
            weight.contiguous().view(torch.uint8).reshape(-1),
            scale_inv.float().contiguous().view(torch.uint8).reshape(-1),
        ]
    )
    return decode(raw)


def _copy_into(offset: int, shape: tuple[int, ...]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    numel = math.prod(shape)

    def place(out: torch.Tensor, values: torch.Tensor) -> None:
        out[offset : offset + numel].view(shape).copy_(values)

    return place


def expert_sources(
    method: str,
    config,
    layers: list[StoreLayer],
    entries: Iterable[tuple[Path, str, str]],
    open_file: Callable[[Path], object],
):
    """``(codecs, read_part, claimed checkpoint keys)`` for the quantized experts of ``layers``.

    ``read_part(layer, part)`` returns ``uint8`` ``[num_experts, part bytes]`` for the store.
    Raises :class:`ExpertStoreError` ``missing_expert_tensor`` / ``shape_mismatch``."""
    by_key = {}
    for path, key, model_key in entries:
        by_key[model_key] = (path, key)
        by_key.setdefault(key, (path, key))
    codecs, readers = [], []
    claimed: set[str] = set()
    for layer in layers:
        build = _mxfp4_layer if method == "mxfp4" else _fp8_layer
        codec, reads = build(layer, by_key, fp8_block(config), open_file)
        codecs.append(codec)
        readers.append(reads)
        claimed.update(key for keys, _ in reads for _, key in keys)

    def read_part(layer: int, part: int) -> torch.Tensor:
        return readers[layer][part][1](open_file)

    return codecs, read_part, claimed


def _u8(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _find(by_key: dict, name: str) -> tuple[Path, str]:
    if name not in by_key:
        raise ExpertStoreError("missing_expert_tensor", f"{name} not found in the checkpoint")
    return by_key[name]


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _mxfp4_layer(layer: StoreLayer, by_key: dict, _block, open_file):
    """gpt-oss: gate_up and down as blocks+scales, their biases bf16 (the module's segment order)."""
    geo = layer.geometry
    parts, reads, src = [], [], 0
    for seg in geo.segments:
        base = f"{layer.module_name}.{seg.name}"
        if seg.name.endswith("_bias"):
            path_key = _find(by_key, base)
            stored = open_file(path_key[0]).get_slice(path_key[1]).get_dtype()
            decode, nbytes = plain_decoder(_SAFETENSORS_DTYPES[stored], seg.shape)
            sources = [path_key]
            label = stored
        else:
            cols_out, rows_stored = seg.shape  # the module holds [in, out]; the file [out, in/32, 16]
            decode, nbytes = mxfp4_hf_decoder(rows_stored, cols_out)
            sources = [_find(by_key, base + "_blocks"), _find(by_key, base + "_scales")]
            label = "MXFP4"
        parts.append(Part(src, nbytes, decode, _copy_into(seg.offset, seg.shape), label))

        def read(open_file, sources=sources, experts=layer.num_experts):
            return torch.cat(
                [_u8(open_file(p).get_tensor(k)).reshape(experts, -1) for p, k in sources], dim=1
            )

        reads.append((sources, read))
        src += nbytes
    return RowCodec(parts, geo.row_numel), reads


def _fp8_layer(layer: StoreLayer, by_key: dict, block, _open_file):
    """Per-expert FP8 weights (gate, up, down), each with its scale grid, for gated unbiased experts."""
    geo = layer.geometry
    if geo.is_transposed or not geo.has_gate or geo.has_bias:
        raise ExpertStoreError(
            "unsupported_layout",
            f"{layer.module_name}: FP8 experts are read for gated, untransposed, unbiased experts",
        )
    pattern = re.compile(rf"^{re.escape(layer.module_name)}\.(\d+)\.([a-z0-9_]+)\.weight$")
    found: dict[tuple[str, int], tuple[int, Path, str, Path, str]] = {}
    for name, (path, key) in by_key.items():
        m = pattern.match(name)
        if m and m[2] in _FP8_PARTS:
            seg, pos = _FP8_PARTS[m[2]]
            scale = _find(by_key, name + "_scale_inv")
            found[
                (
                    m[2]
                    if m[2] in ("gate_proj", "up_proj", "down_proj")
                    else {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[m[2]],
                    int(m[1]),
                )
            ] = (pos, path, key, *scale)
    gate_up = next(s for s in geo.segments if s.name == "gate_up_proj")
    down = next(s for s in geo.segments if s.name == "down_proj")
    inter, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
    targets = {
        "gate_proj": (gate_up.offset, (inter, hidden)),
        "up_proj": (gate_up.offset + inter * hidden, (inter, hidden)),
        "down_proj": (down.offset, down.shape),
    }
    parts, reads, src = [], [], 0
    for proj, (offset, shape) in targets.items():
        experts = [found.get((proj, e)) for e in range(layer.num_experts)]
        present = [x for x in experts if x is not None]
        if len(present) < len(experts):
            raise ExpertStoreError(
                "missing_expert_tensor", f"{layer.module_name}: {proj} FP8 weights missing"
            )
        decode, nbytes = fp8_block_decoder(shape[0], shape[1], block)
        parts.append(Part(src, nbytes, decode, _copy_into(offset, shape), "FP8"))
        sources = [pair for _, path, key, spath, skey in present for pair in ((path, key), (spath, skey))]

        def read(open_file, experts=experts):
            rows = [
                torch.cat(
                    [
                        _u8(open_file(path).get_tensor(key)).reshape(-1),
                        _u8(open_file(spath).get_tensor(skey).float()).reshape(-1),
                    ]
                )
                for _, path, key, spath, skey in experts
            ]
            return torch.stack(rows)

        reads.append((sources, read))
        src += nbytes
    return RowCodec(parts, geo.row_numel), reads
