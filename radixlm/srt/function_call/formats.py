"""How each model family writes tool calls, and which one a server uses.

    qwen25 (aliases qwen, hermes)  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>  (repeated)
    llama3                         {"name": "f", "parameters": {...}}; {...}   (optionally after <|python_tag|>)
    mistral                        [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]
    forced (tool_choice required or a named function; no model family)
                                   [{"name": "f", "parameters": {...}}, ...]   (the grammar writes it)

The names are SGLang's `--tool-call-parser` values. Without the flag the parser is chosen
from the chat template (the tokens its tool-use section writes), else there is none and
`tool_choice: "auto"` answers plain text with no `tool_calls` (as SGLang does).
"""
from __future__ import annotations

from dataclasses import dataclass

# Keys a call object may carry its arguments under (families differ; the forced form uses "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    # Text that opens a tool-call region anywhere in the output.
    start_markers: tuple[str, ...] = ()
    # A region also opens when the output's first non-blank character is this.
    at_start: str | None = None
    # "tagged": one object per marker, closed by end_marker; "sequence": objects separated by
    # ";"; "array": a JSON array of objects.
    container: str = "tagged"
    end_marker: str | None = None


QWEN25 = ToolCallFormat("qwen25", start_markers=("<tool_call>",), container="tagged", end_marker="</tool_call>")
LLAMA3 = ToolCallFormat("llama3", start_markers=("<|python_tag|>",), at_start="{", container="sequence")
MISTRAL = ToolCallFormat("mistral", start_markers=("[TOOL_CALLS]",), at_start="[", container="array")
FORCED = ToolCallFormat("forced", at_start="[", container="array")

TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {"qwen25": QWEN25, "qwen": QWEN25, "hermes": QWEN25,
                                                "llama3": LLAMA3, "mistral": MISTRAL}
TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_FORMATS)

# Tokens a chat template's tool-use section writes, checked in this order.
_TEMPLATE_SIGNS = (("<tool_call>", QWEN25), ("[TOOL_CALLS]", MISTRAL), ("<|python_tag|>", LLAMA3))


def select_format(parser_name: str | None, chat_template: str | None) -> ToolCallFormat | None:
    """The flag's format, else the one the chat template shows, else None."""
    if parser_name:
        try:
            return TOOL_CALL_FORMATS[parser_name]
        except KeyError:
            raise ValueError(f"unknown tool-call parser {parser_name!r}; "
                             f"choose one of {', '.join(TOOL_CALL_PARSER_NAMES)}") from None
    template = chat_template if isinstance(chat_template, str) else ""
    for sign, fmt in _TEMPLATE_SIGNS:
        if sign in template:
            return fmt
    return None
