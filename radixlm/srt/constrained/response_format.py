"""OpenAI `response_format` → radixlm sampling params (for chat and completions).

    {"type": "text"}                                   -> {}
    {"type": "json_object"}                            -> {"json_schema": '{"type": "object"}'}
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                                                       -> {"json_schema": json.dumps(schema)}

Errors raise ValueError (the HTTP layer answers 400). The returned dict is merged into the
request's sampling params; it must not be combined with an explicit json_schema/regex/ebnf
(SamplingParams.verify rejects two constraints).
"""
from __future__ import annotations

import json
from typing import Any

# "Any JSON object": what OpenAI's JSON mode promises.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def response_format_to_sampling_params(response_format: Any) -> dict[str, str]:
    """The sampling-param entries (possibly none) that implement `response_format`.

    Accepts a dict or a pydantic model (anything with `model_dump`)."""
    if response_format is None:
        return {}
    if hasattr(response_format, "model_dump"):
        response_format = response_format.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        # OpenAI nests the schema under "schema"; some clients send it as "schema_"
        # (pydantic alias clash) or give the schema directly.
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            schema = {"type": "object"} if set(spec) <= {"name", "description", "strict"} else spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"response_format.json_schema.schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON object")
        return {"json_schema": json.dumps(schema)}
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
