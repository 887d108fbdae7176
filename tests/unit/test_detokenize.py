"""Rules of streaming detokenization: what text is safe to send after one more token.

Two decoders drive these tests: a byte-chunk decoder (ids name arbitrary byte strings,
decoded with Python's ``errors="replace"``, so any split of a character can be
expressed), and the real byte-level BPE tokenizer the tiny test checkpoints use.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from moetray.policy.detokenize import (
    MAX_PENDING_TOKENS,
    DetokenizeRefused,
    IncrementalDetokenizer,
    stop_prefix_holdback,
)

FFFD = "\ufffd"


class ByteChunks:
    """A decoder over a growing vocabulary of byte strings: id ``i`` is ``self.pieces[i]``."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def ids_for(self, chunks: list[bytes]) -> list[int]:
        start = len(self.pieces)
        self.pieces.extend(chunks)
        return list(range(start, start + len(chunks)))

    def decode(self, ids) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def split_bytes(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]


def stream(det: IncrementalDetokenizer, ids) -> list[str]:
    pieces = []
    for i in ids:
        pieces.append(det.push(i))
        if det.finished:
            return pieces
    pieces.append(det.finish())
    return pieces


@pytest.fixture(scope="module")
def tok():
    from tiny_moe import make_tokenizer

    return make_tokenizer(384)


def byte_ids(tok, data: bytes) -> list[int]:
    """One real-tokenizer id per byte (the byte-level alphabet has a token for each byte)."""
    ids = [tok.convert_tokens_to_ids(_byte_char(b)) for b in data]
    assert tok.unk_token_id not in ids
    return ids


