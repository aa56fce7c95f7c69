"""GGUF files: metadata -> ModelConfig, tensors -> Hugging Face state-dict names.

Metadata is read with a small parser of our own rather than `gguf.GGUFReader`, because
the reader materialises every element of the 100k-entry tokenizer arrays as numpy
views (~2 s for SmolLM2), while the config needs a dozen scalars. Tensors are still
dequantized with `gguf.quants.dequantize`.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

import radixlm.envs as envs
from radixlm.config import ModelConfig
from radixlm.srt.weights.gemma_config import GEMMA_GGUF_ARCHS, gemma_gguf_config

_GGUF_MAGIC = b"GGUF"

# GGUF value type id -> (struct format, byte size) for the fixed-size scalars.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_OF: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
                             6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# Architectures we can run, GGUF name -> Hugging Face class name.
GGUF_ARCHS: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "phi3": "Phi3ForCausalLM"}
GGUF_ARCHS.update(GEMMA_GGUF_ARCHS)  # Gemma 2/3: their fields from gemma_config.gemma_gguf_config
# Tensors that are rope parameters, not weights: read into the config (gguf_rope).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_F32 = 0  # GGML type id of float32
# ---- Qwen3 and Qwen3-MoE (llama.cpp's qwen3 / qwen3moe) ----
GGUF_ARCHS.update({"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"})


def _gguf_moe_fields(meta: "GGUFMetadata", arch: str, path: str) -> dict[str, Any]:
    """ModelConfig's expert fields of a qwen3moe file. llama.cpp runs every qwen3moe layer
    sparse and renormalises the top-k weights (its graph passes norm_w = true), so the file
    says nothing of decoder_sparse_step, mlp_only_layers or norm_topk_prob."""
    if arch != "qwen3moe":
        return {}
    fields = {k: meta.get(f"{arch}.{k}") for k in ("expert_count", "expert_used_count",
                                                    "expert_feed_forward_length")}
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    return dict(num_experts=int(fields["expert_count"]), num_experts_per_tok=int(fields["expert_used_count"]),
                moe_intermediate_size=int(fields["expert_feed_forward_length"]),
                norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)))


# Experts stored stacked, [experts, rows, cols] in numpy order: one Hugging Face tensor per expert.
_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_STACKED_RE = re.compile(r"^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")


def split_stacked_experts(gguf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A stacked expert tensor -> its experts under their Hugging Face names (copies: a saved
    file must not share storage); None for any other tensor."""
    m = _STACKED_RE.match(gguf_name)
    if m is None:
        return None
    layer, proj = m.group(1), _STACKED_EXPERTS[m.group(2)]
    return [(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", tensor[e].clone())
            for e in range(tensor.shape[0])]
# ---- end Qwen3 / Qwen3-MoE ----


@dataclass
class SkippedArray:
    """A string array we did not decode (tokenizer vocab/merges): only its length."""
    length: int


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order (fastest-varying dimension first)
    type_id: int
    offset: int = 0  # of its data in the file


@dataclass
class GGUFMetadata:
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)
    path: str = ""

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def small_f32(self, name: str) -> list[float]:
        """The values of a small float32 tensor (rope factors), read from the file."""
        info = self.tensors[name]
        if info.type_id != _F32:
            raise ValueError(f"{self.path}: GGUF tensor {name} is not float32 (type {info.type_id})")
        n = int(np.prod(info.shape))
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            return np.frombuffer(f.read(4 * n), dtype="<f4").astype(np.float64).tolist()


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, type_id: int) -> Any:
        fmt, size = _SCALARS[type_id]
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.scalar(10)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            elem, n = self.scalar(4), self.scalar(10)
            if elem == _STRING:
                # Only the tokenizer has big string arrays and we never need them here.
                if n > 1024:
                    for _ in range(n):
                        self.skip_string()
                    return SkippedArray(n)
                return [self.string() for _ in range(n)]
            if elem == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            dt = np.dtype(_NUMPY_OF[elem])
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).tolist()
            self.pos += n * dt.itemsize
            return arr
        if type_id not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {type_id}")
        return self.scalar(type_id)


