"""Loading a checkpoint with its experts offloaded, or fully resident for comparison.

:func:`load_offloaded_model` never materialises the routed experts on the device, nor as
fused stacks anywhere: the model skeleton is built with every parameter on ``meta``
(buffers real), the non-expert tensors are read from the safetensors files and assigned,
and the expert tensors are read one expert at a time into the host store
(:mod:`moetray.engine.experts.store`). The Experts modules keep no weight parameters at
all (they are set to ``None``, so the stock implementation would fail loudly rather than
compute from garbage); the registered ``"moetray"`` implementation computes from the slot
pool and the store instead.

Checkpoint keys are mapped to model keys with transformers' own renaming rules for the
model (``get_model_conversion_mapping``: e.g. Mixtral's ``block_sparse_moe`` → ``mlp``),
which is the only piece of transformers' loading internals used here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from moetray.engine.experts.hf import key_renamer
from moetray.engine.experts.store import (
    ExpertGeometry,
    ExpertStore,
    ExpertStoreError,
    QuantizedExpertStore,
    StoreLayer,
)
from moetray.policy.refused import Refused

__all__ = [
    "LoaderError",
    "build_skeleton",
    "checkpoint_files",
    "expert_modules",
    "load_resident_model",
    "refuse_quantized",
    "resolve_device",
    "resolve_dtype",
]

log = logging.getLogger(__name__)
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LoaderError(Refused, RuntimeError):
    """A checkpoint folder that cannot be loaded; ``kind`` names why (snake_case)."""


def resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(checkpoint_dir: str | Path, dtype: torch.dtype | str | None) -> torch.dtype:
    """``dtype`` itself, or the config's ``dtype`` / ``torch_dtype``, or float32 when it names none."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype != "auto":
        return getattr(torch, dtype)
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, named) if isinstance(named, str) and hasattr(torch, named) else torch.float32


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (from its index when it has one)."""
    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise LoaderError("no_safetensors", f"{root} holds no .safetensors files")
    return files


def expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The Experts modules transformers' experts interface dispatches, in layer order."""
    found = [(name, mod) for name, mod in model.named_modules()
             if hasattr(mod, "_is_expert_parallel") and hasattr(mod, "is_concatenated")
             and hasattr(mod, "num_experts")]

    def layer_no(item):
        m = _LAYER_RE.search(item[0] + ".")
        return int(m.group(1)) if m else -1

    return sorted(found, key=layer_no)


def refuse_quantized(config) -> str | None:
    """The checkpoint's served quantization method (``"mxfp4"``, ``"fp8"`` with block scales) or
    None; refuses any other (GPTQ, AWQ, bitsandbytes, per-tensor FP8, …) with :class:`LoaderError`
    ``quantized_checkpoint``: their weights would need kernels or layouts the store does not read,
    and loading them as plain floats would compute garbage. Pure; mutates nothing."""
    from moetray.engine.experts.quantized_hf import quant_method

    try:
        return quant_method(config)
    except ValueError as exc:
        method = str(exc)
        raise LoaderError("quantized_checkpoint",
                          f"the checkpoint is quantized ({method}); moetray serves unquantized weights, "
                          "MXFP4 and fine-grained FP8: dequantize it first",
                          quant_method=method.split(" ")[0]) from exc