def _byte_char(b: int) -> str:
    """GPT-2's printable stand-in for byte ``b``, the mapping ByteLevel uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


# --- stop_prefix_holdback -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "held"),
    [("hello <|en", 4), ("hello ST", 2), ("hello", 0), ("hello STOP", 0), ("", 0), ("<|end|", 6)],
)
def test_holdback_is_the_longest_tail_that_could_grow_into_a_stop(text, held):
    # Sending "<|en" and then learning it was the start of "<|end|>" cannot be undone over SSE.
    assert stop_prefix_holdback(text, ["<|end|>", "STOP"]) == held


def test_a_whole_stop_is_a_match_not_a_prefix():
    # Holding a complete stop would stall the stream instead of ending it.
    assert stop_prefix_holdback("x END", ["END"]) == 0
    assert stop_prefix_holdback("x END", ["END", "ENDING"]) == 3  # still a proper prefix of ENDING


# --- incomplete characters ------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(
        alphabet=st.one_of(
            st.characters(min_codepoint=0x20, max_codepoint=0x7E),
            st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
            st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
            st.sampled_from("éß€ʃ"),
        ),
        min_size=1,
        max_size=24,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=40),
)
def test_any_byte_split_reassembles_exactly_and_never_streams_a_broken_character(text, cuts):
    # A multi-byte character cut across tokens must reach the client whole, never as U+FFFD.
    dec = ByteChunks()
    ids = dec.ids_for(split_bytes(text.encode("utf-8"), cuts))
    pieces = stream(IncrementalDetokenizer(dec.decode), ids)
    assert "".join(pieces) == text
    assert all(FFFD not in p for p in pieces)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(
        alphabet=st.one_of(
            st.characters(min_codepoint=0x20, max_codepoint=0x7E),
            st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
            st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
        ),
        min_size=1,
        max_size=16,
    ),
    natural=st.booleans(),
)
def test_real_tokenizer_streams_cjk_and_emoji_exactly(tok, text, natural):
    # Same rule with the real byte-level BPE: both its own tokenization and one id per byte.
    ids = tok.encode(text, add_special_tokens=False) if natural else byte_ids(tok, text.encode("utf-8"))
    det = IncrementalDetokenizer(lambda i: tok.decode(i, skip_special_tokens=False))
    pieces = stream(det, ids)
    assert "".join(pieces) == text
    assert all(FFFD not in p for p in pieces)


def test_a_split_character_is_held_until_its_last_byte(tok):
    # The first two bytes of 世 decode to U+FFFD; streaming that would corrupt the text.
    ids = byte_ids(tok, "a世".encode())
    det = IncrementalDetokenizer(lambda i: tok.decode(i))
    assert [det.push(i) for i in ids] == ["a", "", "", "世"]


def test_streamed_text_is_always_a_prefix_of_the_final_decode(tok):
    # A random model emits arbitrary byte tokens; whatever is sent must never need retracting.
    decode = lambda i: tok.decode(i, skip_special_tokens=False)  # noqa: E731
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 40))]
        det, sent = IncrementalDetokenizer(decode), ""
        for i in ids:
            sent += det.push(i)
            assert decode(ids).startswith(sent)
        assert sent + det.finish() == decode(ids)


def test_bytes_that_can_never_form_a_character_still_stream(tok):
    # Lone continuation bytes would otherwise be held forever and grow the window without bound.
    ids = byte_ids(tok, b"\x80" * 12)
    det = IncrementalDetokenizer(lambda i: tok.decode(i))
    sent = "".join(det.push(i) for i in ids)
    assert sent == FFFD * len(sent) and len(sent) >= 12 - MAX_PENDING_TOKENS
    assert sent + det.finish() == FFFD * 12


def test_a_character_after_garbage_is_not_split_by_the_window_cut(tok):
    # The cut that releases garbage must not fall inside the valid character that follows it.
    ids = byte_ids(tok, b"\x80" * 4 + "中".encode())
    det = IncrementalDetokenizer(lambda i: tok.decode(i))
    assert "".join(stream(det, ids)) == FFFD * 4 + "中"


# --- bounded work ---------------------------------------------------------------------


def test_each_token_decodes_a_bounded_window_not_the_whole_output(tok):
    # Re-decoding the whole output per token is quadratic: a long answer would stall the server.
    text = ("Mixture of experts 世界 🎉 route tokens. " * 40)
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(lambda i: tok.decode(i))
    assert "".join(stream(det, ids)) == text
    assert det.max_window <= 2 * (MAX_PENDING_TOKENS + 1)
    assert det.decode_calls <= 3 * len(ids)


# --- stop strings ---------------------------------------------------------------------


def char_ids(dec: ByteChunks, pieces: list[str]) -> list[int]:
    return dec.ids_for([p.encode() for p in pieces])


def test_a_stop_streamed_letter_by_letter_is_never_sent():
    # "E", "N" went out before "D" arrived: the client would show half the stop string.
    dec = ByteChunks()
    det = IncrementalDetokenizer(dec.decode, stop=["END"])
    pieces = stream(det, char_ids(dec, ["ok ", "E", "N", "D", " more"]))
    assert "".join(pieces) == "ok "
    assert det.stopped == "END" and det.finished


def test_the_cut_is_exactly_at_the_stop_inside_a_token():
    # Text after the stop in the same token must not leak.
    dec = ByteChunks()
    det = IncrementalDetokenizer(dec.decode, stop=["###"])
    pieces = stream(det, char_ids(dec, ["alpha be", "ta##", "#gamma", "delta"]))
    assert "".join(pieces) == "alpha beta"
    assert det.stopped == "###"


def test_a_held_prefix_that_is_not_a_stop_is_released_unchanged():
    # Holding must delay text, never lose it.
    dec = ByteChunks()
    det = IncrementalDetokenizer(dec.decode, stop=["END"])
    pieces = stream(det, char_ids(dec, ["E", "N", "d of it"]))
    assert pieces[:2] == ["", ""]
    assert "".join(pieces) == "ENd of it" and det.stopped is None


def test_finish_releases_a_held_stop_prefix():
    # A stream that ends on "EN" ended without a stop: the text is the model's answer.
    dec = ByteChunks()
    det = IncrementalDetokenizer(dec.decode, stop=["END"])
    assert "".join(stream(det, char_ids(dec, ["so ", "EN"]))) == "so EN"


def test_the_earliest_stop_wins_and_is_reported():
    # Reporting the wrong stop misleads clients that branch on it.
    dec = ByteChunks()
    det = IncrementalDetokenizer(dec.decode, stop=["zz", "b"])
    assert "".join(stream(det, char_ids(dec, ["aaa", "bzz"]))) == "aaa"
    assert det.stopped == "b"


def test_push_after_a_stop_is_refused():
    # A token sampled after the stop must not extend a finished answer.
    dec = ByteChunks()
    det = IncrementalDetokenizer(dec.decode, stop=["."])
    ids = char_ids(dec, ["a.", "b"])
    det.push(ids[0])
    with pytest.raises(DetokenizeRefused) as err:
        det.push(ids[1])
    assert err.value.kind == "stream_finished"


def test_an_empty_stop_string_is_refused():
    # "" matches everywhere: every answer would be empty.
    with pytest.raises(DetokenizeRefused) as err:
        IncrementalDetokenizer(lambda ids: "", stop=["x", ""])
    assert err.value.kind == "empty_stop"


# --- special tokens -------------------------------------------------------------------


def test_special_tokens_are_hidden_unless_asked(tok):
    # "<|im_end|>" at the end of every answer is markup, not text.
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Paris.", add_special_tokens=False) + [eos]
    decode = lambda i: tok.decode(i, skip_special_tokens=False)  # noqa: E731
    hidden = IncrementalDetokenizer(decode, special_ids=tok.all_special_ids)
    assert "".join(stream(hidden, ids)) == "Paris."
    shown = IncrementalDetokenizer(decode, special_ids=tok.all_special_ids, show_special=True)
    assert "".join(stream(shown, ids)) == "Paris.<|im_end|>"


def test_the_prompt_tail_gives_the_first_token_its_leading_space():
    # A Metaspace decoder drops the leading space of a decode: "Hello" + "world" would glue.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    assert sp.decode([2]) == "world"
    det = IncrementalDetokenizer(sp.decode, prompt_ids=[1])
    assert "".join(stream(det, [2, 3])) == " world!"
