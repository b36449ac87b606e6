"""Incremental detokenization of one choice, with OpenAI stop strings.

The engine reports token ids a few at a time; the client wants text deltas. `ChoiceText.add` decodes
the whole id list so far (simple, and correct for tokenizers whose decoding of a prefix is a prefix of the
decoding, as byte-level BPE is once complete characters are formed) and returns the part that is safe to
send now. Two things are held back until more tokens arrive or the choice ends:
  * a trailing U+FFFD: an incomplete UTF-8 sequence that the next byte-level token may complete;
  * a suffix that could be the start of a stop string (sending it would leak text that a stop truncates).

When a stop string appears, the text is cut right before it, `stopped` becomes True and the caller must
abort the engine request (the engine knows stop token ids only, not stop strings).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ChoiceText:
    """Text of one choice so far.

    Args:
      decode: token ids -> text (special tokens skipped).
      stop: stop strings (non-empty), any number.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.ids: list[int] = []  # every generated id received (usage counts these)
        self.text = ""  # decoded text, cut before a stop string once one appears
        self.sent = 0  # characters of `text` already returned as deltas
        self.stopped = False  # a stop string was found

    def add(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """Appends new ids; returns the text delta that can be sent now (all of the rest when `final`)."""
        if self.stopped:
            return ""
        before = len(self.text)
        self.ids.extend(int(t) for t in token_ids)
        full = self._decode(self.ids)
        if self._stop:
            # A new match can only start where the previous text could not already have contained it.
            start = max(0, min(before, len(full)) - self._max_stop + 1)
            hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text, self.stopped = full[: min(hits)], True
                return self._take(len(self.text))
        self.text = full
        return self._take(len(full) if final else self._safe_end(full))

    def _safe_end(self, full: str) -> int:
        end = len(full.rstrip("\ufffd"))
        # Hold back the longest suffix that is a proper prefix of a stop string.
        for k in range(min(self._max_stop - 1, end), 0, -1):
            tail = full[end - k : end]
            if any(s.startswith(tail) for s in self._stop):
                return end - k
        return end

    def _take(self, end: int) -> str:
        end = max(end, self.sent)  # never take back text already sent
        delta, self.sent = self.text[self.sent : end], end
        return delta
