"""GGUF checkpoints: finding the file(s), reading the config from the metadata, loading with the
experts kept in their blocks.

``moetray serve --model`` accepts a ``.gguf`` file, a folder holding one, or the first file of a
split set (``…-00001-of-0000N.gguf``). Headers are read through transformers' GGUF reader
(:mod:`moetray.engine.models.hf`); the config is built here from the metadata (transformers'
legacy mapping takes qwen2moe/qwen3moe expert sizes from defaults and assumes attention biases).
Families: qwen2moe, qwen3moe, gpt-oss, llama files with ``ffn_*_exps`` tensors (Mixtral), and
qwen35moe (Qwen3.5/3.6-MoE, hybrid: its config is transformers' own reading of the metadata and its
converter's transforms are undone by :mod:`moetray.engine.models.gguf_qwen35`). Non-expert
weights are dequantized at load (gguf-py's arithmetic, bit for bit); the routed experts go to a
:class:`~moetray.engine.experts.store.QuantizedExpertStore` as the file's blocks. The tokenizer and
chat template come from the metadata (``AutoTokenizer.from_pretrained(…, gguf_file=…)``).

Refusals (:class:`~moetray.engine.models.checkpoint.CheckpointError`): ``unreadable_checkpoint``
(truncated or corrupt file, missing part of a split set; names the file), ``unsupported_quant_type``
(names the type and a tensor), ``unsupported_family`` (architecture), ``not_moe`` (dense model).
"""

from __future__ import annotations

import copy
import logging
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetray.engine.models import gguf_qwen35 as qwen35
from moetray.engine.models.files import CheckpointError, gguf_files
from moetray.engine.models.hf import GgufHeader, GgufTensor, native_config_fields, read_header

__all__ = ["GgufCheckpoint", "load_gguf", "load_gguf_tokenizer", "read_gguf"]

log = logging.getLogger(__name__)

MOE_FAMILIES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "llama": "mixtral",
    "gpt-oss": "gpt_oss",
    "qwen35moe": "qwen3_5_moe_text",
}
GGUF_ARCH = {
    "qwen2moe": "QWEN2MOE",
    "qwen3moe": "QWEN3MOE",
    "llama": "LLAMA",
    "gpt-oss": "GPT_OSS",
    "qwen35moe": "QWEN35MOE",
}
"""gguf-py's ``MODEL_ARCH`` member of each mapped architecture (its tensor-name map)."""
ARCHITECTURES = {
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "llama": "MixtralForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
}
GPT_OSS_SWIGLU: dict[str, Any] = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # config keyword arguments
"""gpt-oss's clamped SwiGLU as llama.cpp computes it: constants of its graph, not metadata."""
MAPPED = "qwen2moe, qwen3moe, qwen35moe, gpt-oss, llama/Mixtral"
DENSE_FAMILIES = {"qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral", "falcon"}


