"""The host tier: every routed expert of a checkpoint, packed one contiguous row per expert.

The store reads expert tensors straight from the checkpoint's safetensors files (``safe_open``
+ ``get_slice``, memory-mapped; a fused stack is sliced one expert at a time, never loaded
whole) and packs each expert into one row of a per-layer host bank, in the layout the
transformers Experts module expects (``gate_up`` then ``down``, biases after their weight),
so that a miss is a single copy of one row. On CUDA the banks are pinned so copies can run
at full link speed. Nothing here touches the device.

Two on-disk layouts are read, and produce identical rows:

- **per expert**: ``<layer>.mlp.experts.N.{gate,up,down}_proj.weight`` (Qwen, OLMoE, …) and
  Mixtral's legacy ``<layer>.block_sparse_moe.experts.N.{w1,w3,w2}.weight`` (w1 = gate,
  w3 = up, w2 = down);
- **fused**: ``<layer>.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``…down_proj`` ``[E, H, I]``
  (plus ``…_bias`` stacks for biased families), stored exactly as the module holds them.

Checkpoint keys are first passed through transformers' own renaming rules for the model
(``block_sparse_moe`` → ``mlp`` and the like) by :mod:`moetray.engine.experts.loader`, which
hands this module ``(file, key, model_key)`` triples.

:class:`QuantizedExpertStore` is the same tier for quantized checkpoints (GGUF, MXFP4, FP8): a
bank row is one expert's *stored* bytes (:class:`~moetray.engine.experts.codecs.RowCodec` says how
they decode), so host memory holds the file's blocks, never a full-precision copy, and a slot
fill moves those bytes and decodes them where the slot is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from moetray.engine.experts.codecs import EncodedRow, RowCodec
from moetray.policy.refused import Refused

__all__ = [
    "ExpertGeometry",
    "QuantizedExpertStore",
    "ExpertStore",
    "ExpertStoreError",
    "Segment",
    "StoreLayer",
]

# Per-expert checkpoint names → the fused parameter they belong to, and their part in it.
_PER_EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0),  # Mixtral legacy names
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
}
ROW_ALIGN = 32
"""Segments start at multiples of this many elements (128 B in fp32, 64 B in bf16): the GEMM
kernels then see the same alignment as a freshly allocated stock weight, which keeps fp32
results bit-identical to the stock implementation."""
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.+)\.(?P<expert>\d+)\.(?P<part>[A-Za-z0-9_]+)\.weight$")


class ExpertStoreError(Refused, RuntimeError):
    """A checkpoint the store cannot read; ``kind`` names why (snake_case)."""


@dataclass(frozen=True)
class Segment:
    """One parameter of an expert inside its packed row: ``row[offset:offset+numel].view(shape)``."""

    name: str  # the Experts module's parameter name, e.g. "gate_up_proj"
    shape: tuple[int, ...]  # one expert's slice of that parameter
    offset: int
    numel: int


@dataclass(frozen=True)
class ExpertGeometry:
    """How one expert is laid out in a row, read from the transformers Experts module's flags."""

    segments: tuple[Segment, ...]
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool

    @property
    def row_numel(self) -> int:
        """Elements per packed row, padding included (every segment starts aligned)."""
        last = self.segments[-1]
        return last.offset + _aligned(last.numel)

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> ExpertGeometry:
        """The packed-row layout of ``module`` (an Experts module, possibly on ``meta``)."""
        has_gate = bool(getattr(module, "has_gate", True))
        has_bias = bool(getattr(module, "has_bias", False))
        names = ["gate_up_proj" if has_gate else "up_proj"]
        if has_bias:
            names.append(names[0] + "_bias")
        names.append("down_proj")
        if has_bias:
            names.append("down_proj_bias")
        segments, offset = [], 0
        for name in names:
            param = getattr(module, name, None)
            if param is None:
                raise ExpertStoreError("unsupported_experts_module",
                                       f"{type(module).__name__} has no parameter {name!r}")
            shape = tuple(param.shape[1:])
            numel = math.prod(shape)
            segments.append(Segment(name, shape, offset, numel))
            offset += _aligned(numel)
        return cls(tuple(segments), has_gate, has_bias,
                   bool(getattr(module, "is_transposed", False)),
                   bool(getattr(module, "is_concatenated", True)))


