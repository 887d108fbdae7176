"""The checkpoint-format seam: every touch of transformers' GGUF integration the models room makes.

transformers 5.24 reads GGUF headers without touching tensor data (``integrations/gguf/reader.py``:
a memory map, the metadata walk that skips the vocabulary unless asked, the tensor table). moetray
reads every header through it: listing a model store and loading a file alike. Its public
``read_gguf_metadata`` insists on ``general.architecture``, which only the first file of a split set
carries (llama.cpp's ``gguf-split`` gives later parts the ``split.*`` keys alone), so the walk is
made here from the same reader's primitives. Only this module, ``engine/cb/`` and
``engine/experts/hf.py`` import transformers internals (an import-linter contract).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from transformers.integrations.gguf.reader import _mapped, _read_string, _read_tensor_table, _read_value

__all__ = ["GgufHeader", "GgufTensor", "native_config_fields", "read_header"]

_VERSIONS = (2, 3)


class GgufTensor(NamedTuple):
    """One tensor of a GGUF file: torch-order ``shape``, its ggml type, and where its bytes lie."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the file
    path: Path


class GgufHeader(NamedTuple):
    path: Path
    metadata: dict
    tensors: tuple[GgufTensor, ...]
    file_bytes: int

    def blob(self) -> np.ndarray:
        """The file as a read-only ``uint8`` memory map (pages are read when touched)."""
        return _mapped(str(self.path))


def native_config_fields(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """transformers' own config fields for a file of an architecture its GGUF integration maps
    natively (``gguf_config_mapping``: qwen35moe among them), from the header alone. The vocabulary
    may be its length (:func:`read_header` skips string arrays), as that mapping expects."""
    from transformers.integrations.gguf.gguf_config_mapping import get_gguf_config

    return get_gguf_config(metadata, tensor_names)


def read_header(path: str | Path, string_arrays: Container[str] = ()) -> GgufHeader:
    """A GGUF file's metadata and tensor table, no tensor data. String arrays (the vocabulary, the
    merges) are skipped and reported by count unless named in ``string_arrays``.

    Raises ``ValueError`` for a file that is not GGUF v2/v3, and ``struct.error`` / ``IndexError``
    for one cut short inside its header; the caller names the refusal.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        # The reader's walk is a struct.unpack_from per string of the vocabulary (100 k+ of them):
        # over a plain mmap it runs several times faster than over numpy's memmap wrapper.
        blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _walk(path, blob, string_arrays)
    finally:
        blob.close()


def _walk(path: Path, blob: mmap.mmap, string_arrays: Container[str]) -> GgufHeader:
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} does not start with the GGUF magic bytes")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF v{version}; v2 and v3 are read")
    pos = 24
    metadata: dict = {}
    # transformers' readers are typed for an ndarray; they slice and unpack, which an mmap does.
    buffer: Any = blob
    for _ in range(kv_count):
        key, pos = _read_string(buffer, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _read_value(buffer, pos + 4, value_type, key in string_arrays)
    entries, pos = _read_tensor_table(buffer, tensor_count, pos)
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = tuple(
        GgufTensor(name, shape, ggml_type, data_start + offset, path)
        for name, shape, ggml_type, offset in entries
    )
    return GgufHeader(path, metadata, tensors, len(blob))
