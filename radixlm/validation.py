"""Request validation: the one place that says which inputs radixlm accepts.

Every entry point goes through it: the Engine and /generate build `SamplingParams` from
`sampling_params_input_model()`, whose fields are the dataclass's own (types and ranges are
declared once, on `SamplingParams`), and the OpenAI request models use the same field types
from here. The rules:

- Types are strict: "5" is not an integer, 1.5 is not a seed, "no" is not a boolean, a float
  field takes an int. A wrong type is a `ValueError` (HTTP 400), never a crash later.
- `null` (None) means "the default", as in SGLang.
- Ranges are the ones the sampler honours: top_p in (0, 1] (a tiny top_p keeps the most
  likely token), temperature >= 0, logit_bias in [-100, 100] (OpenAI's range), finite floats.
- Costs have limits (`RequestLimits`, from server flags): n, sequences per call, top
  logprobs, grammar size, JSON nesting.

pydantic's ValidationError is a ValueError; `describe()` turns it into one readable line
and the OpenAI `param` (the first bad field).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

if TYPE_CHECKING:
    from radixlm.sampling_params import SamplingParams

# ---------------------------------------------------------------------------- field types
# Annotated types carry the range into the pydantic schema (and so into OpenAPI).
NonNegInt = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
# -1 and 0 both mean "the whole vocabulary" (SGLang says -1, vLLM 0).
TopK = Annotated[int, Field(ge=-1)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)]
AdditivePenalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
# The sampler mixes any integer into a 64-bit generator seed; more bits would be ignored.
Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)]
TokenId = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveSeconds = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]

# A stop string longer than this is rejected: the stop check decodes this many tokens a step.
MAX_STOP_CHARS = 1024
MAX_STOP_STRINGS = 64
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
Stop = Union[StopString, StopList]
# stop_regex patterns: sizes and syntax are checked by radixlm/stop_regex.verify_stop_regex
StopRegexInput = Union[Annotated[str, Field(min_length=1)], list[Annotated[str, Field(min_length=1)]]]


def _token_key(key: int | str) -> int:
    """A logit_bias key: JSON object keys are strings, Python callers give ints."""
    if isinstance(key, str):
        if not key.isdigit() or not key.isascii():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        key = int(key)
    if key < 0:
        raise ValueError(f"logit_bias keys must be token ids >= 0, got {key}")
    return key


BiasValue = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
LogitBias = dict[Annotated[Union[int, str], AfterValidator(_token_key)], BiasValue]
# A JSON schema as an object (or true/false), or its JSON text.
JsonSchemaInput = Union[str, dict[str, Any], bool]

STRICT = ConfigDict(strict=True, extra="forbid")
# No --max-json-nesting may exceed this: deeper values would reach Python's recursion limit
# in json.dumps, pydantic or xgrammar before any configurable check could run.
MAX_NESTING_CEILING = 256
_TYPE_TAGS = ("str", "int", "bool", "float", "dict", "list", "none")


def input_hint(f: dataclasses.Field, hints: dict[str, Any]) -> Any:
    """The type a field accepts as input: its metadata["input"] if set (when the stored form
    differs, e.g. a JSON schema kept as text), else its declared type."""
    return f.metadata.get("input", hints[f.name])


# ---------------------------------------------------------------------------- errors
def describe(err: ValidationError | list, prefix: str = "") -> tuple[str, str | None]:
    """One line for the client and the OpenAI `param` (the first bad field), from a
    ValidationError or its errors() list."""
    def path(e: Any) -> list[str]:
        parts = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path")]
        # union branches show up as type tags ("str", "list[int]", "constrained-str"): not fields
        # (and nested model names, "SamplingParamsInput"): field names are lower case
        return [p for p in parts if not any(c in p for c in "[]-") and p not in _TYPE_TAGS and not p[:1].isupper()]

    def where(parts: list[str]) -> str:
        return ".".join([prefix] + parts if prefix else parts)

    # One message per field: a union reports one error per branch; keep the most specific
    # (deepest) one, and call a plain branch mismatch what it is, a wrong type.
    by_field: dict[str, list[tuple[list[str], Any]]] = {}
    for e in (err if isinstance(err, list) else err.errors(include_url=False)):
        parts = path(e)
        by_field.setdefault(parts[0] if parts else "", []).append((parts, e))
    out, first = [], None
    for group in list(by_field.values())[:5]:
        depth = max(len(p) for p, _ in group)
        deepest = [(p, e) for p, e in group if len(p) == depth]
        # a value of one branch's type that breaks that branch's limit (a list of 1000 stop
        # strings) is that limit's error, not a wrong type
        fitting = [(p, e) for p, e in deepest if not str(e.get("type", "")).endswith("_type")]
        if len(fitting) == 1:
            deepest = fitting
        parts, e = deepest[0]
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif len(deepest) > 1:
            msg = "has the wrong type"
        if e.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif "input" in e and e.get("type") not in ("missing", "extra_forbidden", "too_long", "too_short"):
            shown = repr(e["input"])
            msg += f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"
        loc = where(parts)
        first = first if first is not None else loc
        out.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(out) or "invalid request", first or None


def value_error(err: ValidationError, prefix: str = "") -> ValueError:
    return ValueError(describe(err, prefix)[0])


# ---------------------------------------------------------------------------- sampling params
_ALIASES = (("max_tokens", "max_new_tokens"), ("sampling_seed", "seed"))
_INPUT_MODEL: type[BaseModel] | None = None


def resolve_aliases(d: Any) -> Any:
    """SGLang's other names of sampling fields (`sampling_seed`, `max_tokens`) as ours."""
    if not isinstance(d, dict):
        return d
    d = dict(d)
    for alias, name in _ALIASES:
        if alias in d:
            if d.get(name) is not None and d[alias] is not None:
                raise ValueError(f"sampling_params: both {alias!r} and {name!r} given")
            value = d.pop(alias)
            if d.get(name) is None:
                d[name] = value
    return d