def build_skeleton(checkpoint_dir: str | Path | None, dtype: torch.dtype, config=None):
    """The model with every parameter on ``meta`` and its buffers real (on the CPU)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if config is None:
        assert checkpoint_dir is not None, "a skeleton needs a checkpoint folder or a config"
        config = AutoConfig.from_pretrained(checkpoint_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def load_skeleton_and_store(checkpoint_dir: str | Path, *, device: torch.device, dtype: torch.dtype,
                            pin: bool, progress: Callable[[str, int, int | None], None] | None = None):
    """Build the model (non-expert weights on ``device``) and the host expert store.

    Returns ``(model, store, layers)`` where ``layers`` are the Experts modules in MoE-layer
    order. The Experts modules' weight parameters are set to ``None``. Raises
    :class:`LoaderError` (``quantized_checkpoint`` and ``unsupported_family`` before any
    weight is read; ``missing_weights``) or
    :class:`~moetray.engine.experts.store.ExpertStoreError`.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    def report(stage: str, done: int, total: int | None) -> None:
        if progress is not None:
            progress(stage, done, total)

    report("building model skeleton", 0, None)
    config = AutoConfig.from_pretrained(checkpoint_dir)
    method = refuse_quantized(config)
    model = build_skeleton(checkpoint_dir, dtype, config)
    experts = expert_modules(model)
    if not experts:
        # A dense model, or an MoE family whose experts transformers computes in its own
        # forward (JetMoE, DBRX in 5.24): the runtime is only ever called through the experts
        # interface, so such a model would run with no expert weights at all.
        model_type = getattr(config, "model_type", None)
        raise LoaderError("unsupported_family",
                          f"{type(model).__name__} ({model_type}) keeps no experts behind transformers' "
                          "experts interface (use_experts_implementation); moetray cannot offload them",
                          model_type=model_type)
    store_layers = store_layers_of(experts)

    rename = key_renamer(model)
    files = checkpoint_files(checkpoint_dir)
    entries: list[tuple[Path, str, str]] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            entries += [(path, key, rename(key)) for key in fh.keys()]
    handles: dict[Path, object] = {}

    def open_file(path: Path):
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return handles[path]

    if method is None:
        claimed = ExpertStore.index(store_layers, entries)
    else:
        from moetray.engine.experts.quantized_hf import expert_sources

        codecs, read_part, claimed = expert_sources(method, config, store_layers, entries, open_file)
    scales = {key.removesuffix("_scale_inv"): (path, key) for path, key, _ in entries
              if method == "fp8" and key.endswith(".weight_scale_inv")}

    # Non-expert tensors: read straight onto the device, cast to the parameter's dtype.
    meta_sd = model.state_dict()
    wanted: dict[Path, list[tuple[str, str]]] = {}
    for path, key, model_key in entries:
        if key in claimed or key.endswith(".weight_scale_inv") and method == "fp8":
            continue
        if model_key in meta_sd:
            wanted.setdefault(path, []).append((key, model_key))
        else:
            log.debug("checkpoint tensor %s has no place in the model; ignored", key)
    total = sum(len(v) for v in wanted.values())
    done = 0
    state: dict[str, torch.Tensor] = {}
    load_device = "cpu" if device.type == "cpu" else str(device)
    for path, pairs in wanted.items():
        with safe_open(str(path), framework="pt", device=load_device) as fh:
            for key, model_key in pairs:
                target = meta_sd[model_key]
                tensor = fh.get_tensor(key)
                if key in scales:  # a fine-grained FP8 weight: dequantized at load
                    from moetray.engine.experts.quantized_hf import dequantize_fp8, fp8_block

                    spath, skey = scales[key]
                    scale = open_file(spath).get_tensor(skey)
                    block = fp8_block(config)
                    assert block is not None, "fine-grained FP8 scales come with the config's block size"
                    tensor = dequantize_fp8(tensor.cpu(), scale, block)
                converted = tensor.to(dtype=target.dtype)
                if load_device == "cpu" and converted.data_ptr() == tensor.data_ptr():
                    # Still a view of the memory-mapped file: at the file's byte offset (GEMM
                    # kernels take another path for unaligned operands) and in page-cache pages
                    # rather than the allocator's (huge-page backed) memory. Own a copy.
                    converted = converted.clone()
                state[model_key] = converted
                done += 1
        report("loading non-expert weights", done, total)
    assign_non_expert_weights(model, state, [mod for _, mod in experts], device)
    del state

    report("building expert store", 0, len(store_layers))
    def stored(done: int, total: int) -> None:
        report("building expert store", done, total)

    if method is None:
        store = ExpertStore.build(store_layers, dtype=dtype, pin=pin, progress=stored)
    else:
        store = QuantizedExpertStore.build_quantized(store_layers, codecs, read_part, dtype=dtype, pin=pin,
                                                     progress=stored)
    return model, store, [mod for _, mod in experts]


def store_layers_of(experts: list[tuple[str, torch.nn.Module]]) -> list[StoreLayer]:
    """One :class:`StoreLayer` per Experts module, in MoE-layer order."""
    # An Experts module's num_experts is an int (nn.Module's __getattr__ is typed Tensor | Module).
    return [StoreLayer(index=i, module_name=name, num_experts=int(mod.num_experts),  # type: ignore[arg-type]
                       geometry=ExpertGeometry.from_module(mod))
            for i, (name, mod) in enumerate(experts)]


def assign_non_expert_weights(model: PreTrainedModel, state: dict[str, torch.Tensor],
                              experts: list[torch.nn.Module], device: torch.device) -> None:
    """Assign ``state`` (every non-expert tensor, by model key) to the meta skeleton, tie the
    embeddings where the config says so, drop the Experts modules' weight parameters and move the
    model to ``device``. Raises :class:`LoaderError` ``missing_weights`` when a non-expert
    parameter is still on ``meta`` (nothing in the checkpoint filled it)."""
    expert_param_keys = {f"{name}.{seg.name}" for name, mod in model.named_modules() if mod in experts
                         for seg in ExpertGeometry.from_module(mod).segments}
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - expert_param_keys
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
            model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    for mod in experts:
        for seg in ExpertGeometry.from_module(mod).segments:
            mod.register_parameter(seg.name, None)
    still_meta = sorted(n for n, p in model.named_parameters() if p.device.type == "meta")
    if still_meta:
        raise LoaderError("missing_weights", f"checkpoint lacks {len(still_meta)} non-expert tensors, "
                          f"e.g. {still_meta[:3]} (missing {sorted(missing)[:3]})")
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper of .to is typed for the model alone
    model.eval()


def load_resident_model(checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str | None = None, experts_implementation: str = "grouped_mm"):
    """The same checkpoint fully resident, with a stock experts implementation (for identity tests
    and the benchmark's baseline): by default transformers' own default, ``grouped_mm``, whose
    arithmetic the offloaded runtime reproduces by default. ``dtype=None`` follows the same rule
    as the offloaded loader."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        checkpoint_dir, dtype=resolve_dtype(checkpoint_dir, dtype),
        experts_implementation=experts_implementation)
    model = model.to(dev).eval()
    if dev.type == "cpu":
        _own_aligned_storage(model)
    return model


def _own_aligned_storage(model: torch.nn.Module) -> None:
    """Give every parameter that still points into a memory-mapped file its own allocation.

    A tensor assigned straight from a safetensors mmap can sit at any byte offset; CPU GEMM
    kernels take different (equally valid, differently rounded) paths for unaligned operands,
    so the same weights would give a different last bit depending only on how the file was
    laid out. Copying fixes the reference to the layout-independent result.
    """
    copies: dict[int, torch.nn.Parameter] = {}  # keeps tied parameters tied
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param.data_ptr() % 64 == 0:
                    continue
                if id(param) not in copies:
                    copies[id(param)] = torch.nn.Parameter(param.detach().clone(),
                                                           requires_grad=param.requires_grad)
                module._parameters[name] = copies[id(param)]


__all__ += ["ExpertStoreError", "assign_non_expert_weights", "load_skeleton_and_store", "store_layers_of"]
