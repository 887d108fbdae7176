"""Make the tokenizer files transformers 5 writes readable by other loaders too.

transformers 5 saves ``tokenizer_class: "TokenizersBackend"`` (a class transformers 4 does not
know) plus the load-time keys ``is_local`` and ``local_files_only``, and keeps the chat
template only in ``chat_template.jinja``. Older readers look for the template inside
``tokenizer_config.json``. This rewrite keeps the ``.jinja`` file and also embeds the template.
"""

from __future__ import annotations

import json
from pathlib import Path

PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "_commit_hash", "name_or_path")


def portable_tokenizer_files(folder: Path) -> None:
    """Rewrite ``folder/tokenizer_config.json`` in place for portability (idempotent).

    Sets ``tokenizer_class`` to ``PreTrainedTokenizerFast``, drops load-time keys and copies
    ``chat_template.jinja`` (when present) into the config's ``chat_template``.
    """
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    for key in _LOAD_TIME_KEYS:
        cfg.pop(key, None)
    template = folder / "chat_template.jinja"
    if template.is_file():
        cfg["chat_template"] = template.read_text(encoding="utf-8")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
