"""Experts kept and computed as int8: one byte per weight in the store, the slots and every GEMM.

``--dtype int8`` rounds each expert's projections to int8 with one bfloat16 scale per output
channel (symmetric, round to nearest against the stored scale), once, when the store is built;
a Q8_0 GGUF file's expert blocks are re-rounded the same way (:meth:`Int8ExpertStore.from_store`).
A row is then bytes: per projection the int8 matrix in ``[out, in]`` layout, its scales, and
its bias (bfloat16) when the family has one, each at a 64-byte boundary. A slot fill copies
those bytes as they are, and the grouped path computes each routed expert's group straight
from its slot with torch's weight-only int8 kernel (``aten._weight_int8pack_mm``, bfloat16
activations): a decode step never widens them back to 16 bits, so it reads half the
bytes of bfloat16 experts, and the kernel's fixed cost for a small matrix is lower too
(a 576×64 down projection: about 4 µs against 14 µs in bfloat16 on an AVX512-BF16 CPU). A
prefill's group of many rows is the exception: the kernel's time grows with the rows, and past
:func:`~moetray.policy.precision.widens_int8_product`'s crossover the group's weight is widened
(exactly) for oneDNN's bfloat16 product instead.

Lossy by design: the receipt of `moetray bench decode` states the logit bound against
float32. Only the grouped compute mode reads int8 rows (the eager-exact mode is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from moetray.engine.experts.store import (
    ExpertGeometry,
    ExpertStore,
    ExpertStoreError,
    QuantizedExpertStore,
    unpack_row,
)
from moetray.engine.models.precision import int8_matmul, int8_rows

__all__ = ["Int8ExpertStore", "Int8Layout", "Int8Weight", "int8_gemm"]

_ALIGN = 64


def _up(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Int8Weight(NamedTuple):
    """One projection of one expert: ``qweight`` int8 ``[out, in]``, ``scale`` bfloat16 ``[out]``."""

    qweight: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class _Part:
    name: str  # the module's parameter: "gate_up_proj", "up_proj" or "down_proj"
    out_features: int
    in_features: int
    q_offset: int  # byte offsets in the row
    scale_offset: int
    bias_offset: int | None


@dataclass(frozen=True)
class Int8Layout:
    """Where each projection's int8 matrix, scales and bias lie in a row of bytes."""

    parts: tuple[_Part, ...]  # the first projection, then down_proj
    row_bytes: int

    @classmethod
    def from_geometry(cls, geo: ExpertGeometry) -> Int8Layout:
        shapes = {seg.name: seg.shape for seg in geo.segments}
        first = "gate_up_proj" if geo.has_gate else "up_proj"
        parts, offset = [], 0
        for name in (first, "down_proj"):
            shape = shapes[name]
            out_f, in_f = (shape[1], shape[0]) if geo.is_transposed else (shape[0], shape[1])
            q_off = offset
            offset = _up(offset + out_f * in_f)
            s_off = offset
            offset = _up(offset + 2 * out_f)
            b_off = None
            if geo.has_bias:
                b_off = offset
                offset = _up(offset + 2 * out_f)
            parts.append(_Part(name, out_f, in_f, q_off, s_off, b_off))
        return cls(tuple(parts), offset)

    def operands(self, row: torch.Tensor) -> tuple:
        """``(first, first_bias, down, down_bias)`` of one row, as the grouped path takes them
        (:class:`Int8Weight` in place of a float matrix); views, no copy. Of a pool's rows
        ``[capacity, row_bytes]``, each view gets the leading ``capacity`` dimension."""
        lead = row.shape[:-1]
        out: list = []
        for part in self.parts:
            q = row[..., part.q_offset:part.q_offset + part.out_features * part.in_features]
            scale = row[..., part.scale_offset:part.scale_offset + 2 * part.out_features]
            out.append(Int8Weight(q.view(torch.int8).view(*lead, part.out_features, part.in_features),
                                  scale.view(torch.bfloat16)))
            bias = None
            if part.bias_offset is not None:
                end = part.bias_offset + 2 * part.out_features
                bias = row[..., part.bias_offset:end].view(torch.bfloat16)
            out.append(bias)
        return tuple(out)

    def quantize(self, weights: dict[str, torch.Tensor], geo: ExpertGeometry, row: torch.Tensor) -> None:
        """Write one expert's float ``weights`` (the module's per-expert tensors) into ``row``."""
        row.zero_()
        for part in self.parts:
            w = weights[part.name]
            q, scale = int8_rows(w.t() if geo.is_transposed else w)
            row[part.q_offset:part.q_offset + q.numel()].copy_(q.reshape(-1).view(torch.uint8))
            row[part.scale_offset:part.scale_offset + 2 * scale.numel()].copy_(scale.view(torch.uint8))
            if part.bias_offset is not None:
                bias = weights[part.name + "_bias"].to(torch.bfloat16)
                row[part.bias_offset:part.bias_offset + 2 * bias.numel()].copy_(bias.view(torch.uint8))


