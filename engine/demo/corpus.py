"""Offline English text for calibration and held-out perplexity.

Every machine that runs moetray has one English corpus on disk: the Python standard
library's docstrings. They are read with :mod:`ast` (nothing is imported), cut into prose
paragraphs (at least 85 % letters and spaces, no doctest or ``::`` blocks) and grouped per
module. A module's name hashes it into calibration (80 %) or held-out (20 %), so the split is
stable across runs and machines; the documents are ordered by that hash too, which mixes
topics without a random generator. The wheel's Apache-2.0 licence joins the held-out side.

The text depends on the interpreter's stdlib version; the build records its sha256 in the
recipe, so "same inputs" is checkable.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "turtledemo", "__pycache__",
              "lib2to3", "ensurepip", "idlelib", "pydoc_data"}
_CODE_MARKERS = (">>>", "::", " = ", "==", "{", "}", "try:", "(self", "\\", "->")
MIN_DOCSTRING_CHARS = 200
MIN_PARAGRAPH_CHARS = 60
MIN_LETTER_FRACTION = 0.85
HELDOUT_BUCKETS = 5  # one bucket of five → 20 % held out


@dataclass(frozen=True)
class Document:
    name: str  # the module path relative to the stdlib, e.g. "email/message.py"
    text: str

    @property
    def key(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()

    @property
    def heldout(self) -> bool:
        return int(self.key[:8], 16) % HELDOUT_BUCKETS == 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _prose_paragraphs(doc: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n", doc):
        para = " ".join(block.split())
        if any(marker in block or marker in para for marker in _CODE_MARKERS):
            continue
        if len(para) < MIN_PARAGRAPH_CHARS:
            continue
        letters = sum(ch.isalpha() or ch == " " for ch in para)
        if letters / len(para) >= MIN_LETTER_FRACTION:
            out.append(para)
    return out


def _module_docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                docs.append(doc)
    return docs


def stdlib_documents(root: Path | None = None) -> list[Document]:
    """Every stdlib module's prose docstring paragraphs, one document per module, in hash order."""
    root = root or stdlib_dir()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        paragraphs = [p for doc in _module_docstrings(source) for p in _prose_paragraphs(doc)]
        if paragraphs:
            docs.append(Document(rel.as_posix(), "\n\n".join(paragraphs)))
    docs.sort(key=lambda d: d.key)
    return docs


def licence_document(text: str) -> Document:
    """A licence text as one held-out document of prose paragraphs (its headings dropped)."""
    paragraphs = [" ".join(block.split()) for block in re.split(r"\n\s*\n", text)]
    return Document("LICENSE", "\n\n".join(p for p in paragraphs if len(p) >= MIN_PARAGRAPH_CHARS))


@dataclass(frozen=True)
class Corpus:
    calibration: str
    heldout: str

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for part in (self.calibration, self.heldout):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()


def build_corpus(extra_heldout: Sequence[Document] = (), root: Path | None = None) -> Corpus:
    """Split the stdlib documents into calibration and held-out text (deterministic)."""
    docs = stdlib_documents(root)
    calibration = [d.text for d in docs if not d.heldout]
    heldout = [d.text for d in docs if d.heldout] + [d.text for d in extra_heldout]
    return Corpus("\n\n".join(calibration), "\n\n".join(heldout))
