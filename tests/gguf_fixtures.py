"""GGUF fixtures for engine and API tests: random quantized blocks, and tiny MoE checkpoints written
as GGUF files the way llama.cpp's converter writes them (``moetray.engine.models.gguf_export``)."""

from __future__ import annotations

import zlib

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

# Byte offsets of each block's fp16 scale fields: random bytes there could be NaN or inf.
HALF_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.MXFP4: (),
}


def random_blocks(qtype: int, n_blocks: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """``[n_blocks, block_bytes]`` uint8 of valid ``qtype`` blocks: random quants, finite fp16 scales
    around ``scale`` (any byte pattern is a valid block once its scales are finite)."""
    _, nbytes = GGML_QUANT_SIZES[Q(qtype)]
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for at in HALF_FIELDS.get(Q(qtype), (0,)):
        halves = (rng.uniform(0.2, 1.0, n_blocks) * scale).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.MXFP4:  # exponents near 2^-7, as real weights have
        blocks[:, 0] = rng.integers(118, 124, n_blocks, dtype=np.uint8)
    return blocks


def random_k_blocks(name: str, shape: tuple[int, ...], qtype: int) -> np.ndarray | None:
    """An ``export_gguf`` blocks hook: random valid blocks for the types gguf-py cannot quantize
    (the K-quants but Q4_K, which the exporter encodes, and any IQ type); None for the rest."""
    if qtype in (Q.Q4_K, Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4):
        return None
    elems, nbytes = GGML_QUANT_SIZES[Q(qtype)]
    rows = int(np.prod(shape[:-1]))
    rng = np.random.default_rng(zlib.crc32(f"{name}:{int(qtype)}".encode()))
    return random_blocks(qtype, rows * shape[-1] // elems, rng).reshape(
        *shape[:-1], shape[-1] // elems * nbytes
    )