@dataclass
class StoreLayer:
    """One MoE layer as the store sees it: where its experts live in the checkpoint."""

    index: int  # dense MoE-layer index (0 … num_layers-1), the runtime's layer id
    module_name: str  # the Experts module's name in the model, e.g. "model.layers.3.mlp.experts"
    num_experts: int
    geometry: ExpertGeometry
    # Filled by ExpertStore.index(): segment name → (file, key) for fused stacks, or
    # (segment name, expert) → list of (part, file, key) for per-expert tensors.
    fused: dict[str, tuple[Path, str]] = field(default_factory=dict)
    per_expert: dict[tuple[str, int], list[tuple[int, Path, str]]] = field(default_factory=dict)

    @property
    def layout(self) -> str:
        return "fused" if self.fused else "per_expert"


class ExpertStore:
    """The host tier: ``banks[layer]`` is a ``[num_experts, row_numel]`` host tensor.

    Built once at load (:meth:`build`); afterwards read-only. ``row(layer, expert)`` is the
    packed row a miss copies; ``weights(layer, expert)`` views it as the module's tensors.
    """

    quantized = False

    def __init__(self, layers: Sequence[StoreLayer], banks: list[torch.Tensor], dtype: torch.dtype,
                 pinned: bool):
        self.layers = list(layers)
        self.banks = banks
        self.dtype = dtype
        self.pinned = pinned
        geoms = {layer.geometry.row_numel for layer in self.layers}
        if len(geoms) != 1:
            raise ExpertStoreError("mixed_geometry", f"MoE layers disagree on the expert size: {geoms}")
        self.row_numel = geoms.pop()
        self.num_experts = self.layers[0].num_experts
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    # --- construction ------------------------------------------------------------------

    @staticmethod
    def index(layers: Sequence[StoreLayer], entries: Iterable[tuple[Path, str, str]]) -> set[str]:
        """Attach every expert tensor among ``entries`` (file, checkpoint key, model key) to its layer.

        Mutates the layers' ``fused`` / ``per_expert`` maps. Returns the checkpoint keys that
        were claimed as expert tensors. Raises :class:`ExpertStoreError` (``mixed_layout``)
        when one layer mixes fused and per-expert tensors.
        """
        by_module = {layer.module_name: layer for layer in layers}
        claimed: set[str] = set()
        for path, key, model_key in entries:
            owner, _, rest = model_key.rpartition(".")
            layer = by_module.get(owner)
            if layer is not None and any(seg.name == rest for seg in layer.geometry.segments):
                layer.fused[rest] = (path, key)
                claimed.add(key)
                continue
            match = _PER_EXPERT_RE.match(model_key)
            if match is None or match["prefix"] not in by_module:
                continue
            layer = by_module[match["prefix"]]
            part = _PER_EXPERT_PARTS.get(match["part"])
            if part is None:
                raise ExpertStoreError("unsupported_layout",
                                       f"unknown per-expert tensor {key!r} for {layer.module_name}")
            seg_name, position = part
            layer.per_expert.setdefault((seg_name, int(match["expert"])), []).append((position, path, key))
            claimed.add(key)
        for layer in layers:
            if layer.fused and layer.per_expert:
                raise ExpertStoreError("mixed_layout",
                                       f"{layer.module_name} mixes fused and per-expert tensors")
        return claimed

    @classmethod
    def build(cls, layers: Sequence[StoreLayer], *, dtype: torch.dtype, pin: bool = False,
              progress=None) -> ExpertStore:
        """Read and pack every expert of ``layers`` into host banks (pinned when ``pin``).

        ``progress(done_layers, total_layers)`` is called after each layer. Raises
        :class:`ExpertStoreError` when an expert tensor is missing or has the wrong shape;
        nothing is kept from a failed build.
        """
        banks: list[torch.Tensor] = []
        handles: dict[Path, object] = {}

        def open_file(path: Path):
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt", device="cpu")
            return handles[path]

        for done, layer in enumerate(layers, start=1):
            geo = layer.geometry
            bank = torch.empty((layer.num_experts, geo.row_numel), dtype=dtype, pin_memory=pin)
            if geo.row_numel != sum(seg.numel for seg in geo.segments):
                bank.zero_()  # padding between segments: zeros, so rows compare deterministically
            if layer.fused:
                cls._fill_fused(bank, layer, open_file)
            elif layer.per_expert:
                cls._fill_per_expert(bank, layer, open_file)
            else:
                raise ExpertStoreError("missing_expert_tensor",
                                       f"no expert tensors found for {layer.module_name}")
            banks.append(bank)
            if progress is not None:
                progress(done, len(layers))
        return cls(layers, banks, dtype, pin)

    @staticmethod
    def _fill_fused(bank: torch.Tensor, layer: StoreLayer, open_file) -> None:
        for seg in layer.geometry.segments:
            if seg.name not in layer.fused:
                raise ExpertStoreError("missing_expert_tensor", f"{layer.module_name}.{seg.name} not found")
            path, key = layer.fused[seg.name]
            sl = open_file(path).get_slice(key)
            shape = tuple(sl.get_shape())
            if shape != (layer.num_experts, *seg.shape):
                raise ExpertStoreError("shape_mismatch",
                                       f"{key}: {shape} on disk, expected {(layer.num_experts, *seg.shape)}")
            for expert in range(layer.num_experts):
                # get_slice reads only this expert's bytes from the memory-mapped file.
                part = sl[expert:expert + 1]
                bank[expert, seg.offset:seg.offset + seg.numel].copy_(part.reshape(-1))

    @staticmethod
    def _fill_per_expert(bank: torch.Tensor, layer: StoreLayer, open_file) -> None:
        geo = layer.geometry
        if geo.is_transposed or not geo.is_concatenated or not geo.has_gate or geo.has_bias:
            raise ExpertStoreError(
                "unsupported_layout",
                f"{layer.module_name}: per-expert checkpoints are read only for concatenated, "
                "non-transposed, gated experts without bias; store this model's experts fused")
        for seg in geo.segments:
            parts_expected = 2 if seg.name == "gate_up_proj" else 1
            for expert in range(layer.num_experts):
                parts = sorted(layer.per_expert.get((seg.name, expert), []))
                if [p for p, _, _ in parts] != list(range(parts_expected)):
                    raise ExpertStoreError("missing_expert_tensor",
                                           f"{layer.module_name}.{expert}: {seg.name} parts {parts}")
                # Concatenation along dim 0 of row-major [I, H] blocks is back-to-back placement.
                offset = seg.offset
                for _, path, key in parts:
                    sl = open_file(path).get_slice(key)
                    shape = tuple(sl.get_shape())
                    want_rows = seg.shape[0] // parts_expected
                    if shape != (want_rows, *seg.shape[1:]):
                        want = (want_rows, *seg.shape[1:])
                        raise ExpertStoreError("shape_mismatch", f"{key}: {shape} on disk, expected {want}")
                    numel = math.prod(shape)
                    bank[expert, offset:offset + numel].copy_(sl[:].reshape(-1))
                    offset += numel

    # --- reads ---------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (what the plan executor checks a fill against)."""
        return self.row_numel * self.dtype.itemsize

    @property
    def slot_dtype(self) -> torch.dtype:
        """The slot pool's element type (the packed row's: ``dtype``, unless a subclass packs bytes)."""
        return self.dtype

    @property
    def slot_bytes(self) -> int:
        """Device bytes one slot holds: one expert's packed full-precision row."""
        return self.row_numel * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.banks)

    @property
    def format(self) -> str:
        """What the experts are stored as (``expert_store_format``): the dtype's ggml-style name."""
        return _DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch."))

    def decoded_row(self, layer: int, expert: int) -> torch.Tensor:
        """``(layer, expert)``'s packed full-precision row (for integrity checks)."""
        return self.row(layer, expert)

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """The packed row of ``(layer, expert)`` (a view into the bank; do not write)."""
        return self.banks[layer][expert]

    def weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """``(layer, expert)`` as the module's per-expert tensors (views into the bank, cached)."""
        views = self._views.get((layer, expert))
        if views is None:
            views = self._views[(layer, expert)] = unpack_row(self.row(layer, expert),
                                                              self.layers[layer].geometry)
        return views

    def banks_replaced(self) -> None:
        """Drop cached views after ``banks`` entries were swapped (e.g. for pinned copies)."""
        self._views.clear()


