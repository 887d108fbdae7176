"""Constrained decoding: grammars compiled by llguidance, and the token mask each gives a step.

llguidance (one self-contained abi3 wheel; the Earley parser llama.cpp and vLLM use) was
chosen over xgrammar after measuring both on this machine with the demo tokenizer (49 152
tokens) and a two-field JSON schema: compile 0.7–2.5 ms vs 5.6–21 ms, mask 9–31 µs vs
~4.5 µs per token, applying the mask to the logits ~55 µs either way — all far below one
decode step. llguidance also takes Lark grammars with inline JSON schemas, which is what
tool calls in every family's wire format need, and it does not pull torch, triton and
transformers as xgrammar's wheel does (a risk to the pinned CPU torch).

A :class:`GrammarCompiler` per loaded model holds llguidance's view of the tokenizer
(built once, on first use: ~0.7 s for 49 k tokens); :meth:`GrammarCompiler.compile`
validates a grammar (refusing with ``invalid_schema``) and returns a :class:`Grammar` whose
:meth:`Grammar.matcher` starts one request's parse. The sampling stage fills one bitmask row
per constrained request each step (:func:`fill_token_bitmask`) and masks the logits with it
(:func:`apply_token_bitmask`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from moetray.policy.refused import Refused

log = logging.getLogger("moetray.engine.cb.grammar")

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How forced JSON is spaced: ``json.dumps``'s separators and no free whitespace, so a
grammar-forced value cannot run on in blanks (a known failure of flexible whitespace)."""

_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


class GrammarRefused(Refused, ValueError):
    """A schema or grammar llguidance cannot compile; nothing was admitted.

    ``.kind`` is ``invalid_schema`` (the request's schema is wrong or uses what the compiler
    does not support; ``.param`` names the request field) or ``constrained_decoding_unavailable``
    (this model's tokenizer cannot be read by the grammar library).
    """

    KINDS = ("invalid_schema", "constrained_decoding_unavailable")


@dataclass(frozen=True, eq=False)
class Grammar:
    """A validated llguidance grammar for one model; ``matcher()`` starts one request's parse.

    The grammar is built once, when compiled (off the event loop); each matcher is a copy of
    that first one, which costs microseconds however large the schema.
    """

    text: str
    prototype: Any  # llguidance.LLMatcher, never advanced
    n_vocab: int

    def matcher(self):
        return self.prototype.deep_copy()


class GrammarCompiler:
    """One model's grammar compiler (thread-safe; the tokenizer view is built on first use)."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self.eos_ids = [int(t) for t in eos_ids]
        self._lock = threading.Lock()
        self._tokenizer = None
        self._special = {
            str(tok): int(tid)
            for tok, tid in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=False)
        }
        for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                self._special[str(added.content)] = int(tid)

    def tokenizer(self):
        """llguidance's view of the tokenizer (EOS = the engine's end ids); refuses if unreadable."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                    )
                except Exception as exc:
                    raise GrammarRefused(
                        "constrained_decoding_unavailable",
                        f"constrained decoding cannot read this model's tokenizer: {exc}",
                    ) from exc
            return self._tokenizer

    def prepare(self) -> bool:
        """Build the tokenizer view now (the loading thread calls this, so no request waits ~1 s
        for it); returns whether constrained decoding is available. Refuses nothing."""
        try:
            self.tokenizer()
        except GrammarRefused as exc:
            log.warning("%s", exc)
            return False
        return True

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (a token may hold part of a character); for log-probabilities."""
        try:
            tokenizer = self.tokenizer()
        except GrammarRefused:
            return [self._hf.decode([int(t)]).encode("utf-8") for t in ids]
        return [tokenizer.decode_bytes([int(t)]) for t in ids]

    def literal(self, text: str) -> str:
        """``text`` as a Lark item: a token reference when it is one special token, else a string."""
        tid = self._special.get(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    def compile(self, lark: str, *, param: str | None = None) -> Grammar:
        """Validate a Lark grammar against this tokenizer; refuses with ``invalid_schema``."""
        tokenizer = self.tokenizer()
        text = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise GrammarRefused(
                "invalid_schema", f"the schema cannot be enforced: {messages[0] if messages else lark}",
                param=param,
            )
        return Grammar(text, llguidance.LLMatcher(tokenizer, text, log_level=0), self.vocab_size)


def json_item(schema: Mapping[str, Any], *, strict: bool = True) -> str:
    """A Lark item that matches a JSON value valid against ``schema`` (spaced as :data:`JSON_STYLE`).

    ``strict`` closes objects that leave ``additionalProperties`` open (OpenAI's strict mode:
    exactly the listed keys) and refuses unsupported keywords; non-strict ignores them.
    """
    schema = _closed(schema) if strict else dict(schema)
    schema["x-guidance"] = {**JSON_STYLE, "lenient": not strict}
    return "%json " + json.dumps(schema)


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out and "properties" in out:
        out["additionalProperties"] = False
    return out


def fill_token_bitmask(matchers: Sequence[Any], n_vocab: int) -> torch.Tensor:
    """One int32 bitmask row per matcher (bit ``t`` set: token ``t`` may come next)."""
    mask = torch.empty((len(matchers), (n_vocab + 31) // 32), dtype=torch.int32)
    row_bytes = mask.size(1) * 4
    for i, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), row_bytes)
    return mask


def apply_token_bitmask(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``scores`` with every token its row's bitmask disallows set to −inf."""
    mask = mask.to(scores.device, non_blocking=True)
    allowed = (mask.unsqueeze(-1) & _BITS.to(scores.device)).ne(0).view(mask.size(0), -1)
    return scores.masked_fill(~allowed[:, : scores.size(-1)], float("-inf"))
