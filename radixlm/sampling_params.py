"""Per-request sampling parameters: parsing, defaults and validation.

Validation raises ValueError with a message that names the field, so the Engine
can reject one bad request without touching anybody else's.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from radixlm.stop_regex import verify_stop_regex

# top_k <= 0 means "whole vocabulary"; kept as a large sentinel so vector code needs no branch.
TOP_K_ALL = 1 << 30
# Structured-output constraints; at most one per request (the grammar queue compiles it).
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop when the output matches one of these (SGLang's stop_regex; radixlm/stop_regex.py).
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    # Structured output: a JSON schema (str or dict; kept as a JSON string), a regex or an
    # EBNF grammar. The grammar decides when the output is complete (finish_reason stop).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        d = dict(d or {})
        # Aliases users bring from SGLang / vLLM / OpenAI.
        for alias, name in (("sampling_seed", "seed"), ("max_tokens", "max_new_tokens")):
            if alias in d:
                if name in d:
                    raise ValueError(f"sampling params: both {alias!r} and {name!r} given")
                d[name] = d.pop(alias)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if isinstance(d.get("stop_regex"), str):
            d["stop_regex"] = [d["stop_regex"]]
        if d.get("stop_regex") is None:
            d.pop("stop_regex", None)
        elif not isinstance(d["stop_regex"], (list, tuple)):
            raise ValueError("stop_regex must be a non-empty string or a list of them")
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        if d.get("max_new_tokens") is None:
            d.pop("max_new_tokens", None)
        params = cls(**d)
        params.normalize()
        return params

    def normalize(self) -> None:
        self.stop = list(self.stop)
        self.stop_regex = list(self.stop_regex)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k is None or self.top_k <= 0:
            self.top_k = TOP_K_ALL
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.json_schema, (dict, bool)):
            # a string is the compile-cache key; dumps keeps the property order the grammar follows
            self.json_schema = json.dumps(self.json_schema)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, grammar text) of the request's constraint, or None."""
        for kind in GRAMMAR_KINDS:
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
             f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        need(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens,
             f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}")
        need(self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        need(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(isinstance(self.top_k, int) and self.top_k >= 1, f"top_k must be -1 or >= 1, got {self.top_k}")
        need(0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(isinstance(self.n, int) and self.n >= 1, f"n must be a positive integer, got {self.n!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be a non-empty string or a list of them")
        if self.stop_regex:
            verify_stop_regex(self.stop_regex)
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        need(len(given) <= 1, f"only one of json_schema, regex and ebnf may be given, got {', '.join(given)}")
        for kind in given:
            spec = getattr(self, kind)
            need(isinstance(spec, str) and spec.strip() != "", f"{kind} must be a non-empty string")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            need(isinstance(schema, (dict, bool)), "json_schema must be a JSON object")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            need(not bad, f"stop_token_ids out of vocabulary range [0, {vocab_size}): {bad}")
            bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
            need(not bad, f"logit_bias token ids out of vocabulary range [0, {vocab_size}): {bad}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
