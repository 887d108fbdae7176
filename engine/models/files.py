"""What a model on disk is made of, decided without torch: the refusal a checkpoint raises and the
file set of a GGUF model (a file, a folder holding one, the parts of a split set).

Listing the models on disk (``discovery``) runs on these alone once the header cache knows a file,
so ``moetray models`` imports neither torch nor transformers on a warm listing. May import only the
standard library and ``moetray.policy``.
"""

from __future__ import annotations

import re
from pathlib import Path

from moetray.policy.refused import Refused

__all__ = ["SPLIT_RE", "CheckpointError", "gguf_files", "is_gguf_path"]

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class CheckpointError(Refused):
    """A model on disk that cannot be served; ``.kind`` names why (snake_case)."""


def is_gguf_path(path: str | Path) -> bool:
    """A ``.gguf`` file, a file that starts with the GGUF magic (an Ollama blob has no suffix), or a
    folder holding one and no ``config.json``."""
    p = Path(path)
    if p.suffix == ".gguf":
        return True
    if p.is_file():
        try:
            with open(p, "rb") as fh:
                return fh.read(4) == b"GGUF"
        except OSError:
            return False
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


def gguf_files(path: str | Path) -> list[Path]:
    """The file(s) of the GGUF model at ``path``: the file itself, every part of its split set, or
    the one model in a folder. Refuses ``not_a_checkpoint`` (nothing there, or a folder with several
    models) and ``unreadable_checkpoint`` (a part of the split set is missing)."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(q for q in p.glob("*.gguf") if not q.name.startswith("mmproj"))
        firsts = [q for q in found if (split := SPLIT_RE.match(q.name)) is None or split["no"] == "00001"]
        if len(firsts) != 1:
            raise CheckpointError("not_a_checkpoint", f"{p} holds {len(firsts)} GGUF models; name the file")
        p = firsts[0]
    if not p.is_file():
        raise CheckpointError("not_a_checkpoint", f"{p} is not a GGUF file")
    m = SPLIT_RE.match(p.name)
    if m is None:
        return [p]
    count = int(m["count"])
    parts = [p.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise CheckpointError(
            "unreadable_checkpoint",
            f"split set {p.name} lacks {', '.join(missing)}",
            file=str(parts[0].parent / missing[0]),
        )
    return parts
