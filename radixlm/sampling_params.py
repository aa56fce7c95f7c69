"""Per-request sampling parameters: the fields, their defaults and their accepted inputs.

Each field's type is its validation (radixlm/validation.py builds the input model from
these annotations), so a new parameter is one line here. Validation raises ValueError with
a message that names the field, so the Engine can reject one bad request without touching
anybody else's.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from radixlm.validation import (AdditivePenalty, JsonSchemaInput, LogitBias, MinP, NonNegInt, PositiveInt,
                                MAX_NESTING_CEILING, RepetitionPenalty, Seed, Stop, StopRegexInput, Temperature,
                                TokenId, TopK, TopP, check_nesting, check_sampling_params, parse_sampling_params)

# top_k <= 0 means "whole vocabulary"; kept as a large sentinel so vector code needs no branch.
TOP_K_ALL = 1 << 30
# Structured-output constraints; at most one per request (the grammar queue compiles it).
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


@dataclass
class SamplingParams:
    max_new_tokens: NonNegInt = 128
    min_new_tokens: NonNegInt = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    frequency_penalty: AdditivePenalty = 0.0
    presence_penalty: AdditivePenalty = 0.0
    # a single string is accepted as input and kept as a one-element list
    stop: list[str] = field(default_factory=list, metadata={"input": Stop})
    stop_token_ids: list[TokenId] = field(default_factory=list)
    # Stop when the output matches one of these (SGLang's stop_regex; radixlm/stop_regex.py).
    stop_regex: list[str] = field(default_factory=list, metadata={"input": StopRegexInput})
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: PositiveInt = 1
    seed: Seed | None = None
    logit_bias: LogitBias | None = None
    # Structured output: a JSON schema (str or dict; kept as a JSON string), a regex or an
    # EBNF grammar. The grammar decides when the output is complete (finish_reason stop).
    json_schema: str | None = field(default=None, metadata={"input": JsonSchemaInput})
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        self.normalize()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Validated params from a dict (SGLang/vLLM/OpenAI names; null = default).
        Raises ValueError naming the bad field."""
        return cls(**parse_sampling_params(d))

    def normalize(self) -> None:
        """Canonical forms; idempotent (also run by __post_init__)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = list(self.stop_regex)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.top_k, int) and self.top_k <= 0:
            self.top_k = TOP_K_ALL
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.json_schema, (dict, bool)):
            check_nesting(self.json_schema, MAX_NESTING_CEILING, "json_schema")
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

    def verify(self, vocab_size: int | None = None, limits=None) -> None:
        """Types, ranges and cross-field rules (radixlm/validation.py); ValueError if bad."""
        check_sampling_params(self, vocab_size, limits)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
