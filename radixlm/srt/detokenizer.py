"""Incremental detokenization: UTF-8-safe text deltas and stop-string trimming.

Text is released only when it can no longer change: a trailing replacement character
means a multi-byte character is split across tokens, and a tail that could still grow into
a stop string is held back until the next tokens decide it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.stop_regex import first_match, partial_start

@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    stop_regex: list[str] = field(default_factory=list)
    # a non-streamed request (DetokParams.text_at_end): its manager holds the ids until the end
    text_at_end: bool = False

    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded, stable text so far (before stop trimming)
    sent: int = 0  # characters of `text` already released
    # ids[prefix_offset:read_offset] were decoded last time; decoding from prefix_offset
    # again lets tokens merge across the boundary (byte-fallback, leading spaces).
    prefix_offset: int = 0
    read_offset: int = 0
    stopped: bool = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def hold(self, new_ids: list[int]) -> None:
        """Append tokens without decoding them: the next add decodes them with its own."""
        if not self.stopped:
            self.ids.extend(new_ids)

    def add(self, new_ids: list[int], finished: bool) -> str:
        """Append tokens; return the newly released text."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(finished)

    def _release(self, finished: bool) -> str:
        end = len(self.text)
        if self.stop or self.stop_regex:
            hit = self._first_stop()
            if hit is not None:
                start, stop_end = hit
                end = stop_end if self.no_stop_trim else start
                self.stopped = True
            elif not finished:
                end -= self._held_back()
                end = min(end, self._regex_hold_start())
        end = max(end, self.sent)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _first_stop(self) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string or stop regex match in the text."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            # a stop string cannot lie entirely inside text already released
            pos = self.text.find(s, max(0, self.sent - len(s) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, pos + len(s))
        if self.stop_regex:
            try:
                # released text never holds the start of a (partial) match: search after it
                m = first_match(self.stop_regex, self.text, self.sent)
            except TimeoutError:  # the scheduler fails such a request; release as plain text
                m = None
            if m is not None and (best is None or m[0] < best[0]):
                best = (m[0], m[1])
        return best

    def _regex_hold_start(self) -> int:
        """Where text that more tokens could still turn into a stop_regex match begins."""
        if not self.stop_regex:
            return len(self.text)
        try:
            start = partial_start(self.stop_regex, self.text, self.sent)
        except TimeoutError:
            return len(self.text)
        return len(self.text) if start is None else start

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    @property
    def output_text(self) -> str:
        return self.text[:self.sent]


def for_params(tokenizer, p) -> IncrementalDetokenizer:
    """A request's detokenizer from its DetokParams (radixlm.messages)."""
    return IncrementalDetokenizer(tokenizer, list(p.stop), p.skip_special_tokens, p.no_stop_trim,
                                  p.spaces_between_special_tokens, list(p.stop_regex), p.text_at_end)


def released_text(tokenizer, p, ids: list[int]) -> str:
    """The text a streaming detokenizer would have released for `ids` of an unfinished
    request with DetokParams `p`: all of it but a split UTF-8 character at the end, a tail that
    may still become a stop string, and whatever follows a stop string."""
    return for_params(tokenizer, p).add(ids, finished=False)
