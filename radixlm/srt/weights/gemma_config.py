"""config.json of a Gemma 2 or Gemma 3 checkpoint -> ModelConfig.

Gemma's configs differ from Llama's in where they keep things: Gemma 3 names each layer's kind
(`layer_types`, or older files a `sliding_window_pattern`) and gives the sliding layers their own
rope base (transformers >= 5 writes `rope_parameters` keyed by layer kind; older files
`rope_theta` + `rope_scaling` for the global layers and `rope_local_base_freq` for the local
ones); a Gemma3ForConditionalGeneration file nests the text model under `text_config`. Defaults
are those of transformers' Gemma2Config / Gemma3TextConfig, for keys a file leaves out.
"""
from __future__ import annotations

from typing import Any

from radixlm.config import ModelConfig
from radixlm.srt.weights.generation_config import model_eos_ids

GEMMA_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA_MODEL_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                     "gemma3": "Gemma3ForConditionalGeneration"}
ACTIVATIONS = ("gelu_pytorch_tanh", "silu")

# transformers' defaults for keys a config.json may omit.
_GEMMA3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072,
    query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
_GEMMA2_DEFAULTS: dict[str, Any] = dict(
    _GEMMA3_DEFAULTS, vocab_size=256000, max_position_embeddings=8192, sliding_window_pattern=2,
    rope_theta=10_000.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def _layer_types(cfg: dict, n_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types:
        if len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer_types {types!r}: expected {n_layers} of full_attention / sliding_attention")
        return tuple(types)
    # Every pattern-th layer global, the others local (transformers' rule).
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 0)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers))


def _rope(cfg: dict, defaults: dict) -> tuple[float, dict | None, float | None]:
    """(global rope_theta, global rope_scaling, local rope base or None)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # per layer kind
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling of the sliding layers ({local}) is not supported")
        theta = float(full.pop("rope_theta", cfg.get("rope_theta") or defaults["rope_theta"]))
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq")
                                      or defaults["rope_local_base_freq"]))
    else:
        full = dict(params)
        theta = float(full.pop("rope_theta", None) or cfg.get("rope_theta") or defaults["rope_theta"])
        local_theta = cfg.get("rope_local_base_freq")
        if cfg.get("rope_scaling"):
            full = dict(cfg["rope_scaling"])
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    return theta, scaling, None if local_theta is None else float(local_theta)


def gemma_model_config(model_dir: str, cfg: dict, arch: str) -> ModelConfig:
    text = dict(cfg.get("text_config") or {}) if arch == "Gemma3ForConditionalGeneration" else cfg
    defaults = _GEMMA2_DEFAULTS if arch == "Gemma2ForCausalLM" else _GEMMA3_DEFAULTS
    get = lambda key: text[key] if key in text else defaults.get(key)  # noqa: E731
    if text.get("use_bidirectional_attention"):
        raise ValueError(f"{model_dir}: use_bidirectional_attention (an embedding model) is not supported")
    act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"{model_dir}: hidden_activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    n_layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    rope_theta, rope_scaling, local_theta = _rope(text, defaults)
    if arch == "Gemma2ForCausalLM":
        local_theta = None  # one rope for every layer
    if "sliding_window_pattern" not in text and "_sliding_window_pattern" not in text:
        text = dict(text, sliding_window_pattern=defaults["sliding_window_pattern"])
    window = get("sliding_window")

    eos = model_eos_ids(cfg.get("eos_token_id") if cfg.get("eos_token_id") is not None else get("eos_token_id"),
                        model_dir)  # Gemma 3 also stops at <end_of_turn>, listed in the generation config
    softcap = lambda key: None if get(key) is None else float(get(key))  # noqa: E731
    return ModelConfig(
        architecture=arch, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")), num_hidden_layers=n_layers, num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim")),
        rms_norm_eps=float(get("rms_norm_eps")), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", get("tie_word_embeddings"))),
        attention_bias=bool(text.get("attention_bias", False)), bos_token_id=get("bos_token_id"),
        eos_token_ids=eos, pad_token_id=get("pad_token_id"), hidden_activation=act,
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        layer_types=_layer_types(text, n_layers) if window else (), sliding_window=int(window) if window else None,
        rope_local_base_freq=local_theta, attn_logit_softcapping=softcap("attn_logit_softcapping"),
        final_logit_softcapping=softcap("final_logit_softcapping"))


# ---- GGUF (llama.cpp's gemma2 / gemma3) ----
GEMMA_GGUF_ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp's Gemma 3 fixes what its files may leave out: every 6th layer global, the local rope
# base 10,000 (unscaled); Gemma 2 alternates, one rope.
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
_GGUF_LOCAL_BASE = {"gemma3": 10_000.0}
# Gemma 2/3 27B scale queries by hidden / heads, the others by head_dim; llama.cpp tells the 27B
# models by their depth, the files do not store query_pre_attn_scalar.
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gemma_gguf_config(base: ModelConfig, arch: str, get: Any) -> ModelConfig:
    """`base` (what the Llama-shaped keys gave) with Gemma's fields from GGUF metadata; `get(key)`
    reads `{arch}.{key}` (None when absent)."""
    import dataclasses

    n = base.num_hidden_layers
    window = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern") or _GGUF_PATTERN[arch]
    if isinstance(pattern, list):  # per layer: True = sliding
        if len(pattern) != n:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {n} layers")
        types = tuple("sliding_attention" if s else "full_attention" for s in pattern)
    else:
        types = tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n))
    local = get("rope.freq_base_swa") or _GGUF_LOCAL_BASE.get(arch)
    scalar = base.hidden_size / base.num_attention_heads if n == _GGUF_27B_LAYERS[arch] else base.head_dim
    cap = lambda key: None if get(key) is None else float(get(key))  # noqa: E731
    return dataclasses.replace(
        base, architecture=GEMMA_GGUF_ARCHS[arch], hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(scalar), layer_types=types if window else (),
        sliding_window=int(window) if window else None, rope_local_base_freq=None if local is None else float(local),
        attn_logit_softcapping=cap("attn_logit_softcapping"), final_logit_softcapping=cap("final_logit_softcapping"))
