"""Turning model output into normal text and tool calls, incrementally.

`ToolCallStream.feed(delta)` takes the next piece of output text and returns events:

    Text(text)                      normal text, safe to show
    CallStart(index, id, name)      a call's function name is known
    CallArgs(index, fragment)       more of its arguments' raw JSON text
    CallEnd(index)                  the call object is complete

The concatenated fragments of a call are exactly the JSON text the model wrote for the
arguments, so streamed and non-streamed answers carry the same `arguments` string. Text
that might still turn out to be part of a call (a marker's beginning, an object before its
name is known) is held back until the next piece decides it; text that turns out not to be
a call (no "name", an unknown function, not JSON) is released as normal text. `parse()` runs
the same machine over a whole output, so the two paths cannot disagree.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Union

from radixlm.srt.function_call.formats import ARGUMENT_KEYS, ToolCallFormat
from radixlm.srt.function_call.json_scan import object_members, skip_ws


@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    fragment: str


@dataclass
class CallEnd:
    index: int
    complete: bool = True  # False: the output ended (or broke) inside the call


Event = Union[Text, CallStart, CallArgs, CallEnd]


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str
    complete: bool = False


@dataclass
class ParseResult:
    content: str | None  # None when there is no normal text (OpenAI's content: null)
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _NotACall(Exception):
    """The region being parsed is not a tool call after all."""


# parser states
_TEXT, _OPEN_ARRAY, _OBJECT, _AFTER_OBJECT = "text", "open_array", "object", "after_object"


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat, tool_names: set[str] | None = None) -> None:
        self.fmt = fmt
        self.tool_names = tool_names  # None: accept any name
        self.text = ""
        self.pos = 0  # text[:pos] is decided: released as text or part of a sent call
        self.state = _TEXT
        self.at_start_open = fmt.at_start is not None  # the first-character rule still applies
        self.region_start = 0  # where the undecided part of a tool-call region begins
        self.marker_from = 0  # markers before this index were already judged not calls
        self.index = 0  # the next call's index
        self.started = False  # the current object's CallStart was sent
        self.args_sent = 0  # characters of the current object's arguments sent
        self.any_call = False

    # ------------------------------------------------------------------ public
    def feed(self, delta: str, final: bool = False) -> list[Event]:
        self.text += delta
        events: list[Event] = []
        while self._step(events, final):
            pass
        if final:
            self._finish(events)
        return [e for e in events if not (isinstance(e, Text) and not e.text)]

    def parse(self, text: str) -> ParseResult:
        """A whole output at once: normal text and the complete calls. The raw text of a call
        left unfinished (the output was cut off) stays in the content."""
        calls: dict[int, ParsedCall] = {}
        content = ""
        for e in self.feed(text, final=True):
            if isinstance(e, Text):
                content += e.text
            elif isinstance(e, CallStart):
                calls[e.index] = ParsedCall(e.id, e.name, "")
            elif isinstance(e, CallArgs):
                calls[e.index].arguments += e.fragment
            elif isinstance(e, CallEnd):
                calls[e.index].complete = e.complete
                if not e.complete:
                    content += self.text[self.region_start:]
        content = content.strip()
        return ParseResult(content or None, [c for c in calls.values() if c.complete])

    # ------------------------------------------------------------------ machine
    def _step(self, events: list[Event], final: bool) -> bool:
        """Advance as far as the text allows; True when another step may make progress."""
        try:
            if self.state == _TEXT:
                return self._step_text(events, final)
            if self.state == _OPEN_ARRAY:
                return self._step_open_array()
            if self.state == _OBJECT:
                return self._step_object(events)
            return self._step_after_object()
        except (_NotACall, ValueError):
            self._not_a_call(events)
            return True

    def _emit_text(self, events: list[Event], end: int) -> None:
        piece = self.text[self.pos:end]
        # blank text between or after calls is layout, not content
        if piece and not (self.any_call and not piece.strip()):
            events.append(Text(piece))
        self.pos = max(self.pos, end)

    def _open_region(self, at: int, body: int) -> None:
        self.region_start = at
        self.pos = body
        self.state = _OPEN_ARRAY if self.fmt.container == "array" else _OBJECT

    def _step_text(self, events: list[Event], final: bool) -> bool:
        fmt = self.fmt
        if self.at_start_open:
            j = skip_ws(self.text, self.pos)
            if j >= len(self.text):
                return False  # only blanks so far: the first character decides
            head = self.text[j:]
            if not final and any(m.startswith(head) and m != head for m in fmt.start_markers):
                return False  # maybe a marker that begins with the same character ("[TOOL_CALLS]")
            self.at_start_open = False
            if self.text[j] == fmt.at_start and not any(head.startswith(m) for m in fmt.start_markers):
                self._open_region(self.pos, j)
                return True
        base = max(self.pos, self.marker_from)
        rest = self.text[base:]
        hits = [(rest.find(m), m) for m in fmt.start_markers if m in rest]
        if hits:
            at, marker = min(hits)
            self._emit_text(events, base + at)
            self._open_region(base + at, base + at + len(marker))
            return True
        hold = 0 if final else max((k for m in fmt.start_markers for k in range(len(m) - 1, 0, -1)
                                    if rest.endswith(m[:k])), default=0)
        self._emit_text(events, len(self.text) - hold)
        return False

    def _step_open_array(self) -> bool:
        j = skip_ws(self.text, self.pos)
        if j >= len(self.text):
            return False
        if self.text[j] != "[":
            raise _NotACall()
        self.pos = j + 1
        self.state = _OBJECT
        return True

    def _step_object(self, events: list[Event]) -> bool:
        j = skip_ws(self.text, self.pos)
        if j >= len(self.text):
            return False
        if self.text[j] != "{":
            raise _NotACall()
        scan = object_members(self.text, j)
        name = scan.get("name")
        if not self.started and name is not None and name.value_end is not None:
            value = json.loads(self.text[name.value_start:name.value_end], strict=False)
            if not isinstance(value, str) or (self.tool_names is not None and value not in self.tool_names):
                raise _NotACall()
            events.append(CallStart(self.index, new_call_id(), value))
            self.started = self.any_call = True
        args = scan.get(*ARGUMENT_KEYS)
        if self.started and args is not None:
            end = args.value_end if args.value_end is not None else len(self.text)
            fragment = self.text[args.value_start + self.args_sent:end]
            if fragment:
                events.append(CallArgs(self.index, fragment))
                self.args_sent += len(fragment)
        if scan.end is None:
            return False
        if not self.started:
            raise _NotACall()  # a complete object without a name
        if args is None:
            events.append(CallArgs(self.index, "{}"))
        self._end_call(events, complete=True)
        self.pos = scan.end
        self.state = _AFTER_OBJECT
        return True

    def _end_call(self, events: list[Event], complete: bool) -> None:
        events.append(CallEnd(self.index, complete))
        self.index += 1
        self.started, self.args_sent = False, 0

    def _step_after_object(self) -> bool:
        fmt = self.fmt
        j = skip_ws(self.text, self.pos)
        if j >= len(self.text):
            return False
        rest = self.text[j:]
        if fmt.container == "tagged":
            if rest.startswith(fmt.end_marker):
                j += len(fmt.end_marker)
            elif fmt.end_marker.startswith(rest):
                return False  # the end tag is still arriving
            self._back_to_text(j)  # (a missing end tag is forgiven)
            return True
        sep, close = (";", None) if fmt.container == "sequence" else (",", "]")
        if rest[0] == sep:
            self.region_start = j
            self.pos = j + 1
            self.state = _OBJECT
        else:
            self._back_to_text(j + 1 if rest[0] == close else self.pos)
        return True

    def _back_to_text(self, at: int) -> None:
        self.pos = self.region_start = at
        self.state = _TEXT

    def _not_a_call(self, events: list[Event]) -> None:
        """What was taken for a tool-call region is not one: its undecided part is released
        as text, and markers inside it are not taken for calls again."""
        if self.started:  # a call already sent cannot be taken back: it ends broken here,
            self._end_call(events, complete=False)  # and what the scan had not judged is dropped
            self.region_start = self.pos = len(self.text)
        else:
            self.pos = min(self.pos, self.region_start)
        self.marker_from = self.region_start + 1
        self.state = _TEXT

    def _finish(self, events: list[Event]) -> None:
        """The output ended: flush held text; a region cut off before its call's name is
        text, one cut off inside a call ends that call incomplete."""
        if self.state == _OBJECT and self.started:
            self._end_call(events, complete=False)
            return
        if self.state in (_OBJECT, _OPEN_ARRAY):
            self.pos = min(self.pos, self.region_start)
        if self.state != _AFTER_OBJECT:
            self._emit_text(events, len(self.text))
