"""The models already on this machine: listed by reading headers and configs, never tensors.

:func:`list_models` walks the Hugging Face hub cache, LM Studio's folders, the Ollama store, the
recent folders the tray passes in and the demo, and returns one ``policy.wire.LocalModel`` row per
model, with ``servable`` and the refusal kind that keeps it from being served (``not_moe`` for a
dense model, ``quantized_checkpoint`` for GPTQ/AWQ/bitsandbytes, ``unsupported_quant_type``,
``unsupported_family``, ``unreadable_checkpoint`` for a truncated file or a missing blob). A GGUF
header is read through transformers' reader, which skips the vocabulary, and what it said is kept
in the header cache (:mod:`~moetray.engine.models.row_cache`): a listing whose files are unchanged
reads no header and imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from moetray.engine.models.files import SPLIT_RE, CheckpointError, gguf_files, is_gguf_path
from moetray.engine.models.names import (
    DEMO,
    hf_hub_root,
    hf_snapshot,
    lmstudio_roots,
    ollama_blob,
    ollama_root,
)
from moetray.engine.models.row_cache import RowCache, cache_path, file_stamp
from moetray.policy.wire import LocalModel, ModelFormat, ModelSource

__all__ = ["SERVED_QUANT_METHODS", "describe_folder", "describe_gguf", "list_models"]

SERVED_QUANT_METHODS = ("mxfp4", "fp8")
"""Hugging Face quantization methods whose experts the store keeps quantized; others are refused."""
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _row(
    name: str,
    source: ModelSource,
    path: Path,
    fmt: ModelFormat,
    family: str | None,
    moe: bool | None,
    nbytes: int | None,
    refusal: str | None,
) -> LocalModel:
    return {
        "name": name,
        "source": source,
        "path": str(path),
        "format": fmt,
        "family": family,
        "moe": moe,
        "bytes": nbytes,
        "servable": refusal is None,
        "refusal": refusal,
    }


def _size(paths: Iterable[Path]) -> int | None:
    try:
        return sum(p.stat().st_size for p in paths)  # stat follows the hub cache's symlinks to blobs
    except OSError:
        return None


def _gguf_facts(path: Path) -> dict:
    """``family``, ``moe`` and ``refusal`` of the GGUF model at ``path``, from its headers."""
    from moetray.engine.models.gguf import read_gguf

    try:
        ck = read_gguf(path)
    except CheckpointError as exc:
        moe = False if exc.kind == "not_moe" else None
        return {"family": getattr(exc, "model_type", None), "moe": moe, "refusal": exc.kind}
    return {"family": ck.arch, "moe": True, "refusal": None}


def describe_gguf(name: str, source: ModelSource, path: Path, cache: RowCache | None = None) -> LocalModel:
    """One row for the GGUF model at ``path`` (its headers only, or the cache's record of them)."""
    try:
        files = gguf_files(path)
    except CheckpointError as exc:  # a missing part of a split set, or nothing there
        return _row(name, source, path, "gguf", None, None, _size([path] if path.exists() else []), exc.kind)
    stamp = file_stamp(files)
    facts = cache.get(str(path), stamp) if cache is not None else None
    if facts is None:
        facts = _gguf_facts(path)
        if cache is not None:
            cache.put(str(path), stamp, facts)
    return _row(name, source, path, "gguf", facts["family"], facts["moe"], _size(files), facts["refusal"])


def _text_config(cfg: dict) -> dict:
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def describe_folder(name: str, source: ModelSource, folder: Path) -> LocalModel:
    """One row for a Hugging Face folder (its ``config.json`` only)."""
    files = [p for p in folder.iterdir() if p.is_file() or p.is_symlink()] if folder.is_dir() else []
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return _row(name, source, folder, "safetensors", None, None, _size(files), "unreadable_checkpoint")
    text = _text_config(cfg)
    family = text.get("model_type") or cfg.get("model_type")
    counts = [count for k in _EXPERT_COUNT_KEYS if isinstance(count := text.get(k), int)]
    moe = bool(counts and max(counts) > 1)
    quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not moe:
        refusal = "not_moe"
    elif method and method not in SERVED_QUANT_METHODS:
        refusal = "quantized_checkpoint"
    elif not any(folder.glob("*.safetensors")):
        refusal = "unreadable_checkpoint"
    else:
        refusal = None
    return _row(name, source, folder, "safetensors", family, moe, _size(files), refusal)


def _first_ggufs(folder: Path) -> list[Path]:
    """The GGUF models in ``folder``: plain files and the first part of each split set."""
    out = []
    for p in sorted(folder.glob("*.gguf")):
        m = SPLIT_RE.match(p.name)
        if p.name.startswith("mmproj") or (m is not None and m["no"] != "00001"):
            continue
        out.append(p)
    return out


def _huggingface(environ: Mapping[str, str], cache: RowCache) -> list[LocalModel]:
    root = hf_hub_root(environ)
    rows = []
    for repo in sorted(root.glob("models--*--*")) if root.is_dir() else []:
        org, _, name = repo.name.removeprefix("models--").partition("--")
        snap = hf_snapshot(repo)
        if snap is None:
            continue
        if (snap / "config.json").is_file():
            rows.append(describe_folder(f"hf:{org}/{name}", "huggingface", snap))
        for gguf in _first_ggufs(snap):
            rows.append(describe_gguf(f"hf:{org}/{name}/{gguf.name}", "huggingface", gguf, cache))
    return rows


def _lmstudio(environ: Mapping[str, str], cache: RowCache) -> list[LocalModel]:
    rows, seen = [], set()
    for root in lmstudio_roots(environ):
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()) if root.is_dir() else []:
            for gguf in _first_ggufs(folder):
                name = f"lmstudio:{gguf.relative_to(root).as_posix()}"
                if name not in seen:
                    seen.add(name)
                    rows.append(describe_gguf(name, "lmstudio", gguf, cache))
    return rows