def _q8_0_only(store: ExpertStore) -> bool:
    """Every part of every layer's experts is stored as Q8_0 blocks."""
    return isinstance(store, QuantizedExpertStore) and all(
        set(codec.bytes_by_label()) == {"Q8_0"} for codec in store.codecs)


def int8_gemm(states: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``states @ (qweight · scale)ᵀ`` by the weight-only int8 kernel, or for a group of many
    rows the widened weight (:func:`~moetray.engine.models.precision.int8_matmul`); bfloat16
    activations."""
    if states.dtype != torch.bfloat16 or not states.is_contiguous():
        states = states.to(torch.bfloat16).contiguous()
    return int8_matmul(states, weight.qweight, weight.scale)


class Int8ExpertStore(ExpertStore):
    """The host tier with every expert as an int8 row of bytes (:class:`Int8Layout`).

    ``dtype`` is the compute dtype (bfloat16, the activations'); ``slot_dtype`` is ``uint8``,
    ``row_numel`` the row's bytes. ``weights(layer, expert)`` dequantizes a fresh float copy
    (integrity checks and tests; the serving path never calls it).
    """

    slot_dtype = torch.uint8

    def __init__(self, source: ExpertStore, layout: Int8Layout, banks: list[torch.Tensor]):
        self.layout = layout
        self.source_format = source.format
        super().__init__(source.layers, banks, torch.bfloat16, source.pinned)
        self.row_numel = layout.row_bytes

    @classmethod
    def from_store(cls, source: ExpertStore) -> Int8ExpertStore:
        """Quantize ``source`` layer by layer, freeing each source bank once its int8 bank is built.

        A full-precision store is rounded per output channel. A store of Q8_0 blocks (a Q8_0
        GGUF file) is decoded to float32 and re-rounded per output channel: torch has no kernel
        for Q8_0's one-scale-per-32-weights blocks, and the per-channel step is at most one more
        half-step of rounding (a block's scale never exceeds its channel's), for ~1.0 byte per
        weight read instead of the 2 or 4 of decoded slots. Other quantized formats are refused
        (``int8_needs_float_experts``): int8 would read more bytes than their 4-6 bits, and they
        stay decoded per slot (the quantized store's own path)."""
        if source.quantized and not _q8_0_only(source):
            raise ExpertStoreError("int8_needs_float_experts", "--dtype int8 re-quantizes full-precision "
                                   f"or Q8_0 experts; these are stored as {source.format}")
        geo = source.layers[0].geometry
        layout = Int8Layout.from_geometry(geo)
        banks = []
        for layer in range(source.num_layers):
            bank = torch.empty((source.layers[layer].num_experts, layout.row_bytes), dtype=torch.uint8)
            for expert in range(bank.shape[0]):
                if isinstance(source, QuantizedExpertStore):
                    row = source.codecs[layer].decode(source.banks[layer][expert], torch.float32)
                else:
                    row = source.row(layer, expert)
                layout.quantize(unpack_row(row, geo), geo, bank[expert])
            banks.append(bank)
            source.banks[layer] = torch.empty(0)  # the source bank is no longer needed
        return cls(source, layout, banks)

    @property
    def row_bytes(self) -> int:
        return self.row_numel

    @property
    def slot_bytes(self) -> int:
        return self.row_numel

    @property
    def format(self) -> str:
        return "INT8"

    def operands(self, row: torch.Tensor) -> tuple:
        return self.layout.operands(row)

    def weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        geo = self.layers[layer].geometry
        out: dict[str, torch.Tensor] = {}
        first, first_bias, down, down_bias = self.operands(self.row(layer, expert))
        pairs = zip(self.layout.parts, (first, down), (first_bias, down_bias), strict=True)
        for part, weight, bias in pairs:
            w = (weight.qweight.float() * weight.scale.float()[:, None]).to(self.dtype)
            out[part.name] = w.t().contiguous() if geo.is_transposed else w
            if bias is not None:
                out[part.name + "_bias"] = bias.clone()
        return out

    def decoded_row(self, layer: int, expert: int) -> torch.Tensor:
        return self.row(layer, expert)