def read_gguf_metadata(path: str) -> GGUFMetadata:
    """Parse the key/value header and the tensor directory (not the tensor data)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian or v1 file?)")
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        meta = GGUFMetadata(path=path)
        for _ in range(n_kv):
            key = cur.string()
            meta.fields[key] = cur.value(cur.scalar(4))
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar(4)
            shape = tuple(cur.scalar(10) for _ in range(n_dims))
            type_id = cur.scalar(4)
            offset = cur.scalar(10)  # from the start of the data section
            meta.tensors[name] = GGUFTensorInfo(name, shape, type_id, offset)
        align = int(meta.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        for info in meta.tensors.values():
            info.offset += data_start
        return meta


def gguf_model_config(path: str, meta: GGUFMetadata | None = None) -> ModelConfig:
    meta = meta or read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {sorted(GGUF_ARCHS)})")

    def need(key: str) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = tokens.length if isinstance(tokens, SkippedArray) else meta.tensors["token_embd.weight"].shape[1]
    max_pos = int(need("context_length"))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    rope_scaling = gguf_rope(meta, arch, max_pos)
    # Phi-3's sliding window, which radixlm does not run for it: every sequence fits inside it
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0) if arch == "phi3" else 0
    context_limit = window if 0 < window < max_pos else None
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    bos, pad = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.padding_token_id")
    config = ModelConfig(
        architecture=GGUF_ARCHS[arch], vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        # Stored as float32 (1e-5 reads back as 9.99999974e-06); keep the intended decimal.
        rms_norm_eps=float(f"{float(need('attention.layer_norm_rms_epsilon')):.7g}"),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=max_pos, partial_rotary_factor=rope_dims / head_dim, context_limit=context_limit,
        tie_word_embeddings="output.weight" not in meta.tensors,
        attention_bias=any(n.endswith("attn_q.bias") for n in meta.tensors),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(eos),
        pad_token_id=None if pad is None else int(pad), **_gguf_moe_fields(meta, arch, path))
    if arch in GEMMA_GGUF_ARCHS:  # Gemma 2/3
        config = gemma_gguf_config(config, arch, lambda key: meta.get(f"{arch}.{key}"))
    return config


def gguf_rope(meta: GGUFMetadata, arch: str, max_pos: int) -> dict | None:
    """The rope scaling of a GGUF file, in the Hugging Face form rope_scaling.py reads.

    llama.cpp's converter writes Llama 3.1's scaling as per-frequency divisors (the
    `rope_freqs` tensor: frequency i is theta_i / rope_freqs[i]) and Phi-3's longrope as the
    `rope_factors_short` / `rope_factors_long` tensors, with the original context length and
    the attention factor as metadata."""
    path = meta.path
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    scaling: dict | None = None
    if "rope_factors_long.weight" in meta.tensors:
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig is None:
            raise ValueError(f"{path}: GGUF rope_factors_long without {arch}.rope.scaling.original_context_length")
        scaling = {"rope_type": "longrope", "long_factor": meta.small_f32("rope_factors_long.weight"),
                   "short_factor": meta.small_f32("rope_factors_short.weight"),
                   "original_max_position_embeddings": int(orig)}
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attn is not None:
            scaling["attention_factor"] = float(attn)
    elif scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta.get(f"{arch}.rope.scaling.factor"))}
    elif scaling_type == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(meta.get(f"{arch}.rope.scaling.factor")),
                   "original_max_position_embeddings": int(meta.get(f"{arch}.rope.scaling.original_context_length")
                                                           or max_pos)}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported "
                         "(supported: none, linear, yarn, rope_freqs / rope_factors tensors)")
    if "rope_freqs.weight" in meta.tensors:
        scaling = dict(scaling or {"rope_type": "default"}, freq_factors=meta.small_f32("rope_freqs.weight"))
    return scaling


# ---- tensor names ----
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_BLOCK_NAMES.update({"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # qwen3, qwen3moe
                     "ffn_gate_inp": "mlp.gate"})  # the router of a qwen3moe block
# Gemma 2/3: "ffn_norm" is the pre-feed-forward norm, and three more norms.
_GEMMA_BLOCK_NAMES = dict(_BLOCK_NAMES, ffn_norm="pre_feedforward_layernorm",
                          post_attention_norm="post_attention_layernorm", post_ffw_norm="post_feedforward_layernorm",
                          attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
# Phi-3 keeps q/k/v and gate/up fused (ffn_up holds [gate; up]), as its checkpoints do.
_ARCH_BLOCK_NAMES = {"phi3": dict(_BLOCK_NAMES, attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj"),
                     **{a: _GEMMA_BLOCK_NAMES for a in GEMMA_GGUF_ARCHS}}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
        if part not in names:
            raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES or kind not in ("weight", "bias"):
        raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion reordering of q_proj/k_proj rows.

    Hugging Face Llama rotates the two halves of each head (rotate_half); llama.cpp
    rotates adjacent pairs, so its converter interleaves the halves: GGUF row 2i of a
    head is HF row i, GGUF row 2i+1 is HF row i + head_dim/2. Inverse: view each head
    as [head_dim/2, 2] rows and transpose to [2, head_dim/2]. Works for biases too.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def iter_gguf_weights(path: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every tensor to float32 and yield it under its Hugging Face name/shape."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    permuted = arch == "llama"  # convert_hf_to_gguf permutes q/k only for the llama family
    gemma = arch in GEMMA_GGUF_ARCHS
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue  # rope parameters, in the config (gguf_rope)
        stacked = _STACKED_RE.match(t.name) is not None
        name = "" if stacked else hf_name(t.name, arch)
        arr = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; numpy (and HF) order is the reverse.
        arr = arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        if not arr.flags.writeable:
            arr = arr.copy()  # F32 tensors come back as views of the read-only memmap
        tensor = torch.from_numpy(arr)
        if stacked:
            yield from split_stacked_experts(t.name, tensor) or ()
            continue
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_rope_rows(tensor, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_rope_rows(tensor, config.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            tensor = tensor - 1  # llama.cpp stores Gemma's norm scale 1 + w; the model adds the 1
        yield name, tensor


# ---- on-disk cache of converted GGUF artefacts ----
def cache_root() -> str:
    return envs.cache_dir()


def gguf_cache_dir(path: str) -> str:
    """Per-file cache folder, keyed by name + size + mtime so an edited file is never stale."""
    st = os.stat(path)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(path))
    return os.path.join(cache_root(), "gguf", f"{stem}-{st.st_size}-{st.st_mtime_ns}")
