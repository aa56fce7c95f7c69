"""Grammars shared by the structured-output tests (test_structured_engine, the tensor-parallel
identity check)."""
from __future__ import annotations

REGEXES = [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(red|green|blue)( and (red|green|blue)){0,2}"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "pet": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["name", "age", "pet", "tags"], "additionalProperties": False}
