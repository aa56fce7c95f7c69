"""Finding where JSON values end in text that may still be growing (streamed model output).

`value_end` answers "where does the JSON value starting here end?" with an index, None when
the text ends first (more may come), or ValueError when it cannot be JSON. `object_members`
does the same for an object and also reports each member's key and value span, which is
what a streaming tool-call parser needs: the function name as soon as its string is
complete, and the arguments' raw text as it grows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_LITERALS = ("true", "false", "null")
_NUMBER_CHARS = set("+-0123456789.eE")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] is the opening quote; index after the closing one."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value that starts at text[i] (no leading whitespace)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c == "{":
        return object_members(text, i).end
    if c == "[":
        j = skip_ws(text, i + 1)
        if j < len(text) and text[j] == "]":
            return j + 1
        while True:
            end = value_end(text, skip_ws(text, j))
            if end is None:
                return None
            j = skip_ws(text, end)
            if j >= len(text):
                return None
            if text[j] == "]":
                return j + 1
            if text[j] != ",":
                raise ValueError(f"expected , or ] at {j}")
            j += 1
    for lit in _LITERALS:
        if text.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(text[i:]):
            return None  # a literal cut off by the end of the text
    if c in _NUMBER_CHARS:
        j = i
        while j < len(text) and text[j] in _NUMBER_CHARS:
            j += 1
        return None if j == len(text) else j  # a number at the very end may go on
    raise ValueError(f"no JSON value starts at {i}: {c!r}")


@dataclass
class Member:
    key: str
    value_start: int
    value_end: int | None  # None: the value is still being written


@dataclass
class ObjectScan:
    members: list[Member]
    end: int | None  # index after the closing brace, None while open

    def get(self, *keys: str) -> Member | None:
        for m in self.members:
            if m.key in keys:
                return m
        return None


def object_members(text: str, i: int) -> ObjectScan:
    """Scan the object starting at text[i] == "{" as far as the text goes."""
    if i >= len(text) or text[i] != "{":
        raise ValueError(f"no JSON object starts at {i}")
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectScan(members, j + 1)
    while True:
        if j >= len(text):
            return ObjectScan(members, None)
        if text[j] != '"':
            raise ValueError(f"expected a key at {j}")
        key_end = _string_end(text, j)
        if key_end is None:
            return ObjectScan(members, None)
        key = json.loads(text[j:key_end], strict=False)
        j = skip_ws(text, key_end)
        if j >= len(text):
            return ObjectScan(members, None)
        if text[j] != ":":
            raise ValueError(f"expected : at {j}")
        start = skip_ws(text, j + 1)
        if start >= len(text):
            return ObjectScan(members, None)
        end = value_end(text, start)
        members.append(Member(key, start, end))
        if end is None:
            return ObjectScan(members, None)
        j = skip_ws(text, end)
        if j >= len(text):
            return ObjectScan(members, None)
        if text[j] == "}":
            return ObjectScan(members, j + 1)
        if text[j] != ",":
            raise ValueError(f"expected , or }} at {j}")
        j = skip_ws(text, j + 1)
