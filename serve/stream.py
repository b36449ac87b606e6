"""Incremental detokenization of one choice, with OpenAI stop strings, in O(new tokens) per report.

The engine reports token ids a few at a time; the client wants text deltas. Each new token is decoded in a
short window (vLLM's incremental detokenizer): with `prefix` the ids of the last emitted piece and `pending`
the ids not yet turned into text,

    piece = decode(prefix + pending)[len(decode(prefix)):]

is the token's text in context (tokenizers that join words with spaces, or that drop a leading space at the
start of a text, put the separator right). The piece is emitted once it does not end in U+FFFD: a byte-level
token may hold part of a UTF-8 character that the next token completes. A window never grows past
MAX_PENDING tokens (a run of special tokens that decode to nothing, or invalid UTF-8): then it is flushed as it
is. For byte-level BPE the text equals `decode(all ids)` exactly.

Two things are held back from the client until more tokens arrive or the choice ends:
  * an incomplete UTF-8 character (above);
  * a suffix that could be the start of a stop string (sending it would leak text that a stop truncates).
Stop strings are searched only in the new text plus the last `len(longest stop) - 1` characters before it, and
with `min_tokens` (vLLM's) only where they end past the text of the first min_tokens tokens.
When one appears, the text is cut right before it, `stopped` becomes True and the caller must abort the engine
request (the engine knows stop token ids only, not stop strings).

`ends[i]` is the length of the text once token i was decoded, so token i's text is `text[ends[i-1]:ends[i]]`
(empty while it was pending); logprobs use it to travel with their token's text and for `text_offset`.

`context`: ids that precede the text (an echoed prompt) and are decoded only as context for the first piece,
so that the text continues them as `decode(context + ids)` would (the space a SentencePiece or word-level
tokenizer puts between them).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

MAX_PENDING = 8  # tokens; a UTF-8 character is at most 4 bytes, so byte-level BPE never needs more than 3


class ChoiceText:
    """Text of one choice so far.

    Args:
      decode: token ids -> text (special tokens skipped).
      stop: stop strings (non-empty), any number.
      context: ids the text continues (their last MAX_PENDING are decoded with the first piece, not part of it).
      min_tokens: a stop string counts only where it ends after the text of the first min_tokens tokens.
      include_stop: the text ends after the stop string instead of before it (vLLM's include_stop_str_in_output;
        nothing is then held back for stop prefixes).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), context: Sequence[int] = (),
                 min_tokens: int = 0, include_stop: bool = False):
        self._decode = decode
        self._context = [int(t) for t in context[len(context) - MAX_PENDING :]] if len(context) else []
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self.ids: list[int] = []  # every generated id received (usage counts these)
        self.ends: list[int] = []  # text length after token i (cut at a stop)
        self.length = 0  # characters of text
        self.sent = 0  # characters already returned as deltas
        self.stopped = False  # a stop string was found
        self.visible = 0  # tokens that start before the end of the text (all of them unless stopped)
        self._pieces: list[str] = []
        self._unsent = ""  # text[sent:]
        self._tail = ""  # the last max_stop - 1 characters: where a stop string may have begun
        self._prefix = 0  # ids[_prefix:_read] produced the last emitted piece
        self._read = 0  # ids before this are text

    @property
    def text(self) -> str:
        """The decoded text (cut before a stop string once one appears)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """Appends new ids; returns the text delta that can be sent now (all of the rest when `final`)."""
        if self.stopped:
            return ""
        new = []
        for t in token_ids:
            self.ids.append(int(t))
            piece = self._next_piece(force=len(self.ids) - self._read >= MAX_PENDING)
            self.length += len(piece)
            self.ends.append(self.length)
            new.append(piece)
        if final and self._read < len(self.ids):  # the last pending bytes, as they are
            piece = self._next_piece(force=True)
            self.length += len(piece)
            self.ends[-1] = self.length
            new.append(piece)
        added = "".join(new)
        self._pieces.append(added)
        self._unsent += added
        self.visible = len(self.ids)
        if self._stop and added:
            window = self._tail + added
            base = self.length - len(window)  # where window[0] is in the text
            hits = []
            if len(self.ids) > self._min_tokens:
                floor = self.ends[self._min_tokens - 1] if self._min_tokens else 0  # a stop must end past it
                hits = [i + (len(s) if self._include_stop else 0)
                        for s in self._stop if (i := window.find(s, max(0, floor - base - len(s) + 1))) >= 0]
            if hits:  # the earliest cut: before the first stop to begin, or after the first to end
                self._cut(max(base + min(hits), self.sent))
                return self._take(self.length)
            self._tail = window[len(window) - self._max_stop + 1 :] if self._max_stop > 1 else ""
        return self._take(self.length if final else self._safe_end())

    def released(self) -> int:
        """How many tokens have all their text sent (a prefix of the tokens; never past a stop)."""
        return min(bisect.bisect_right(self.ends, self.sent), self.visible)

    def start(self, i: int) -> int:
        """Where token i's text begins in the text."""
        return self.ends[i - 1] if i > 0 else 0

    def _next_piece(self, *, force: bool) -> str:
        ctx = self._context if self._prefix == 0 else []  # only the first piece follows the context
        window = ctx + self.ids[self._prefix : self._read]
        prefix_text = self._decode(window) if window else ""
        new_text = self._decode(ctx + self.ids[self._prefix :])
        if (len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd")) or force:
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def _cut(self, cut: int) -> None:
        self._pieces = ["".join(self._pieces)[:cut]]
        self._unsent = self._unsent[: cut - self.sent]
        self.length, self.stopped = cut, True
        self.ends = [min(e, cut) for e in self.ends]
        self.visible = sum(1 for i in range(len(self.ids)) if self.start(i) < cut)

    def _safe_end(self) -> int:
        """The end of the text less its longest suffix that is a proper prefix of a stop string."""
        tail, end = self._tail, self.length
        if self._include_stop:  # a stop string is sent either way
            return end
        for k in range(min(self._max_stop - 1, len(tail)), 0, -1):
            if any(s.startswith(tail[len(tail) - k :]) for s in self._stop):
                return end - k
        return end

    def _take(self, end: int) -> str:
        end = max(end, self.sent)  # never take back text already sent
        delta, self._unsent = self._unsent[: end - self.sent], self._unsent[end - self.sent :]
        self.sent = end
        return delta