@dataclass
class GgufCheckpoint:
    """What a GGUF model is, read from its headers alone."""

    files: list[Path]
    metadata: dict
    tensors: dict[str, GgufTensor]
    arch: str
    config: Any  # a transformers config built from the metadata

    @property
    def path(self) -> Path:
        return self.files[0]

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    @property
    def matrix_types(self) -> frozenset[int]:
        """The ggml types of the file's matrices (its tensors of two dimensions or more)."""
        return frozenset(t.ggml_type for t in self.tensors.values() if len(t.shape) >= 2)

    @property
    def float_dtype(self) -> str | None:
        """The dtype a file of plain floats names, as a config's ``dtype`` does: ``"float16"`` where
        its matrices are F16 (the F32 ones aside: converters keep routers F32 in any file), likewise
        ``"bfloat16"``, ``"float32"`` where every one is F32; None where any is quantized (its values
        have no exact 16-bit form)."""
        import torch

        from moetray.engine.experts.codecs import PLAIN_TYPES

        types = self.matrix_types
        if not types or not types <= PLAIN_TYPES.keys():
            return None
        narrow = {PLAIN_TYPES[t] for t in types} - {torch.float32}
        if len(narrow) > 1:
            return None
        return str(narrow.pop() if narrow else torch.float32).removeprefix("torch.")

    def float16_tensors(self) -> Iterator[torch.Tensor]:
        """The file's F16 tensors as float16 views of its memory map, one at a time (no copy)."""
        from moetray.engine.experts.codecs import PLAIN_TYPES, ggml_nbytes

        files = _Files()
        for t in self.tensors.values():
            if PLAIN_TYPES.get(t.ggml_type) is torch.float16:
                numel = int(np.prod(t.shape))
                yield files.view(t.path, t.offset, ggml_nbytes(t.ggml_type, numel)).view(torch.float16)

    @property
    def quantization(self) -> str | None:
        """The block types the file's quantized matrices are stored in, ``+``-joined and sorted
        (``"Q8_0"``, ``"Q4_K+Q6_K"``); None for a file of plain floats."""
        from moetray.engine.experts.codecs import PLAIN_TYPES, ggml_type_name

        return "+".join(sorted(ggml_type_name(t) for t in self.matrix_types - PLAIN_TYPES.keys())) or None


def _header(path: Path) -> GgufHeader:
    try:
        return read_header(path)
    except (ValueError, struct.error, IndexError, OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            "unreadable_checkpoint", f"{path}: not a readable GGUF file ({exc})", file=str(path)
        ) from exc


def read_headers(path: str | Path) -> tuple[list[Path], dict, dict[str, GgufTensor]]:
    """``(files, metadata of the first file, every tensor by name)``, checked whole: every tensor's
    bytes lie inside its file and every part of a split set is there. Reads no tensor data."""
    from moetray.engine.experts.codecs import ggml_nbytes

    files = gguf_files(path)
    headers = [_header(f) for f in files]
    metadata = headers[0].metadata
    tensors: dict[str, GgufTensor] = {}
    for header in headers:
        for t in header.tensors:
            try:
                end = t.offset + ggml_nbytes(t.ggml_type, int(np.prod(t.shape)))
            except (KeyError, ValueError):
                end = t.offset  # an unknown type: refused by name once the types are checked
            if end > header.file_bytes:
                raise CheckpointError(
                    "unreadable_checkpoint",
                    f"{header.path} is cut short: tensor {t.name} "
                    f"ends at byte {end}, the file has {header.file_bytes}",
                    file=str(header.path),
                )
            tensors[t.name] = t
    declared = metadata.get("split.tensors.count")
    if isinstance(declared, int) and declared != len(tensors):
        raise CheckpointError(
            "unreadable_checkpoint",
            f"{files[0]}: the split set declares {declared} tensors, its parts hold {len(tensors)}",
            file=str(files[0]),
        )
    return files, metadata, tensors


def refuse_unsupported_types(tensors: dict[str, GgufTensor]) -> None:
    """Refuses ``unsupported_quant_type`` naming the first tensor of a type moetray does not decode."""
    from moetray.engine.experts.codecs import SUPPORTED_GGML_TYPES, ggml_type_name

    for t in tensors.values():
        if t.ggml_type not in SUPPORTED_GGML_TYPES:
            name = ggml_type_name(t.ggml_type)
            raise CheckpointError(
                "unsupported_quant_type",
                f"tensor {t.name} is stored as {name}, which moetray "
                "does not decode (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K…Q6_K, "
                "MXFP4 are)",
                quant_type=name,
                tensor=t.name,
            )


def _moe_blocks(tensors: dict[str, GgufTensor], blocks: int) -> list[int]:
    return [i for i in range(blocks) if f"blk.{i}.ffn_gate_exps.weight" in tensors]


