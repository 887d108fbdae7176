"""What text is safe to stream after one more token.

A server-sent stream cannot take text back, so every piece sent must already be final.
Three things make the newest text provisional:

* an incomplete character: byte-level tokenizers split multi-byte UTF-8 characters (CJK,
  emoji) across tokens, and the tokenizer's ``decode`` renders the unfinished bytes as
  U+FFFD. That text is held until the character completes;
* a possible stop string: a tail that could still grow into a stop string is held; a
  complete stop cuts the stream exactly where it starts and is reported;
* special tokens (EOS, padding, chat markup): never shown unless the caller asks.

Text is produced by the tokenizer's own ``decode(token_ids) -> str`` (passed in; bytes are
never decoded by hand) over a bounded window of recent ids, the way SGLang and vLLM do it:
``decode(window) - decode(window[:read])`` is the new text, and the window restarts at
each clean boundary. Per token the work is proportional to the new text, not to the
length of the output.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from moetray.policy.refused import Refused

__all__ = [
    "MAX_PENDING_TOKENS",
    "DetokenizeRefused",
    "IncrementalDetokenizer",
    "stop_prefix_holdback",
]

REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 4
"""A UTF-8 character is at most four bytes, so it spans at most four tokens. When more
tokens than this are pending and the text still ends in U+FFFD, some of those bytes can
never complete a character; the window is then cut at a clean token boundary."""
HARD_PENDING_TOKENS = 64
"""Beyond this many pending tokens with no clean boundary the window is committed as it
decodes, so the per-token cost stays bounded for any decoder."""


class DetokenizeRefused(Refused, ValueError):
    """A detokenizer call that cannot be honoured; nothing changed.

    ``.kind`` is ``empty_stop`` (a stop string of length 0 would match everywhere) or
    ``stream_finished`` (``push``/``finish`` after a stop matched or after ``finish``).
    """

    KINDS = ("empty_stop", "stream_finished")


def stop_prefix_holdback(text: str, stops: Iterable[str]) -> int:
    """How many trailing characters of ``text`` must be held because a stop could start there.

    Decides the length of the longest suffix of ``text`` that is a *proper* prefix of some
    stop string (0 when none). A suffix equal to a whole stop string is a match, not a
    prefix, and is not counted: the caller cuts there instead. Pure; refuses nothing.
    Characters, not bytes (Python strings never split a code point).
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[len(text) - k:]):
                longest = k
                break
    return longest


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest complete stop in ``text`` as ``(start, stop)``; ties go to the longer stop."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))):
            best = (at, stop)
    return best


