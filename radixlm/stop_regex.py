"""Stop regexes: SGLang's `stop_regex` sampling parameter.

Generation stops when the decoded output matches one of the patterns; the text is trimmed
at the start of the match like a stop string (kept with `no_stop_trim`). The scheduler
decides the stop on the decoded tail of the output; the detokenizer trims, and while
streaming holds back a tail that could still grow into a match (`regex`'s partial
matching), so no text that a stop would cut is ever sent.

Patterns are compiled by the `regex` module (a superset of `re`'s syntax, with partial
matches and a match timeout). A pattern runs on every decode step of its request, so a
pathological one is cut off by `MATCH_TIMEOUT_S` and the request fails alone.
"""
from __future__ import annotations

import functools
import re

import regex

# Longest a single search may take before the request is failed (catastrophic backtracking).
MATCH_TIMEOUT_S = 0.05
MAX_PATTERN_CHARS = 2048
MAX_PATTERNS = 16


@functools.lru_cache(maxsize=512)
def compile_stop_regex(pattern: str) -> "regex.Pattern":
    return regex.compile(pattern)


@functools.lru_cache(maxsize=512)
def max_match_chars(pattern: str) -> int | None:
    """Upper bound on the characters one match spans, or None when unbounded (or when `re`
    cannot parse a `regex`-only pattern): bounds how much decoded tail the scheduler checks."""
    try:
        lo, hi = re._parser.parse(pattern).getwidth()  # type: ignore[attr-defined]
    except Exception:
        return None
    return None if hi >= 1 << 30 else int(hi)


def verify_stop_regex(patterns: list[str]) -> None:
    """ValueError naming the problem; patterns that can match the empty string are refused
    (they would stop every request before its first character)."""
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"stop_regex takes at most {MAX_PATTERNS} patterns, got {len(patterns)}")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError("stop_regex must be a non-empty string or a list of them")
        if len(p) > MAX_PATTERN_CHARS:
            raise ValueError(f"a stop_regex pattern may have at most {MAX_PATTERN_CHARS} characters")
        try:
            compiled = compile_stop_regex(p)
        except regex.error as e:
            raise ValueError(f"stop_regex {p!r} is not a valid regular expression: {e}") from None
        if compiled.fullmatch("") is not None:
            raise ValueError(f"stop_regex {p!r} matches the empty string")


def first_match(patterns: list[str] | tuple[str, ...], text: str, pos: int = 0) -> tuple[int, int, str] | None:
    """(start, end, pattern) of the earliest match at or after `pos` (the longest on a tie).
    Raises TimeoutError when a pattern backtracks for too long."""
    best: tuple[int, int, str] | None = None
    for p in patterns:
        m = compile_stop_regex(p).search(text, pos, timeout=MATCH_TIMEOUT_S)
        if m is not None and (best is None or (m.start(), -m.end()) < (best[0], -best[1])):
            best = (m.start(), m.end(), p)
    return best


def partial_start(patterns: list[str] | tuple[str, ...], text: str, pos: int = 0) -> int | None:
    """Where the earliest text that more output could turn into a match begins (a match
    running to the end of `text`, or one cut off by it), or None."""
    start: int | None = None
    for p in patterns:
        m = compile_stop_regex(p).search(text, pos, partial=True, timeout=MATCH_TIMEOUT_S)
        if m is None or m.start() == len(text):  # an empty partial match at the end holds nothing
            continue
        if (m.partial or m.end() == len(text)) and (start is None or m.start() < start):
            start = m.start()
    return start