_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class QuantizedExpertStore(ExpertStore):
    """The host tier of a quantized checkpoint: ``banks[layer]`` is ``[num_experts, row_bytes]``
    ``uint8``, each row one expert's stored bytes (its parts as the file holds them, then zero
    padding up to the widest layer's row: a Q4_K_M file stores some layers' ``down`` in Q6_K).

    ``row(layer, expert)`` is an :class:`~moetray.engine.experts.codecs.EncodedRow` (a slot fill
    moves its ``link_bytes`` and decodes them in the slot); ``weights(layer, expert)`` decodes a
    fresh full-precision copy for the CPU path and keeps none. ``dtype`` is the decoded dtype.
    """

    quantized = True

    def __init__(self, layers: Sequence[StoreLayer], banks: list[torch.Tensor], codecs: Sequence[RowCodec],
                 dtype: torch.dtype, pinned: bool):
        self.codecs = list(codecs)
        super().__init__(layers, banks, dtype, pinned)
        for layer, codec in zip(self.layers, self.codecs, strict=True):
            if codec.decoded_numel != layer.geometry.row_numel:
                raise ExpertStoreError("shape_mismatch",
                                       f"{layer.module_name}: experts decode to {codec.decoded_numel} "
                                       f"values, the module holds {layer.geometry.row_numel}")

    @classmethod
    def build_quantized(cls, layers: Sequence[StoreLayer], codecs: Sequence[RowCodec], read_part, *,
                        dtype: torch.dtype, pin: bool = False, progress=None) -> QuantizedExpertStore:
        """Copy every expert's stored bytes into host banks (pinned when ``pin``).

        ``read_part(layer_index, part_index)`` returns that part of every expert of the layer as
        ``uint8`` ``[num_experts, part.nbytes]`` (a view of the memory-mapped file: one copy per part
        per layer). Raises :class:`ExpertStoreError` ``shape_mismatch`` for a part of another size.
        """
        width = max(codec.stored_bytes for codec in codecs)
        banks = []
        for done, (layer, codec) in enumerate(zip(layers, codecs, strict=True), start=1):
            bank = torch.zeros((layer.num_experts, width), dtype=torch.uint8, pin_memory=pin)
            for index, part in enumerate(codec.parts):
                data = read_part(layer.index, index)
                if tuple(data.shape) != (layer.num_experts, part.nbytes):
                    want = (layer.num_experts, part.nbytes)
                    raise ExpertStoreError("shape_mismatch",
                                           f"{layer.module_name} part {index} ({part.label}): "
                                           f"{tuple(data.shape)} bytes, expected {want}")
                bank[:, part.src:part.src + part.nbytes].copy_(data)
            banks.append(bank)
            if progress is not None:
                progress(done, len(layers))
        return cls(layers, banks, codecs, dtype, pin)

    @property
    def row_bytes(self) -> int:
        return self.banks[0].shape[1]

    @property
    def format(self) -> str:
        """The stored types, most bytes first, joined by ``+`` (``Q4_K+Q6_K+F32``)."""
        counts: dict[str, int] = {}
        for codec in self.codecs:
            for label, nbytes in codec.bytes_by_label().items():
                counts[label] = counts.get(label, 0) + nbytes
        return "+".join(sorted(counts, key=lambda label: (-counts[label], label)))

    # A slot fill takes the encoded bytes; the base's readers of a Tensor row (weights,
    # decoded_row) are overridden below, so no caller of this store sees the wider type.
    def row(self, layer: int, expert: int) -> EncodedRow:  # type: ignore[override]
        return EncodedRow(self.banks[layer][expert], self.codecs[layer])

    def link_bytes(self, layer: int) -> int:
        """Bytes one expert of ``layer`` moves on a slot fill."""
        return self.codecs[layer].stored_bytes

    def decoded_row(self, layer: int, expert: int) -> torch.Tensor:
        return self.codecs[layer].decode(self.banks[layer][expert], self.dtype)

    def weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """A freshly decoded copy of ``(layer, expert)`` as the module's tensors (not cached)."""
        return unpack_row(self.decoded_row(layer, expert), self.layers[layer].geometry)


def _aligned(numel: int) -> int:
    return -(-numel // ROW_ALIGN) * ROW_ALIGN


def unpack_row(row: torch.Tensor, geometry: ExpertGeometry) -> dict[str, torch.Tensor]:
    """Views of one packed row as ``{segment name: tensor of the segment's shape}``; of a pool's
    rows ``[capacity, row_numel]``, each segment gets the leading ``capacity`` dimension."""
    lead = row.shape[:-1]
    return {seg.name: row[..., seg.offset:seg.offset + seg.numel].view(*lead, *seg.shape)
            for seg in geometry.segments}
