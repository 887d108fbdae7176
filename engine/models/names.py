"""Where users keep models, and the names ``moetray serve --model`` accepts for them.

- ``hf:ORG/NAME`` — a Hugging Face hub cache repo (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``): ``models--ORG--NAME/snapshots/<refs/main>``; ``hf:ORG/NAME/FILE.gguf``
  names one GGUF model inside such a repo;
- ``ollama:NAME:TAG`` — an Ollama store (``$OLLAMA_MODELS``, else ``~/.ollama/models``): the manifest
  ``manifests/registry.ollama.ai/library/NAME/TAG`` (another registry keeps its host folder:
  ``ollama:hf.co/ORG/REPO:TAG``) names the model blob ``blobs/sha256-<hex>``, a GGUF;
- ``lmstudio:PUBLISHER/FOLDER/FILE.gguf`` — ``~/.lmstudio/models`` (older installs
  ``~/.cache/lm-studio/models``);
- ``demo`` — the embedded demo model; anything else is a path.

Files are read in place: a name resolves to a path, never to a copy. Environment and home folder
are parameters, so tests plant stores in a temporary home.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from moetray.engine.models.files import CheckpointError

__all__ = [
    "DEMO",
    "OLLAMA_MODEL_MEDIA_TYPE",
    "hf_hub_root",
    "hf_snapshot",
    "lmstudio_roots",
    "ollama_blob",
    "ollama_root",
    "resolve_model",
]

DEMO = "demo"
OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
OLLAMA_DEFAULT_REGISTRY = ("registry.ollama.ai", "library")


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or Path.home())


def hf_hub_root(environ: Mapping[str, str] = os.environ) -> Path:
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    return _home(environ) / ".cache" / "huggingface" / "hub"


def lmstudio_roots(environ: Mapping[str, str] = os.environ) -> list[Path]:
    home = _home(environ)
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def ollama_root(environ: Mapping[str, str] = os.environ) -> Path:
    if environ.get("OLLAMA_MODELS"):
        return Path(environ["OLLAMA_MODELS"])
    return _home(environ) / ".ollama" / "models"


def hf_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` points at, else the newest snapshot; None when there is none."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted(
        (p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    return snaps[-1] if snaps else None


def ollama_blob(root: Path, manifest: Path) -> Path:
    """The model blob a manifest names (whether or not the store holds it). Refuses
    ``unreadable_checkpoint`` for a manifest that cannot be read or names no model layer."""
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
        digest = next(
            layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE
        )
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            "unreadable_checkpoint",
            f"Ollama manifest {manifest} names no model blob ({exc!r})",
            file=str(manifest),
        ) from exc
    return root / "blobs" / digest.replace(":", "-", 1)


def _ollama_manifest(root: Path, name: str) -> Path:
    model, _, tag = name.rpartition(":")
    if not model:
        model, tag = tag, "latest"
    parts = model.split("/")
    if len(parts) == 1:
        parts = [*OLLAMA_DEFAULT_REGISTRY, parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_DEFAULT_REGISTRY[0], *parts]
    return root.joinpath("manifests", *parts, tag)


def resolve_model(spec: str | Path | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """The path a ``--model`` value names (None: the demo). A path is returned as given. Refuses
    ``not_a_checkpoint`` for a name nothing on disk answers to, and ``unreadable_checkpoint`` for an
    Ollama manifest whose blob the store lacks (naming the blob)."""
    if spec is None:
        return None
    text = str(spec)
    if text == DEMO:
        return None
    kind, sep, rest = text.partition(":")
    if not sep or kind not in ("hf", "ollama", "lmstudio") or not rest:
        return Path(text).expanduser()
    if kind == "hf":
        parts = rest.split("/")
        if len(parts) < 2:
            raise CheckpointError("not_a_checkpoint", f"{text}: a Hugging Face name is hf:ORG/NAME")
        repo = hf_hub_root(environ) / f"models--{parts[0]}--{parts[1]}"
        snap = hf_snapshot(repo) if repo.is_dir() else None
        if snap is None:
            raise CheckpointError("not_a_checkpoint", f"{text}: no snapshot in {repo}")
        return snap.joinpath(*parts[2:]) if len(parts) > 2 else snap
    if kind == "lmstudio":
        for root in lmstudio_roots(environ):
            if (root / rest).is_file():
                return root / rest
        raise CheckpointError(
            "not_a_checkpoint",
            f"{text}: no such file under {' or '.join(str(r) for r in lmstudio_roots(environ))}",
        )
    root = ollama_root(environ)
    manifest = _ollama_manifest(root, rest)
    if not manifest.is_file():
        raise CheckpointError("not_a_checkpoint", f"{text}: no Ollama manifest at {manifest}")
    blob = ollama_blob(root, manifest)
    if not blob.is_file():
        raise CheckpointError(
            "unreadable_checkpoint",
            f"{text}: the manifest names {blob.name}, which the store at {root / 'blobs'} lacks",
            file=str(blob),
        )
    return blob
