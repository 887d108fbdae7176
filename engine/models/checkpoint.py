"""What a checkpoint folder is, and loading it through the offloading experts runtime.

``inspect_checkpoint`` reads only the config, the tokenizer and the optional ``moetray.json``
sidecar (``label``, ``default_top_k``): enough to price the pools before any weight moves.
``load_checkpoint`` then loads the model with its experts in the host store and a slot pool
on the device (``moetray.engine.experts.load_offloaded_model``), and applies the chosen
top-k. Progress is reported as ``(stage, done, total)``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetray.engine.models.files import CheckpointError

log = logging.getLogger("moetray.engine.models.checkpoint")

SIDECAR = "moetray.json"
Progress = Callable[[str, int, int | None], None]


def _first_int(obj: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    model_id: str
    architecture: str
    label: str
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    default_top_k: int
    top_k_adjustable: bool
    expert_intermediate: int
    hidden_size: int
    context_length: int | None
    sidecar: dict[str, Any] = field(default_factory=dict)
    config: Any = None  # the transformers config read from config.json (or built from GGUF metadata)
    format: str = "safetensors"  # or "gguf"
    gguf: Any = None  # the moetray.engine.models.gguf.GgufCheckpoint of a GGUF model

    @property
    def max_moe_slots(self) -> int:
        return self.moe_layers * self.num_experts


def _moe_layer_count(text) -> int:
    layers = text.num_hidden_layers
    dense = set(getattr(text, "mlp_only_layers", None) or [])
    step = getattr(text, "decoder_sparse_step", 1) or 1
    first_dense = getattr(text, "first_k_dense_replace", 0) or 0
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense)


def _refuse_quantized(config) -> None:
    """The experts loader's ``quantized_checkpoint`` refusal (GPTQ, AWQ, bitsandbytes, …; MXFP4 and
    fine-grained FP8 are served), as a :class:`CheckpointError`."""
    from moetray.engine.experts.loader import LoaderError, refuse_quantized

    try:
        refuse_quantized(config)
    except LoaderError as exc:
        raise CheckpointError(exc.kind, str(exc), **exc.fields) from exc


def _refuse_unservable_layers(config) -> None:
    """``cb.refuse_unservable_layers`` as a :class:`CheckpointError` (``unsupported_layers``)."""
    from moetray.engine.cb import UnsupportedLayers, refuse_unservable_layers

    try:
        refuse_unservable_layers(config)
    except UnsupportedLayers as exc:
        raise CheckpointError(exc.kind, str(exc), **exc.fields) from exc


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Reads a checkpoint folder's config and sidecar; loads no weights. Raises ``CheckpointError``
    (``not_a_checkpoint``, ``unreadable_config``, ``quantized_checkpoint``, ``not_moe``,
    ``unsupported_layers``: a layer type the engine cannot serve, such as another family's
    recurrent blocks)."""
    from transformers import AutoConfig

    from moetray.engine.models.files import is_gguf_path

    if is_gguf_path(path):
        return _inspect_gguf(Path(path).expanduser().resolve())
    root = Path(path).expanduser().resolve()
    if not (root / "config.json").is_file():
        raise CheckpointError("not_a_checkpoint", f"{root} has no config.json")
    try:
        config = AutoConfig.from_pretrained(root)
    except Exception as exc:
        raise CheckpointError("unreadable_config", f"{root}/config.json: {exc}") from exc
    _refuse_quantized(config)
    text = config.get_text_config()
    num_experts = _first_int(text, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _first_int(text, "num_experts_per_tok", "moe_topk", "top_k")
    inter = _first_int(text, "moe_intermediate_size", "intermediate_size")
    if num_experts is None or top_k is None or inter is None:
        raise CheckpointError("not_moe", f"{root} is not a mixture-of-experts checkpoint (no expert count)")
    _refuse_unservable_layers(config)
    sidecar: dict[str, Any] = {}
    if (root / SIDECAR).is_file():
        sidecar = json.loads((root / SIDECAR).read_text())
    default_top_k = sidecar.get("default_top_k")
    adjustable = sidecar.get("top_k_adjustable", True) is not False
    if not (adjustable and isinstance(default_top_k, int) and 1 <= default_top_k <= num_experts):
        default_top_k = top_k
    arch = (config.architectures or [type(config).__name__])[0]
    label = sidecar.get("label") or f"{arch} ({num_experts} experts, top-{default_top_k})"
    if text is not config and not sidecar.get("label"):
        label += ", text only"  # a multimodal checkpoint: its language model is what is served
    return CheckpointInfo(
        path=root,
        model_id=sidecar.get("model_id") or root.name,
        architecture=arch,
        label=label,
        num_layers=text.num_hidden_layers,
        moe_layers=_moe_layer_count(text),
        num_experts=num_experts,
        top_k=top_k,
        default_top_k=default_top_k,
        top_k_adjustable=adjustable,
        expert_intermediate=inter,
        hidden_size=text.hidden_size,
        context_length=_first_int(text, "max_position_embeddings"),
        sidecar=sidecar,
        config=config,
    )


def _inspect_gguf(path: Path) -> CheckpointInfo:
    """A GGUF model's facts from its headers (``moetray.engine.models.gguf.read_gguf``'s refusals)."""
    from moetray.engine.models.files import SPLIT_RE
    from moetray.engine.models.gguf import read_gguf

    ck = read_gguf(path)
    text = ck.config.get_text_config()
    num_experts = _first_int(text, "num_experts", "num_local_experts")
    top_k = _first_int(text, "num_experts_per_tok")
    inter = _first_int(text, "moe_intermediate_size", "intermediate_size")
    if num_experts is None or top_k is None or inter is None:
        raise CheckpointError("not_moe", f"{path} is not a mixture-of-experts model (no expert count)")
    first = ck.files[0].name
    m = SPLIT_RE.match(first)
    model_id = m["stem"] if m else first.removesuffix(".gguf")
    name = ck.metadata.get("general.name")
    label = f"{name or model_id} (GGUF {ck.arch}, {num_experts} experts, top-{top_k})"
    return CheckpointInfo(
        path=ck.path, model_id=model_id, architecture=ck.config.architectures[0], label=label,
        num_layers=text.num_hidden_layers, moe_layers=_moe_layer_count(text), num_experts=num_experts,
        top_k=top_k, default_top_k=top_k, top_k_adjustable=True,
        expert_intermediate=inter,
        hidden_size=text.hidden_size, context_length=_first_int(text, "max_position_embeddings"),
        config=ck.config, format="gguf", gguf=ck)


def resolve_device(spec: str) -> torch.device:
    """``auto`` → the first CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError("no_cuda", "--device cuda was asked for but no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def serving_format(spec: str, info: CheckpointInfo, device: torch.device):
    """The format ``--dtype spec`` serves this checkpoint in on ``device``
    (:func:`moetray.engine.models.precision.resolve_format`; ``auto``: the checkpoint's 16-bit
    dtype where the device computes it, else float32 on the CPU). A GGUF file of plain floats names
    its dtype by its matrices' type (:attr:`~moetray.engine.models.gguf.GgufCheckpoint.float_dtype`);
    a quantized one its block types (:attr:`~moetray.engine.models.gguf.GgufCheckpoint.quantization`):
    int8 or bfloat16 on a CPU that computes bfloat16, else float32; bfloat16 on a GPU. A float16
    checkpoint's values are read where the rule asks whether they are all bfloat16 values."""
    from moetray.engine.models.precision import resolve_format

    if info.format == "gguf":
        gguf = info.gguf
        return resolve_format(spec, None, device, named_dtype=gguf.float_dtype, quantized=gguf.quantization,
                              float16_tensors=gguf.float16_tensors)
    return resolve_format(spec, info.path, device)


@dataclass
class LoadedModel:
    model: Any
    runtime: Any  # moetray.engine.experts.ExpertRuntime
    tokenizer: Any
    info: CheckpointInfo
    device: torch.device
    dtype: torch.dtype  # activations and KV cache (and the weights unless ``format`` quantizes them)
    top_k: int
    format: Any = None  # moetray.policy.precision.ServingFormat


def apply_top_k(model, runtime, top_k: int) -> None:
    """Route every token to ``top_k`` experts: the routers, the config and the runtime agree."""
    text = model.config.get_text_config()
    for name in ("num_experts_per_tok", "moe_topk"):
        if hasattr(text, name):
            setattr(text, name, top_k)
    for module in model.modules():
        if type(module).__name__.endswith("Router") and hasattr(module, "top_k"):
            module.top_k = top_k
    runtime.top_k = top_k


def refuse_unpageable_attention(config) -> None:
    """Refuses a model whose attention caches what transformers' continuous batching cannot
    page, with :class:`CheckpointError` ``unsupported_attention``; pure, mutates nothing.

    Its paged cache (transformers 5.24) holds K and V of one shape, ``[kv heads, head_dim]``.
    DeepSeek's multi-head latent attention (V2, V2-Lite, V3: ``kv_lora_rank`` set) caches a
    compressed latent and a rotary key of two other widths instead, which fails on the first
    batch step. The experts runtime itself computes these models exactly (``generate``); the
    server, which decodes through continuous batching, cannot."""
    text = config.get_text_config()
    if getattr(text, "kv_lora_rank", None):
        raise CheckpointError(
            "unsupported_attention",
            f"{text.model_type} uses multi-head latent attention (kv_lora_rank "
            f"{text.kv_lora_rank}), whose compressed cache transformers' continuous batching "
            "cannot page; moetray serve cannot serve it",
            model_type=text.model_type,
        )


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_checkpoint(
    info: CheckpointInfo,
    *,
    device: torch.device,
    fmt,
    capacity: int,
    top_k: int,
    progress: Progress,
    link_gbps: float | None = None,
    policy: str | None = None,
    compile_decode: bool = False,
) -> LoadedModel:
    """Loads the model with its experts offloaded (``capacity`` device slots) in the serving format
    ``fmt`` (:func:`serving_format`) and applies ``top_k``.

    Refuses ``unsupported_attention`` (:func:`refuse_unpageable_attention`) before reading
    anything but the config; the experts loader's refusals pass through."""
    from moetray.engine.experts import load_offloaded_model, offload_loaded
    from moetray.engine.models.precision import apply_format, torch_dtype

    refuse_unpageable_attention(info.config)
    dtype = torch_dtype(fmt.compute)
    experts = "int8" if fmt.weights == "int8" else None  # else the experts stay in ``dtype``
    progress("loading tokenizer", 0, None)
    if info.format == "gguf":
        from moetray.engine.models.gguf import load_gguf, load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(info.gguf)
        model, store, modules = load_gguf(info.gguf, device=device, dtype=dtype, progress=progress)
        offloaded = offload_loaded(model, store, modules, device=device, capacity=capacity, policy=policy,
                                   link_gbps=link_gbps, expert_format=experts, compile_decode=compile_decode)
    else:
        tokenizer = load_tokenizer(info.path)
        offloaded = load_offloaded_model(
            info.path,
            device=device,
            dtype=dtype,
            capacity=capacity,
            policy=policy,
            link_gbps=link_gbps,
            progress=progress,
            expert_format=experts,
            compile_decode=compile_decode,
        )
    model = offloaded.model.eval()
    apply_format(fmt, model, device)
    if top_k != info.top_k:
        apply_top_k(model, offloaded.runtime, top_k)
    if model.generation_config is not None and tokenizer.eos_token_id is not None:
        if model.generation_config.eos_token_id is None:
            model.generation_config.eos_token_id = tokenizer.eos_token_id
    return LoadedModel(
        model=model,
        runtime=offloaded.runtime,
        tokenizer=tokenizer,
        info=info,
        device=device,
        dtype=dtype,
        top_k=top_k,
        format=fmt,
    )


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: the generation config's EOS ids, then the tokenizer's."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for value in eos if isinstance(eos, (list, tuple)) else [eos]:
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)
