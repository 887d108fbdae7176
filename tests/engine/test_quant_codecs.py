"""Every tensor type moetray serves decodes exactly as gguf-py's reference dequantizer does, block
for block (gguf-py is what transformers' own GGUF loader dequantizes with)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import dequantize as gguf_dequantize

from moetray.engine.experts.codecs import PLAIN_TYPES, SUPPORTED_GGML_TYPES, dequantize, ggml_type_name
from tests.gguf_fixtures import random_blocks

pytestmark = pytest.mark.engine
Q = GGMLQuantizationType
BLOCK_TYPES = sorted(t for t in SUPPORTED_GGML_TYPES if t not in PLAIN_TYPES)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=ggml_type_name)
def test_block_decoders_agree_with_gguf_py_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(qtype, 64, rng)
    want = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(blocks, qtype)).reshape(-1))
    got = dequantize(torch.from_numpy(blocks.reshape(-1)), qtype, torch.float32)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want), f"{ggml_type_name(qtype)}: {(got != want).sum().item()} values differ"


@pytest.mark.parametrize("qtype", sorted(PLAIN_TYPES), ids=ggml_type_name)
def test_plain_types_are_views(qtype):
    values = np.random.default_rng(0).standard_normal(96).astype(np.float32)
    stored = values.astype(np.float16) if qtype == Q.F16 else values
    raw = (
        stored.view(np.uint8)
        if qtype != Q.BF16
        else (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    )
    want = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype)).reshape(-1).astype(np.float32))
    assert torch.equal(dequantize(torch.from_numpy(raw.copy()), qtype), want)


def test_an_unsupported_type_is_refused_by_name():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS)
