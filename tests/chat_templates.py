"""Render chat templates the way the engine does, for the effort and turn probes' tests.

``renderer(template, **special)`` returns the ``render(messages, **kwargs) -> str``
callable the probes take, backed by transformers' own chat-template renderer (its Jinja
sandbox, ``raise_exception``, ``strftime_now``, reasoning-field aliases). ``real(name)``
loads a checked-in real template (``tests/data/templates``, provenance in SOURCES.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

TEMPLATES_DIR = Path(__file__).resolve().parent / "data" / "templates"


def renderer(template: str, **special: str | None) -> Callable[..., str]:
    """``render(messages, **kwargs)`` for ``template``; ``special`` holds bos_token/eos_token."""
    fixed = {k: v for k, v in special.items() if v is not None}

    def render(messages, **kwargs) -> str:
        tools = kwargs.pop("tools", None)
        add_generation_prompt = kwargs.pop("add_generation_prompt", False)
        rendered, _ = render_jinja_template(
            [list(messages)],
            tools=tools,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            **{**fixed, **kwargs},
        )
        return rendered[0]

    return render


def real(name: str) -> str:
    """The text of a checked-in real template, by file stem."""
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")