class _SamplingParamsBase(BaseModel):
    model_config = STRICT
    _aliases = model_validator(mode="before")(resolve_aliases)


def sampling_params_input_model() -> type[BaseModel]:
    """The pydantic model of a sampling_params object, built from SamplingParams' fields:
    every field optional (null = default), strict, unknown names rejected."""
    global _INPUT_MODEL
    if _INPUT_MODEL is None:
        from radixlm.sampling_params import SamplingParams
        hints = typing.get_type_hints(SamplingParams, include_extras=True)
        fields: dict[str, Any] = {f.name: (Union[input_hint(f, hints), None], None)
                                  for f in dataclasses.fields(SamplingParams)}
        _INPUT_MODEL = create_model("SamplingParamsInput", __base__=_SamplingParamsBase, **fields)
    return _INPUT_MODEL


def parse_sampling_params(d: dict[str, Any] | None) -> dict[str, Any]:
    """The validated, non-null entries of a sampling_params dict (aliases resolved)."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
    d = resolve_aliases(d)
    try:
        model = sampling_params_input_model().model_validate(d)
    except ValidationError as e:
        raise value_error(e, "sampling_params") from None
    return {k: v for k, v in model.model_dump().items() if k in d and d[k] is not None}


def check_sampling_params(sp: "SamplingParams", vocab_size: int | None = None,
                          limits: "RequestLimits | None" = None) -> None:
    """Rules across fields, and those that need the model or the server's limits."""
    from radixlm.sampling_params import GRAMMAR_KINDS
    limits = limits or RequestLimits()

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(msg)

    # Fields may also have been set directly on the dataclass (Engine callers): retype them.
    try:
        sampling_params_input_model().model_validate(
            {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)})
    except ValidationError as e:
        raise value_error(e, "sampling_params") from None
    need(sp.min_new_tokens <= sp.max_new_tokens,
         f"min_new_tokens ({sp.min_new_tokens}) must be <= max_new_tokens ({sp.max_new_tokens})")
    if sp.stop_regex:
        from radixlm.stop_regex import verify_stop_regex
        verify_stop_regex(sp.stop_regex)
    need(sp.n <= limits.max_n, f"n must be at most {limits.max_n} (server flag --max-n), got {sp.n}")
    given = [k for k in GRAMMAR_KINDS if getattr(sp, k) is not None]
    need(len(given) <= 1, f"only one of json_schema, regex and ebnf may be given, got {', '.join(given)}")
    for kind in given:
        spec = getattr(sp, kind)
        need(isinstance(spec, str) and spec.strip() != "", f"{kind} must be a non-empty string")
        need(len(spec) <= limits.max_grammar_chars,
             f"{kind} has {len(spec)} characters, more than the limit of {limits.max_grammar_chars} "
             "(server flag --max-grammar-chars)")
    if sp.json_schema is not None:
        try:
            schema = json.loads(sp.json_schema)
        except RecursionError:
            raise ValueError(f"json_schema is nested deeper than {limits.max_json_nesting} levels") from None
        except ValueError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        need(isinstance(schema, (dict, bool)), "json_schema must be a JSON object")
        check_nesting(schema, limits.max_json_nesting, "json_schema")
    if vocab_size is not None:
        bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
        need(not bad, f"stop_token_ids out of vocabulary range [0, {vocab_size}): {bad[:5]}")
        bad = [t for t in (sp.logit_bias or {}) if not 0 <= t < vocab_size]
        need(not bad, f"logit_bias token ids out of vocabulary range [0, {vocab_size}): {bad[:5]}")


# ---------------------------------------------------------------------------- limits
@dataclass(frozen=True)
class RequestLimits:
    """Per-request cost limits; defaults are the server flags' defaults (built from ServerArgs by
    ServerArgs.request_limits)."""
    max_n: int = 128
    max_sequences_per_request: int = 8192
    max_top_logprobs_num: int = 20
    max_grammar_chars: int = 65536
    max_json_nesting: int = 64


def check_nesting(obj: Any, limit: int, what: str = "the request") -> None:
    """ValueError when lists/objects nest deeper than `limit` (checked without recursion, so
    a hostile depth cannot raise RecursionError anywhere downstream)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        if depth > limit:
            raise ValueError(f"{what} is nested deeper than {limit} levels (server flag --max-json-nesting)")
        stack.extend((c, depth + 1) for c in children)


def check_top_logprobs_num(n: int, limits: RequestLimits, name: str = "top_logprobs_num") -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {n!r}")
    if n > limits.max_top_logprobs_num:
        raise ValueError(f"{name} must be at most {limits.max_top_logprobs_num} "
                         f"(server flag --max-top-logprobs-num), got {n}")


def check_context(prompt_len: int, max_new_tokens: int | None, context_len: int) -> None:
    """The prompt must leave room for one token; an explicit max_new_tokens must fit in
    the context (SGLang's check; the OpenAI routes answer the same 400)."""
    if prompt_len >= context_len:
        raise ValueError(f"The input ({prompt_len} tokens) is longer than the model's context length "
                         f"({context_len} tokens).")
    if max_new_tokens is not None and prompt_len + max_new_tokens > context_len:
        raise ValueError(f"Requested token count exceeds the model's maximum context length of {context_len} "
                         f"tokens: {prompt_len} tokens in the prompt and {max_new_tokens} for the completion.")