def _ollama(environ: Mapping[str, str], cache: RowCache) -> list[LocalModel]:
    root = ollama_root(environ)
    manifests = root / "manifests"
    rows = []
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else []:
        parts = manifest.relative_to(manifests).parts
        if len(parts) < 3:
            continue
        *model, tag = parts
        if tuple(model[:2]) == ("registry.ollama.ai", "library"):
            model = model[2:]
        name = f"ollama:{'/'.join(model)}:{tag}"
        try:
            blob = ollama_blob(root, manifest)
        except CheckpointError:
            rows.append(_row(name, "ollama", manifest, "gguf", None, None, None, "unreadable_checkpoint"))
            continue
        if not blob.is_file():
            rows.append(_row(name, "ollama", blob, "gguf", None, None, None, "unreadable_checkpoint"))
            continue
        rows.append(describe_gguf(name, "ollama", blob, cache))
    return rows


def _demo() -> LocalModel:
    from moetray.engine.demo import demo_model_path

    path = demo_model_path()
    built = (path / "config.json").is_file()
    row = (
        describe_folder(DEMO, "demo", path)
        if built
        else _row(DEMO, "demo", path, "safetensors", "qwen2_moe", True, None, None)
    )
    return row  # built on first use when absent: servable either way


def list_models(
    environ: Mapping[str, str] | None = None, recent: Iterable[str | Path] = ()
) -> list[LocalModel]:
    """Every model found on disk, in the order: demo, recent folders, Hugging Face, LM Studio, Ollama."""
    env = os.environ if environ is None else environ
    cache = RowCache(cache_path(env))
    rows = [_demo()]
    for folder in recent:
        path = Path(folder).expanduser()
        if not path.exists():
            continue
        rows.append(
            describe_gguf(str(path), "recent", path, cache)
            if is_gguf_path(path)
            else describe_folder(str(path), "recent", path)
        )
    rows += _huggingface(env, cache) + _lmstudio(env, cache) + _ollama(env, cache)
    cache.save()
    return rows
