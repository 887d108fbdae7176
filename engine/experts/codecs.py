"""Quantized expert rows: the block formats a store may keep, and turning one row back into weights.

A quantized store keeps each expert as the bytes its file holds (GGUF blocks, a Hugging Face
MXFP4 checkpoint's blocks and scales, fine-grained FP8 with its block scales). One expert is one
*encoded row*: its parts back to back, each part one tensor of that expert in its stored form.
:class:`RowCodec` knows where each part lies in the row, how to decode it and where its values go
in the packed full-precision row the slot pool holds (the layout of
:class:`~moetray.engine.experts.store.ExpertGeometry`). Decoding runs wherever the row is (on the
device after the copy, or on the CPU for the hybrid path); nothing keeps a decoded copy.

Dequantization is transformers' torch code where it has one (``integrations/gguf/dequant.py``:
Q4_0, Q4_1, Q8_0 and the K-quants; ``integrations/mxfp4.py`` for a checkpoint's MXFP4 experts),
reached through the :mod:`moetray.engine.experts.hf` seam; Q5_0, Q5_1 and GGUF's MXFP4 blocks,
which it lacks, are decoded here in the same style. Every decoder works in float32 and casts at
the end, as gguf-py's reference does, so a fp32 model is bit-identical to one dequantized by
gguf-py at load (the tests compare them block for block).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moetray.engine.experts.hf import dequantize_ggml_blocks, dequantize_mxfp4_packed

__all__ = [
    "PLAIN_TYPES",
    "SUPPORTED_GGML_TYPES",
    "EncodedRow",
    "Part",
    "RowCodec",
    "dequantize",
    "fp8_block_decoder",
    "ggml_decoder",
    "ggml_nbytes",
    "ggml_type_name",
    "mxfp4_hf_decoder",
    "plain_decoder",
]

Q = GGMLQuantizationType
PLAIN_TYPES: dict[int, torch.dtype] = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
"""ggml types that hold values, not blocks."""
SUPPORTED_GGML_TYPES = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.MXFP4,
    }
)
"""The tensor types moetray serves; any other is refused by name (``unsupported_quant_type``)."""


def ggml_type_name(ggml_type: int) -> str:
    """``Q4_K`` for 12; an id gguf-py does not know is ``type N``."""
    try:
        return Q(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def ggml_nbytes(ggml_type: int, numel: int) -> int:
    """Bytes ``numel`` values of ``ggml_type`` occupy (whole blocks)."""
    elems, nbytes = GGML_QUANT_SIZES[Q(ggml_type)]
    return numel // elems * nbytes


# --- decoders the transformers integration lacks --------------------------------------------------


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[nb, 16]`` bytes → ``[nb, 32]``: the 16 low nibbles, then the 16 high ones (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[nb, 4]`` bytes (a little-endian uint32) → ``[nb, 32]`` bits, bit ``j`` for value ``j``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 6:22]) | (_fifth_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return _half(blocks, 0) * q.float()


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 8:24]) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF MXFP4: one E8M0 exponent byte, then 16 bytes of E2M1 pairs; ggml halves the scale
    (``ggml_e8m0_to_fp32_half``) because its value table is doubled."""
    e = blocks[:, 0:1].to(torch.int32)
    bits = torch.where(
        e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23
    )
    d = bits.view(torch.float32)
    table = torch.tensor(_E2M1_DOUBLED, dtype=torch.float32, device=blocks.device)
    return d * table[_nibbles(blocks[:, 1:17]).long()]


_OWN_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q5_0: _dequant_q5_0,
    Q.Q5_1: _dequant_q5_1,
    Q.MXFP4: _dequant_mxfp4,
}


