"""`moetray models`: the Hugging Face, LM Studio and Ollama stores planted in a temporary home are
listed by name, with servable/refusal, and every listed name resolves to the files in place."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from moetray.engine.models import cli
from moetray.engine.models.checkpoint import CheckpointError, inspect_checkpoint
from moetray.engine.models.discovery import list_models
from moetray.engine.models.gguf_export import export_gguf
from moetray.engine.models.names import resolve_model
from moetray.policy.wire import LOCAL_MODEL_KEYS

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.tiny_moe import make_tiny_moe

    root = tmp_path_factory.mktemp("sources")
    moe = make_tiny_moe(root / "moe", "qwen3_moe")
    gguf = export_gguf(moe, root / "tiny-moe-Q8_0.gguf", "Q8_0")[0]
    return {"moe": moe, "gguf": gguf, "root": root}


def _plant_hf(hub: Path, repo: str, src: Path, patch: dict | None = None) -> Path:
    """A hub-cache repo as huggingface_hub writes it: blobs named by hash, snapshot symlinks, refs/main."""
    org, name = repo.split("/")
    base = hub / f"models--{org}--{name}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        if f.name == "config.json" and patch:
            data = json.dumps({**json.loads(data), **patch}).encode()
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def _plant_ollama(models: Path, name: str, tag: str, gguf: Path | None) -> Path:
    data = gguf.read_bytes() if gguf is not None else b"gone"
    digest = hashlib.sha256(data).hexdigest()
    (models / "blobs").mkdir(parents=True, exist_ok=True)
    if gguf is not None:
        (models / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "layers": [
                    {
                        "mediaType": "application/vnd.ollama.image.template",
                        "digest": "sha256:" + "0" * 64,
                        "size": 1,
                    },
                    {
                        "mediaType": "application/vnd.ollama.image.model",
                        "digest": f"sha256:{digest}",
                        "size": len(data),
                    },
                ],
            }
        )
    )
    return models / "blobs" / f"sha256-{digest}"


@pytest.fixture
def home(tmp_path, sources):
    hub = tmp_path / ".cache" / "huggingface" / "hub"
    _plant_hf(hub, "tiny/moe", sources["moe"])
    _plant_hf(hub, "tiny/dense", sources["moe"], {"model_type": "qwen3", "num_local_experts": 0})
    _plant_hf(hub, "tiny/moe-gptq", sources["moe"], {"quantization_config": {"quant_method": "gptq"}})
    lms = tmp_path / ".lmstudio" / "models" / "pub" / "tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(sources["gguf"], lms / "tiny-Q8_0.gguf")
    (lms / "cut-Q8_0.gguf").write_bytes(sources["gguf"].read_bytes()[:-4096])
    ollama = tmp_path / ".ollama" / "models"
    blob = _plant_ollama(ollama, "tiny", "q8", sources["gguf"])
    _plant_ollama(ollama, "gone", "latest", None)
    return {"env": {"HOME": str(tmp_path)}, "blob": blob, "lms": lms}


def test_every_store_is_listed_by_name_with_its_refusal(home):
    rows = {r["name"]: r for r in list_models(home["env"])}
    for row in rows.values():
        assert tuple(row) == LOCAL_MODEL_KEYS
        assert row["servable"] == (row["refusal"] is None)
    assert rows["demo"]["source"] == "demo" and rows["demo"]["servable"]
    moe = rows["hf:tiny/moe"]
    assert (moe["source"], moe["format"], moe["family"], moe["moe"], moe["servable"]) == (
        "huggingface",
        "safetensors",
        "qwen3_moe",
        True,
        True,
    )
    assert moe["bytes"] > 0  # the blobs behind the snapshot's symlinks
    assert (rows["hf:tiny/dense"]["refusal"], rows["hf:tiny/dense"]["moe"]) == ("not_moe", False)
    assert rows["hf:tiny/moe-gptq"]["refusal"] == "quantized_checkpoint"
    lms = rows["lmstudio:pub/tiny-GGUF/tiny-Q8_0.gguf"]
    assert (lms["format"], lms["family"], lms["servable"]) == ("gguf", "qwen3moe", True)
    assert rows["lmstudio:pub/tiny-GGUF/cut-Q8_0.gguf"]["refusal"] == "unreadable_checkpoint"
    assert rows["ollama:tiny:q8"]["path"] == str(home["blob"]) and rows["ollama:tiny:q8"]["servable"]
    assert rows["ollama:gone:latest"]["refusal"] == "unreadable_checkpoint"


_LIST_IN_A_FRESH_PROCESS = (
    "import json, sys\n"
    "from moetray.engine.models.discovery import list_models\n"
    "rows = list_models({'HOME': sys.argv[1]})\n"
    "print(json.dumps([rows, sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))\n"
)


def test_a_warm_listing_reads_no_header_and_a_changed_file_is_read_again(home):
    """The header cache: a second listing in a fresh process gives the same rows without importing
    torch or transformers (a header read needs both), and a file changed in place is read again."""
    env = home["env"]
    first = list_models(env)
    done = subprocess.run(
        [sys.executable, "-c", _LIST_IN_A_FRESH_PROCESS, env["HOME"]],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    rows, heavy = json.loads(done.stdout)
    assert rows == first
    assert heavy == [], f"a warm listing imported {heavy}"
    gguf = home["lms"] / "tiny-Q8_0.gguf"
    gguf.write_bytes(gguf.read_bytes()[:-4096])
    again = {r["name"]: r for r in list_models(env)}
    assert again["lmstudio:pub/tiny-GGUF/tiny-Q8_0.gguf"]["refusal"] == "unreadable_checkpoint"


def test_listed_names_resolve_to_the_files_in_place(home):
    env = home["env"]
    assert resolve_model("demo", env) is None
    assert resolve_model("hf:tiny/moe", env).is_dir()
    assert inspect_checkpoint(resolve_model("hf:tiny/moe", env)).num_experts == 8
    assert resolve_model("ollama:tiny:q8", env) == home["blob"]  # the blob itself, never a copy
    assert inspect_checkpoint(home["blob"]).format == "gguf"
    assert resolve_model("lmstudio:pub/tiny-GGUF/tiny-Q8_0.gguf", env) == home["lms"] / "tiny-Q8_0.gguf"
    with pytest.raises(CheckpointError) as refused:
        resolve_model("ollama:gone:latest", env)
    assert refused.value.kind == "unreadable_checkpoint" and "sha256-" in str(refused.value)
    with pytest.raises(CheckpointError) as refused:
        resolve_model("hf:nobody/nothing", env)
    assert refused.value.kind == "not_a_checkpoint"


def test_models_cli_prints_json_rows_and_takes_recent_folders(home, sources, monkeypatch):
    monkeypatch.setenv("HOME", home["env"]["HOME"])
    for key in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(key, raising=False)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["--json", "--recent", str(sources["moe"])]) == 0
    rows = json.loads(out.getvalue())
    recent = next(r for r in rows if r["source"] == "recent")
    assert recent["name"] == str(sources["moe"]) and recent["servable"]
    assert {"hf:tiny/moe", "ollama:tiny:q8", "demo"} <= {r["name"] for r in rows}
