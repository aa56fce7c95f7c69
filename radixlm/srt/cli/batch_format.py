"""The OpenAI Batch file format, as vLLM's `run-batch` reads and writes it.

Input, one JSON object a line:
    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output, one a line, in the order the requests finish:
    {"id": "radixlm-...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "radixlm-batch-...", "body": {...}}, "error": null}
A request that fails (a bad body, an unknown model, a full queue) has its HTTP status in
`response.status_code`, `response.body` null and the OpenAI error object in `error`
(`{"error": {"message", "type", "param", "code"}}`, what the server would have answered). A line
that is not a request at all (bad JSON, no custom_id, an unknown url) gets such an error line
too, with its custom_id when it has one, else null.
"""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

from radixlm.srt.http_utils import error_body

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
# OpenAI's default max_tokens of the completions API (what openai_serving applies too)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadLine(Exception):
    """A line that is not a request the batch can run: answered with an error line."""

    def __init__(self, message: str, custom_id: str | None, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.custom_id, self.status, self.param = message, custom_id, status, param


@dataclass
class BatchLine:
    number: int  # 1-based, for messages
    custom_id: str
    url: str
    body: dict[str, Any]

    def max_new_tokens(self) -> int | None:
        """An upper bound of the tokens this request generates (None: up to the context end,
        unknown before its prompt is tokenized); the progress bar's estimate."""
        body = self.body
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None and self.url == COMPLETIONS_URL:
            limit = COMPLETIONS_DEFAULT_MAX_TOKENS
        if not isinstance(limit, int):
            return None
        n_field = body.get("n")
        n = n_field if isinstance(n_field, int) else 1
        prompt = body.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        return limit * n * prompts


def parse_line(number: int, raw: str) -> BatchLine:
    """The request on input line `number`, or BadLine."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise BadLine(f"line {number}: malformed JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise BadLine(f"line {number}: expected a JSON object, got {type(obj).__name__}", None)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(f"line {number}: custom_id must be a non-empty string", None, param="custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise BadLine(f"line {number}: method must be POST, got {method!r}", custom_id, param="method")
    url = obj.get("url")
    if url not in URLS:
        raise BadLine(f"line {number}: url {url!r} is not supported (supported: {', '.join(URLS)})", custom_id,
                      param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine(f"line {number}: body must be a JSON object", custom_id, param="body")
    if body.get("stream"):
        raise BadLine(f"line {number}: stream is not supported in a batch", custom_id, param="stream")
    return BatchLine(number, custom_id, url, body)


def _ids() -> tuple[str, str]:
    return f"radixlm-{uuid.uuid4().hex}", f"radixlm-batch-{uuid.uuid4().hex}"


def success_record(custom_id: str, body: dict) -> dict:
    rid, request_id = _ids()
    return {"id": rid, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_record(custom_id: str | None, message: str, status: int = 400, param: str | None = None) -> dict:
    rid, request_id = _ids()
    return {"id": rid, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": None},
            "error": error_body(message, status, param)}


@dataclass
class ResumeState:
    """What an earlier run's output file already answers."""
    done_ids: set[str]
    unnamed_errors: int  # error lines with custom_id null: the input's first such bad lines


def read_resume_state(path: str) -> ResumeState:
    """The custom_ids present in `path` (an earlier run's output), after cutting off a line a
    crash left half-written, so that the run appends after the last whole line."""
    done: set[str] = set()
    unnamed = 0
    if not os.path.exists(path):
        return ResumeState(done, 0)
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    for line in data[:end].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        cid = rec.get("custom_id") if isinstance(rec, dict) else None
        if isinstance(cid, str):
            done.add(cid)
        elif isinstance(rec, dict):
            unnamed += 1
    return ResumeState(done, unnamed)