def dequantize(raw: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Flat ``uint8`` bytes of ``ggml_type`` → flat values in ``dtype`` (computed in float32, then cast).

    Raises ``ValueError`` for a type outside :data:`SUPPORTED_GGML_TYPES`."""
    if ggml_type not in SUPPORTED_GGML_TYPES:
        raise ValueError(f"ggml type {ggml_type_name(ggml_type)} is not supported")
    plain = PLAIN_TYPES.get(ggml_type)
    if plain is not None:
        return raw.contiguous().view(plain).to(dtype)
    elems, nbytes = GGML_QUANT_SIZES[Q(ggml_type)]
    blocks = raw.reshape(-1, nbytes)
    own = _OWN_DECODERS.get(ggml_type)
    values = own(blocks) if own is not None else dequantize_ggml_blocks(blocks, int(ggml_type))
    return values.reshape(-1).to(dtype)


# --- parts of an encoded row ----------------------------------------------------------------------

Decoder = Callable[[torch.Tensor], torch.Tensor]
"""``raw uint8 bytes of one part → float32 values of the part's logical shape``."""


def ggml_decoder(ggml_type: int, shape: tuple[int, ...]) -> tuple[Decoder, int]:
    """``(decoder, stored bytes)`` for one GGUF tensor slice of ``shape`` (rows along the last dim)."""
    numel = math.prod(shape)
    return (lambda raw: dequantize(raw, ggml_type, torch.float32).view(shape)), ggml_nbytes(ggml_type, numel)


def plain_decoder(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[Decoder, int]:
    """``(decoder, stored bytes)`` for values kept as they are (a bias in bf16, say)."""
    return (lambda raw: raw.view(dtype).view(shape).float()), math.prod(shape) * dtype.itemsize


def mxfp4_hf_decoder(rows: int, cols: int) -> tuple[Decoder, int]:
    """A Hugging Face MXFP4 tensor of ``rows`` stored rows of ``cols`` values: ``blocks``
    ``[rows, cols/32, 16]`` then ``scales`` ``[rows, cols/32]`` (E8M0, bias 127), back to back.
    Values come out ``[cols, rows]``: transformers' unpacking, the transposed layout gpt-oss's
    experts hold."""
    groups = cols // 32
    nblocks = rows * groups * 16

    def decode(raw: torch.Tensor) -> torch.Tensor:
        blocks = raw[:nblocks].view(1, rows, groups, 16)
        scales = raw[nblocks:].view(1, rows, groups)
        return dequantize_mxfp4_packed(blocks, scales).view(cols, rows)

    return decode, nblocks + rows * groups


def fp8_block_decoder(rows: int, cols: int, block: tuple[int, int]) -> tuple[Decoder, int]:
    """A fine-grained FP8 weight ``[rows, cols]`` (``float8_e4m3fn``) then its ``weight_scale_inv``
    (float32, one per ``block`` tile), back to back; values = weight × its tile's scale."""
    br, bc = block
    srows, scols = -(-rows // br), -(-cols // bc)

    def decode(raw: torch.Tensor) -> torch.Tensor:
        weight = raw[: rows * cols].view(torch.float8_e4m3fn).view(rows, cols).float()
        scale = raw[rows * cols :].view(torch.float32).view(srows, scols)
        scale = scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
        return weight * scale

    return decode, rows * cols + srows * scols * 4


@dataclass(frozen=True)
class Part:
    """One stored tensor of an expert: ``row[src:src+nbytes]`` decodes to values that ``place``
    writes into the expert's packed full-precision row."""

    src: int
    nbytes: int
    decode: Decoder
    place: Callable[[torch.Tensor, torch.Tensor], None]  # (decoded row, values) → writes in place
    label: str  # e.g. "Q4_K", "MXFP4", "FP8", "BF16": what the format summary counts


class RowCodec:
    """How one layer's experts are encoded: the parts of a row and their decoding.

    ``stored_bytes`` is what one expert occupies as stored (what a slot fill moves);
    ``decoded_numel`` the packed row it decodes to.
    """

    def __init__(self, parts: Sequence[Part], decoded_numel: int):
        self.parts = tuple(parts)
        self.stored_bytes = sum(p.nbytes for p in self.parts)
        self.decoded_numel = decoded_numel

    def decode_into(self, row: torch.Tensor, out: torch.Tensor) -> None:
        """Decode the encoded ``row`` (``uint8``, on any device) into ``out`` (the packed row, same
        device). Padding between segments is left as it is (zeros in a fresh pool row)."""
        for part in self.parts:
            values = part.decode(row[part.src : part.src + part.nbytes])
            part.place(out, values.to(out.dtype))

    def decode(self, row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A fresh packed row of ``dtype`` decoded from ``row``."""
        out = torch.zeros(self.decoded_numel, dtype=dtype, device=row.device)
        self.decode_into(row, out)
        return out

    def bytes_by_label(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for part in self.parts:
            counts[part.label] = counts.get(part.label, 0) + part.nbytes
        return counts


@dataclass(frozen=True)
class EncodedRow:
    """One expert's stored bytes as a slot fill receives them: ``data`` (``uint8``, the store's row
    width, padding included), ``nbytes`` (that width: what the plan executor checks) and the codec
    that decodes the first ``codec.stored_bytes`` of it."""

    data: torch.Tensor
    codec: RowCodec

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def link_bytes(self) -> int:
        """The bytes a fill really moves (the padding stays behind)."""
        return self.codec.stored_bytes

    def decode_into(self, out: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Move the stored bytes to ``out``'s device and decode them into ``out``."""
        src = self.data[: self.codec.stored_bytes]
        if src.device != out.device:
            src = src.to(out.device, non_blocking=non_blocking)
        self.codec.decode_into(src, out)