class IncrementalDetokenizer:
    """Turns one request's sampled token ids into text that is safe to stream.

    ``decode`` is the tokenizer's own ``decode(token_ids) -> str``, called with special
    tokens rendered as text or not as the caller built it; this class never sees bytes.
    ``stop`` are the request's stop strings: the stream ends just before the first one
    that appears, and ``stopped`` names it. ``special_ids`` are ids that are never shown
    (EOS, padding, template markup) unless ``show_special`` is true; hidden ids do not
    enter the decode window at all. ``prompt_ids`` seed the window with the prompt's
    last few ids so the first sampled token decodes in context (SentencePiece-style
    decoders drop a leading space at the start of a decode).

    Guarantees: the concatenation of everything returned equals ``decode`` of all shown
    ids (cut at the matched stop); no U+FFFD of an unfinished character and no proper
    prefix of a stop string is ever returned before it is known to be final.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
        *,
        special_ids: Collection[int] = (),
        show_special: bool = False,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        stops = tuple(stop)
        if any(s == "" for s in stops):
            raise DetokenizeRefused("empty_stop", "a stop string must not be empty")
        self._decode = decode
        self._stops = stops
        self._hidden = frozenset(() if show_special else special_ids)
        seed = [t for t in prompt_ids if t not in self._hidden][-MAX_PENDING_TOKENS:]
        self._window: list[int] = seed  # ids from the prefix offset on
        self._read = len(seed)  # window[:read] is already accounted for
        self._base = decode(seed) if seed else ""  # decode(window[:read])
        self._committed = 0  # characters committed at clean token boundaries
        self._sent = 0  # characters handed to the stop stage (>= committed)
        self._held = ""  # stop-stage tail that could still start a stop string
        self._closed = False
        self.stopped: str | None = None
        """The stop string that ended the stream, or None."""
        self.decode_calls = 0
        """How many times ``decode`` ran (a counter for tests and telemetry)."""
        self.max_window = len(seed)
        """The longest id list ever passed to ``decode``: bounded, whatever the output length."""

    @property
    def finished(self) -> bool:
        """True once a stop matched or ``finish`` ran; further ``push`` calls are refused."""
        return self._closed

    def push(self, token_id: int) -> str:
        """Accept one sampled id; return the text that became safe to stream (maybe "").

        Mutates the window and the held tail. A matched stop closes the stream (see
        ``stopped``). Refuses with ``DetokenizeRefused("stream_finished")`` after the stream
        closed, before changing anything.
        """
        self._check_open()
        if token_id in self._hidden:
            return ""
        self._window.append(token_id)
        return self._release(self._advance(final=False), final=False)

    def finish(self) -> str:
        """End the stream: return the rest, unfinished characters and held stop prefixes included.

        Mutates (closes the stream). Refuses with ``DetokenizeRefused("stream_finished")``
        when already closed.
        """
        self._check_open()
        text = self._release(self._advance(final=True), final=True)
        self._closed = True
        return text

    # --- internals ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DetokenizeRefused("stream_finished", "the stream already ended")

    def _run_decode(self, ids: Sequence[int]) -> str:
        self.decode_calls += 1
        self.max_window = max(self.max_window, len(ids))
        return self._decode(ids)

    def _advance(self, *, final: bool) -> str:
        """Decode the window; return the newly stable text and move the window forward."""
        if len(self._window) == self._read:
            return ""
        full = self._run_decode(self._window)
        delta = full[len(self._base):]
        streamed = self._sent - self._committed  # characters of ``delta`` already handed on
        if final or (delta and not delta.endswith(REPLACEMENT)):
            self._commit(len(self._window), len(delta))
            return delta[streamed:]
        ready = len(delta.rstrip(REPLACEMENT))
        cut = None
        if len(self._window) - self._read > MAX_PENDING_TOKENS:
            cut = self._clean_cut(full)
            if cut is None and len(self._window) - self._read > HARD_PENDING_TOKENS:
                cut = (len(self._window), len(full))
            if cut is not None:
                ready = max(ready, cut[1] - len(self._base))
        out = delta[streamed:ready] if ready > streamed else ""
        self._sent += len(out)
        if cut is not None:
            self._commit(cut[0], cut[1] - len(self._base))
        return out

    def _clean_cut(self, full: str) -> tuple[int, int] | None:
        """The last pending token boundary that splits no character, as (index, chars before it).

        A boundary is clean when decoding the two sides separately gives the same text as
        decoding them together: a multi-byte character cut in two would turn into U+FFFD on
        both sides and break the equality.
        """
        for at in range(len(self._window) - 1, self._read, -1):
            left = self._run_decode(self._window[:at])
            if left + self._run_decode(self._window[at:]) == full and len(left) >= len(self._base):
                return at, len(left)
        return None

    def _commit(self, at: int, chars: int) -> None:
        """Fix ``chars`` characters (the text of ``window[read:at]``) as final.

        The window then restarts at the old read offset, so the next decode still has
        one step of context, and ``read`` moves to ``at``.
        """
        self._committed += chars
        self._sent = max(self._sent, self._committed)
        old_read = self._read
        self._window = self._window[old_read:]
        self._read = at - old_read
        self._base = self._run_decode(self._window[: self._read]) if self._read else ""

    def _release(self, new: str, *, final: bool) -> str:
        """Pass newly stable text through the stop stage; return what may be sent now."""
        if not self._stops:
            return new
        text = self._held + new
        hit = _first_stop(text, self._stops)
        if hit is not None:
            at, stop = hit
            self.stopped = stop
            self._held = ""
            self._closed = True
            return text[:at]
        keep = 0 if final else stop_prefix_holdback(text, self._stops)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]
