"""SGLang's /generate fields (its `GenerateReqInput`) beyond the ones radixlm implements.

SGLang's own clients (its serving benchmark, the Model Gateway, RL frameworks) send many of
them on every request, at their default values. Each field falls in one group:

- implemented: handled by generate_request.py (text, input_ids, logprobs and
  token_ids_logprob, bootstrap_*, extra_key and cache_salt as cache namespaces,
  stream_options, ...);
- NEUTRAL_FIELDS: features radixlm does not have (images, LoRA, routed experts,
  ...). Each is accepted at the value that asks for nothing (null, false, 0, an empty list);
  any other value is refused by name, never silently ignored;
- METADATA_FIELDS: labels that never change what is generated (tracing, metric labels,
  conversation ids), accepted with any value of their type and not used.

The Engine takes the same names as keyword arguments and checks them the same way
(`check_sglang_fields`), so a value refused by /generate is refused by the Engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from pydantic import BaseModel, ConfigDict, Field

from radixlm.validation import NonNegInt


def _absent(v: Any) -> bool:
    """null, or an empty or all-null container (a batch's per-prompt form of null)."""
    if v is None:
        return True
    if isinstance(v, (list, tuple)):
        return all(_absent(x) for x in v)
    return isinstance(v, dict) and not v


def _false(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_false(x) for x in v)
    return v is None or v is False


def _zero(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 0)


@dataclass(frozen=True)
class NeutralField:
    """An unsupported field and the value(s) at which it asks for nothing."""
    is_neutral: Callable[[Any], bool]
    accepted: str  # the neutral value in words, for the error message
    why: str = ""  # what to do instead, when there is something


_NULL = NeutralField(_absent, "null")
_FALSE = NeutralField(_false, "false")
_ZERO = NeutralField(_zero, "0 or null")
_DP = NeutralField(_zero, "0 or null",
                   "this server is one data-parallel rank; behind `radixlm serve --dp-size N` the "
                   "dispatcher routes by it")

NEUTRAL_FIELDS: dict[str, NeutralField] = {
    # multimodal input
    **dict.fromkeys(("input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
                     "video_config", "modalities", "positional_embed_overrides", "need_wait_for_mm_inputs",
                     "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
                     "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config"), _NULL),
    "use_audio_in_video": _FALSE,
    # outputs radixlm does not compute
    **dict.fromkeys(("return_sampling_mask", "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64",
                     "return_hidden_states", "return_routed_experts", "return_indexer_topk", "return_bytes",
                     "return_entropy", "return_prompt_token_ids"), _FALSE),
    "routed_experts_start_len": _ZERO,
    # features radixlm does not have
    **dict.fromkeys(("lora_path", "lora_id", "custom_logit_processor", "kv_router_hint",
                     "max_thinking_tokens", "multi_item_delimiter_indices", "bootstrap_pair_key", "decode_tp_size",
                     "http_worker_ipc"), _NULL),
    **dict.fromkeys(("background", "require_reasoning"), _FALSE),
    # data parallelism: the router's business (fleet/dispatcher.py honours them)
    **dict.fromkeys(("data_parallel_rank", "routed_dp_rank", "disagg_prefill_dp_rank"), _DP),
}

# Labels that never change the output: accepted (type-checked) and not used.
METADATA_FIELDS = frozenset({"model", "log_metrics", "no_logs", "session_id", "conversation_id", "routing_key",
                             "custom_labels", "external_trace_header", "received_time"})


def check_sglang_fields(fields: dict[str, Any]) -> None:
    """ValueError naming the first field that is unknown or set to a value radixlm cannot honour."""
    for name, value in fields.items():
        if name in METADATA_FIELDS:
            continue
        spec = NEUTRAL_FIELDS.get(name)
        if spec is None:
            raise ValueError(f"{name}: unknown field")
        if not spec.is_neutral(value):
            shown = repr(value)
            shown = shown[:60] + "..." if len(shown) > 60 else shown
            why = f"; {spec.why}" if spec.why else ""
            raise ValueError(f"{name}={shown} is not supported by radixlm (only {spec.accepted}){why}")


Flag = Union[bool, list[bool]]


class SGLangGenerateFields(BaseModel):
    """The /generate body's SGLang fields of the groups above, with their types (strict, as the
    rest of the body); the values are checked by `check_sglang_fields`."""
    model_config = ConfigDict(extra="forbid", strict=True)

    # metadata
    model: str | None = None  # the Model Gateway routes by it ("unknown" when the client named none)
    log_metrics: bool = True
    no_logs: bool = False  # radixlm never logs prompts or outputs
    session_id: str | None = None
    conversation_id: str | None = None
    routing_key: str | None = None
    custom_labels: dict[str, str] | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    # neutral-only: typed where the type is simple, else any JSON (only null passes anyway)
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: bool | None = None
    video_config: Any = None
    modalities: Any = None
    positional_embed_overrides: Any = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: Any = None
    return_sampling_mask: Flag | None = None
    return_flat_raw_top_logprobs: bool | None = None
    return_flat_raw_top_logprobs_b64: bool | None = None
    return_hidden_states: Union[bool, str, list[Union[bool, str]], None] = None
    return_routed_experts: bool | None = None
    routed_experts_start_len: NonNegInt | None = None
    return_indexer_topk: bool | None = None
    return_bytes: bool | None = None
    return_entropy: bool | None = None
    return_prompt_token_ids: bool | None = None
    lora_path: Union[str, list[str | None], None] = None
    lora_id: Union[str, list[str | None], None] = None
    custom_logit_processor: Union[str, list[str | None], None] = None
    kv_router_hint: dict[str, Any] | None = None
    max_thinking_tokens: int | None = None
    multi_item_delimiter_indices: Any = None
    bootstrap_pair_key: Union[str, list[str | None], None] = None
    decode_tp_size: Union[int, list[int | None], None] = None
    http_worker_ipc: str | None = None
    background: bool | None = None
    require_reasoning: bool | None = None
    data_parallel_rank: int | None = Field(default=None, ge=0)
    routed_dp_rank: int | None = Field(default=None, ge=0)
    disagg_prefill_dp_rank: int | None = Field(default=None, ge=0)

    def sglang_fields(self) -> dict[str, Any]:
        """The fields of this class the client set (null ones are as if absent)."""
        return {k: v for k in SGLangGenerateFields.model_fields if (v := getattr(self, k)) is not None}
