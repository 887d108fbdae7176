"""From a request's text to prompt ids without the event loop doing model-sized work.

Two rules keep one huge prompt from taking the engine down:

- **refuse by arithmetic first**: no token of this tokenizer covers more than
  ``max_bytes_per_token`` bytes of text (its longest vocabulary entry, times what its
  normalizer can shrink text by), so a prompt of ``c`` characters has at least
  ``c / max_bytes_per_token`` tokens. When that alone reaches the context ceiling the
  request is refused (400 ``context_length_exceeded``) before anything is rendered or
  tokenized. A tokenizer whose pipeline can drop or fuse text (a stripping normalizer,
  fused unknown tokens, WordPiece's whole-word unknown) gets no bound and no shortcut;
- **work in a worker**: chat-template rendering and tokenization of any input longer than
  ``INLINE_CHARS`` run in a worker thread (the Rust tokenizer releases the interpreter lock),
  so ``/health``, ``/admin/status`` and every stream keep answering meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moetray.engine.budget import ContextTooLong

INLINE_CHARS = 16 << 10
"""Inputs shorter than this are rendered and tokenized on the loop (a worker hop costs more)."""
_NORMALIZER_SHRINK = {"NFC": 3.0, "NFD": 3.0, "NFKC": 3.0, "NFKD": 3.0, "Lowercase": 3.0, "Prepend": 1.0}
"""How many times fewer UTF-8 bytes a normalizer can leave (Hangul jamo compose 9 → 3 bytes;
the Kelvin sign lowercases 3 → 1)."""
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _shrink(normalizer: Mapping[str, Any] | None) -> float | None:
    """How far a normalizer can shrink text (bytes in / bytes out), or None when it may drop text."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in normalizer.get("normalizers", []):
            sub = _shrink(part)
            if sub is None:
                return None
            factor *= sub
        return factor
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if pattern is None or not content:
            return None  # a regex or a deletion can remove any amount of text
        return max(1.0, len(pattern.encode()) / len(content.encode()))
    return _NORMALIZER_SHRINK.get(kind) if isinstance(kind, str) else None


def _keeps_text(pre: Mapping[str, Any] | None) -> bool:
    """Whether a pre-tokenizer keeps every character (splitting is fine, removing is not)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in _SAFE_PRE_TOKENIZERS


@functools.lru_cache(maxsize=8)
def max_bytes_per_token(tokenizer) -> float | None:
    """The most UTF-8 bytes of input text one token can stand for, or None when unbounded.

    Read once per tokenizer from its own pipeline description: the longest vocabulary or
    added-token string (vocabulary strings are at least as long in UTF-8 as the text they
    cover: byte-level and metaspace alphabets only lengthen it), times the normalizer's
    shrink factor. None for a pipeline that can drop text or map a run of it to one token.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") not in ("BPE", "Unigram"):
        return None
    if model.get("type") == "BPE" and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    if model.get("type") == "Unigram" and not model.get("byte_fallback"):
        return None
    if not _keeps_text(spec.get("pre_tokenizer")):
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    vocab = model.get("vocab") or {}
    pieces = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)
    longest = max((len(p.encode()) for p in pieces), default=1)
    for added in spec.get("added_tokens") or []:
        longest = max(longest, len(str(added.get("content", "")).encode()))
    return float(longest) * shrink


def refuse_if_cannot_fit(tokenizer, limit: int, chars: int) -> None:
    """Refuses (``ContextTooLong``) a prompt whose ``chars`` alone prove ≥ ``limit`` tokens; else nothing.

    Mutates nothing; never tokenizes. ``limit`` is the context ceiling (a prompt of
    ``limit`` tokens or more is refused, as ``ContextCeiling.fit`` does after tokenizing).
    """
    per_token = max_bytes_per_token(tokenizer)
    if per_token is None or chars <= 0:
        return
    at_least = math.ceil(chars / per_token)
    if at_least >= limit:
        raise ContextTooLong(
            f"prompt is too long: at least {at_least} tokens ({chars} characters) > {limit - 1} maximum",
            prompt_tokens=at_least,
            limit=limit,
        )


def message_chars(messages: Sequence[Mapping[str, Any]], *, roles: tuple[str, ...] | None = ("user",)) -> int:
    """Characters of message text: by default the user text every chat template renders verbatim
    (whitespace at the ends aside); ``roles=None`` counts every message's."""
    total = 0
    for message in messages:
        if roles is not None and message.get("role") not in roles:
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += len(content.strip())
        elif isinstance(content, list):
            total += sum(len(str(p.get("text", "")).strip()) for p in content if isinstance(p, Mapping))
    return total


async def off_loop(chars: int, work: Callable[[], Any]) -> Any:
    """``work()`` in a worker thread when the input is large, inline when it is small."""
    if chars >= INLINE_CHARS:
        return await asyncio.to_thread(work)
    return work()


async def chat_prompt(
    engine, chat, messages: list[dict[str, Any]], tools, template_kwargs: dict[str, Any]
) -> tuple[str, list[int]]:
    """(rendered text, its ids) for a chat request; refuses an impossible length before either.

    A template that rejects the messages is a 400 (``invalid_request_error``, ``messages``).
    """
    from moetray.engine.api.errors import ApiError

    refuse_if_cannot_fit(chat.tokenizer, engine.pools.ceiling.limit, message_chars(messages))
    size = message_chars(messages, roles=None) + (len(json.dumps(tools)) if tools else 0)

    def render_and_encode() -> tuple[str, list[int]]:
        try:
            text = chat.render(messages, tools=tools, **template_kwargs)
        except Exception as exc:
            raise ApiError(
                "invalid_request_error", f"the chat template rejected these messages: {exc}", param="messages"
            ) from exc
        return text, chat.encode(text)

    return await off_loop(size, render_and_encode)


async def text_prompt(engine, chat, prompt: str) -> list[int]:
    """The ids of a completion prompt; refuses an impossible length before tokenizing."""
    refuse_if_cannot_fit(chat.tokenizer, engine.pools.ceiling.limit, len(prompt))
    return await off_loop(len(prompt), lambda: chat.encode(prompt))