def gguf_config(arch: str, metadata: dict, tensors: dict[str, GgufTensor]):
    """The transformers config of a GGUF model, from its metadata and tensor shapes (a shape wins
    over a metadata key that disagrees). Refuses ``unsupported_family`` and ``not_moe``."""
    from transformers import GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    def key(name: str, default=None):
        return metadata.get(f"{arch}.{name}", default)

    blocks = key("block_count")
    if not isinstance(blocks, int):
        raise CheckpointError("unreadable_checkpoint", f"GGUF metadata names no {arch}.block_count")
    moe = _moe_blocks(tensors, blocks)
    if not moe and any(f"blk.{i}.ffn_gate_up_exps.weight" in tensors for i in range(blocks)):
        raise CheckpointError(
            "unsupported_family",
            f"this {arch} GGUF stores gate and up experts fused (ffn_gate_up_exps), which moetray "
            "does not map yet (files converted with them apart, ffn_gate_exps/ffn_up_exps, serve)",
            model_type=arch,
        )
    if not moe:
        if arch in MOE_FAMILIES or arch in DENSE_FAMILIES:
            raise CheckpointError(
                "not_moe",
                f"this {arch} GGUF has no expert tensors (ffn_*_exps): a dense "
                "model, which moetray does not serve",
                model_type=arch,
            )
        raise CheckpointError(
            "unsupported_family",
            f"GGUF architecture {arch} is not one moetray maps ({MAPPED})",
            model_type=arch,
        )
    if arch not in MOE_FAMILIES:
        raise CheckpointError(
            "unsupported_family",
            f"GGUF architecture {arch} is not one moetray maps ({MAPPED})",
            model_type=arch,
        )
    if arch == qwen35.ARCH:
        return qwen35.qwen35moe_config(metadata, tensors, native_config_fields(metadata, tuple(tensors)))
    first = moe[0]
    experts, inter, hidden = tensors[f"blk.{first}.ffn_gate_exps.weight"].shape
    vocab = tensors["token_embd.weight"].shape[0]
    heads = key("attention.head_count")
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        max_position_embeddings=key("context_length", 4096),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )
    top_k = key("expert_used_count")
    if key("expert_count", experts) != experts:
        log.warning(
            "GGUF says %s experts, its tensors hold %s; using the tensors", key("expert_count"), experts
        )
    dense = [i for i in range(blocks) if i not in moe]
    if arch == "llama":
        q = tensors[f"blk.{first}.attn_q.weight"].shape[0]
        return MixtralConfig(
            **common,
            head_dim=q // heads,
            intermediate_size=inter,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            sliding_window=None,
        )
    if arch == "gpt-oss":
        return GptOssConfig(
            **{**common, **_gpt_oss_attention(key, blocks)},
            head_dim=key("attention.key_length", hidden // heads),
            intermediate_size=inter,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            attention_bias=f"blk.{first}.attn_q.bias" in tensors,
            **GPT_OSS_SWIGLU,
        )
    ffn = tensors.get(f"blk.{dense[0]}.ffn_gate.weight") if dense else None
    dense_inter = ffn.shape[0] if ffn is not None else key("feed_forward_length", inter)
    if arch == "qwen2moe":
        shared = tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
        return Qwen2MoeConfig(
            **common,
            intermediate_size=dense_inter,
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=shared.shape[0] if shared is not None else 0,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=False,
            qkv_bias=f"blk.{first}.attn_q.bias" in tensors,
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            use_sliding_window=False,
        )
    q_norm = tensors.get(f"blk.{first}.attn_q_norm.weight")
    head_dim = q_norm.shape[0] if q_norm is not None else key("attention.key_length", hidden // heads)
    return Qwen3MoeConfig(  # type: ignore[call-arg]  # accepted: transformers' typed __init__ omits the head_dim it takes
        **common,
        head_dim=head_dim,
        intermediate_size=dense_inter,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        attention_bias=f"blk.{first}.attn_q.bias" in tensors,
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )


def gpt_oss_layer_types(blocks: int) -> list[str]:
    """llama.cpp's fixed pattern for gpt-oss: sliding and full attention alternate, layer 0 sliding."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(blocks)]


def _gpt_oss_attention(key: Callable, blocks: int) -> dict:
    """gpt-oss's sliding window, its layers' alternation and YaRN rope, as llama.cpp reads them:
    ``attention.sliding_window``, :func:`gpt_oss_layer_types`, ``rope.scaling.*``."""
    window = key("attention.sliding_window")
    rope: dict[str, Any] = {"rope_theta": float(key("rope.freq_base", 150000.0))}
    if key("rope.scaling.type") == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(key("rope.scaling.factor")),
            original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
            beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
            truncate=False,  # gpt-oss's own YaRN (its Hugging Face config says so)
        )
        if key("rope.scaling.yarn_attn_factor") is not None:
            rope["attention_factor"] = float(key("rope.scaling.yarn_attn_factor"))
    else:
        rope["rope_type"] = "default"
    return dict(
        sliding_window=window,
        layer_types=gpt_oss_layer_types(blocks) if window else ["full_attention"] * blocks,
        rope_parameters=rope,
    )


def read_gguf(path: str | Path) -> GgufCheckpoint:
    """Every fact about the GGUF model at ``path`` that needs no tensor data (see the refusals above)."""
    files, metadata, tensors = read_headers(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(
            "unreadable_checkpoint", f"{files[0]} names no general.architecture", file=str(files[0])
        )
    config = gguf_config(arch, metadata, tensors)
    refuse_unsupported_types(tensors)
    config.architectures = [ARCHITECTURES[arch]]
    return GgufCheckpoint(files, metadata, tensors, arch, config)


# --- loading ---------------------------------------------------------------------------------------


class _Files:
    """Memory maps of the files, opened once; ``bytes(t, start, n)`` is a ``uint8`` view (no copy)."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.ndarray] = {}

    def view(self, path: Path, start: int, nbytes: int) -> torch.Tensor:
        blob = self._maps.get(path)
        if blob is None:
            blob = self._maps[path] = np.memmap(path, mode="r", dtype=np.uint8)
        with warnings.catch_warnings():  # read-only map: torch warns it cannot be written (it never is)
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(blob[start : start + nbytes])


def _dequantized(files: _Files, t: GgufTensor) -> torch.Tensor:
    """A tensor's values in float32, shaped as the file's (torch order)."""
    from moetray.engine.experts.codecs import dequantize, ggml_nbytes

    numel = int(np.prod(t.shape))
    raw = files.view(t.path, t.offset, ggml_nbytes(t.ggml_type, numel))
    return dequantize(raw, t.ggml_type, torch.float32).view(t.shape)


def _reverse_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """Undo llama.cpp's converter's Q/K permutation (transformers' legacy loader does the same)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def tensor_name(names, key: str, arch: str) -> str | None:
    """The GGUF name llama.cpp's converter gives the model parameter ``key`` (``names``: gguf-py's
    tensor-name map of ``arch``), None when it has none. A bare parameter is ``NAME.weight``
    (gpt-oss's attention sinks) but for qwen35moe's, whose leaves :mod:`gguf_qwen35` names."""
    if arch == qwen35.ARCH and (bare := qwen35.tensor_name(key)) is not None:
        return bare
    whole = names.get_name(key)
    if whole is not None:
        return f"{whole}.weight"
    base, _, suffix = key.rpartition(".")
    name = names.get_name(base)
    return None if name is None else f"{name}.{suffix}"


def _non_expert_state(
    ck: GgufCheckpoint, model, files: _Files, dtype: torch.dtype, progress: Callable[[int, int], None]
) -> dict[str, torch.Tensor]:
    """Every non-expert parameter and persistent buffer of ``model``, dequantized from the file."""
    import gguf

    config = ck.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[ck.arch]], config.num_hidden_layers)
    wanted = []
    for key in model.state_dict():
        base, _, suffix = key.rpartition(".")
        if base.endswith(".experts") or (config.tie_word_embeddings and key == "lm_head.weight"):
            continue
        name = tensor_name(names, key, ck.arch)
        if name is None or name not in ck.tensors:
            continue  # missing_weights is raised by the assignment if a parameter stays empty
        wanted.append((key, ck.tensors[name]))
    state = {}
    meta = model.state_dict()
    for done, (key, t) in enumerate(wanted, start=1):
        values = _dequantized(files, t)
        if ck.arch == "llama" and t.name.endswith("attn_q.weight"):
            values = _reverse_permute(values, config.num_attention_heads, config.num_attention_heads)
        elif ck.arch == "llama" and t.name.endswith("attn_k.weight"):
            values = _reverse_permute(values, config.num_attention_heads, config.num_key_value_heads)
        elif ck.arch == qwen35.ARCH:
            values = qwen35.from_file(t.name, values, config)
        target = meta[key]
        if tuple(values.shape) != tuple(target.shape):
            if values.numel() != target.numel():
                raise CheckpointError(
                    "unreadable_checkpoint",
                    f"{t.name}: {tuple(values.shape)} in the file, the model needs {tuple(target.shape)}",
                    file=str(t.path),
                )
            values = values.reshape(target.shape)  # the shared-expert gate: [H] in GGUF, [1, H] here
        state[key] = values.to(dtype).clone()
        progress(done, len(wanted))
    return state


def _expert_targets(geo) -> dict[str, tuple[tuple[int, ...], Callable]]:
    """Each GGUF expert tensor of a layer (``ffn_gate_exps.weight`` …, ``.bias`` where the module
    has biases) → one expert's shape in the file and where its values go in the packed row.

    The file always holds gate and up apart, ``[I, H]``, and down ``[H, I]``; the module may hold
    them transposed (gpt-oss: ``gate_up_proj`` ``[H, 2I]``, ``down_proj`` ``[I, H]``) and gate and
    up interleaved (gpt-oss: gate in the even columns, up in the odd) rather than concatenated."""
    seg = {s.name: s for s in geo.segments}
    gate_up, down = seg["gate_up_proj"], seg["down_proj"]
    transposed = geo.is_transposed
    inter = gate_up.shape[-1 if transposed else 0] // 2
    hidden = gate_up.shape[0 if transposed else 1]
    if geo.is_concatenated:
        halves = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
    else:
        halves = {"gate": slice(0, None, 2), "up": slice(1, None, 2)}

    def into(segment, pick=slice(None), transpose: bool = False) -> Callable:
        def place(out: torch.Tensor, values: torch.Tensor) -> None:
            view = out[segment.offset : segment.offset + segment.numel].view(segment.shape)
            view[pick].copy_(values.T if transpose else values)

        return place

    targets: dict[str, tuple[tuple[int, ...], Callable[..., Any]]] = {}
    for half, cut in halves.items():
        pick = (slice(None), cut) if transposed else cut
        targets[f"ffn_{half}_exps.weight"] = ((inter, hidden), into(gate_up, pick, transposed))
        if geo.has_bias:
            targets[f"ffn_{half}_exps.bias"] = ((inter,), into(seg["gate_up_proj_bias"], cut))
    targets["ffn_down_exps.weight"] = ((hidden, inter), into(down, transpose=transposed))
    if geo.has_bias:
        targets["ffn_down_exps.bias"] = ((hidden,), into(seg["down_proj_bias"]))
    return targets


def _expert_codecs(ck: GgufCheckpoint, store_layers, moe_blocks: list[int]):
    """Per MoE layer, the :class:`RowCodec` of one expert (every expert tensor of the block as the
    file stores it: gate, up, down and, for gpt-oss, their biases) and the reader of each part's
    bytes for every expert of the layer."""
    from moetray.engine.experts.codecs import Part, RowCodec, ggml_decoder, ggml_type_name
    from moetray.engine.experts.store import ExpertStoreError

    codecs, sources = [], []
    for layer, block in zip(store_layers, moe_blocks, strict=True):
        geo = layer.geometry
        if not geo.has_gate:
            raise ExpertStoreError(
                "unsupported_layout", f"{layer.module_name}: only gated experts are mapped from GGUF"
            )
        parts, layer_sources, src = [], [], 0
        for stem, (shape, place) in _expert_targets(geo).items():
            t = ck.tensors.get(f"blk.{block}.{stem}")
            if t is None or tuple(t.shape) != (layer.num_experts, *shape):
                got = None if t is None else tuple(t.shape)
                raise ExpertStoreError(
                    "shape_mismatch",
                    f"blk.{block}.{stem}: {got} in the file, expected {(layer.num_experts, *shape)}",
                )
            decode, nbytes = ggml_decoder(t.ggml_type, shape)
            parts.append(Part(src, nbytes, decode, place, ggml_type_name(t.ggml_type)))
            layer_sources.append((t, nbytes))
            src += nbytes
        codecs.append(RowCodec(parts, geo.row_numel))
        sources.append(layer_sources)
    return codecs, sources


def load_gguf(
    ck: GgufCheckpoint,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str, int, int | None], None] | None = None,
):
    """Build ``ck``'s model (non-expert weights dequantized onto ``device``) and its quantized expert
    store. Returns ``(model, store, experts modules)`` for
    :func:`moetray.engine.experts.offload_loaded`."""
    from moetray.engine.experts.loader import (
        assign_non_expert_weights,
        build_skeleton,
        expert_modules,
        store_layers_of,
    )
    from moetray.engine.experts.store import QuantizedExpertStore

    def report(stage: str, done: int, total: int | None) -> None:
        if progress is not None:
            progress(stage, done, total)

    report("building model skeleton", 0, None)
    model = build_skeleton(None, dtype, copy.deepcopy(ck.config))  # the runtime marks its config
    experts = expert_modules(model)
    store_layers = store_layers_of(experts)
    moe_blocks = _moe_blocks(ck.tensors, ck.config.num_hidden_layers)
    if len(moe_blocks) != len(store_layers):
        raise CheckpointError(
            "unreadable_checkpoint",
            f"{len(moe_blocks)} GGUF blocks hold experts, the model has {len(store_layers)} MoE layers",
            file=str(ck.path),
        )
    files = _Files()
    state = _non_expert_state(
        ck, model, files, dtype, lambda d, t: report("loading non-expert weights", d, t)
    )
    assign_non_expert_weights(model, state, [mod for _, mod in experts], device)
    del state
    codecs, sources = _expert_codecs(ck, store_layers, moe_blocks)

    def read_part(layer: int, part: int) -> torch.Tensor:
        t, nbytes = sources[layer][part]
        return files.view(t.path, t.offset, t.shape[0] * nbytes).view(t.shape[0], nbytes)

    report("building expert store", 0, len(store_layers))
    store = QuantizedExpertStore.build_quantized(
        store_layers,
        codecs,
        read_part,
        dtype=dtype,
        progress=lambda d, t: report("building expert store", d, t),
    )
    return model, store, [mod for _, mod in experts]


def load_gguf_tokenizer(ck: GgufCheckpoint):
    """The tokenizer and chat template from the metadata, converted by transformers.

    gpt-oss has no tokenizer class of its own, so the fast tokenizer (the one ``AutoTokenizer``
    picks) is asked directly: ``AutoTokenizer`` first reads a gpt-oss file's config through
    transformers' legacy mapping, which fails on the ``rope.scaling.*`` keys llama.cpp writes."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loader = PreTrainedTokenizerFast if ck.arch == "gpt-oss" else AutoTokenizer
    return loader.from_pretrained(ck.path.parent, gguf_file=ck.path.name)
