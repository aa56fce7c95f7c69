"""Every RADIXLM_* environment variable, read here and nowhere else.

Each is read when asked (not at import), so a test or a launcher may set it first. Importing
any radixlm module leaves the process environment as it found it; the only variable radixlm
sets is for its own child processes (`CHILD_ENV`, given by the launcher).
"""
from __future__ import annotations

import os

__all__ = ["cpu_kernels_enabled", "hugepages_enabled", "mkldnn_pack_enabled", "bf16_gemm_enabled", "fused_decode_enabled",
           "float_gemm_forced", "num_threads",
           "cache_dir", "tp_backend", "CHILD_ENV"]

# The scheduler and detokenizer never reach the Hugging Face Hub: a serving machine may be
# offline, and a silent download of another tokenizer would be worse than an error. (Loading
# passes local_files_only too; the variable also covers what transformers reads at import.)
CHILD_ENV = {"HF_HUB_OFFLINE": "1"}


def _on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def cpu_kernels_enabled() -> bool:
    """RADIXLM_CPU_KERNELS=0: no native CPU kernels (torch ops everywhere)."""
    return _on("RADIXLM_CPU_KERNELS")


def hugepages_enabled() -> bool:
    """RADIXLM_HUGEPAGES=0: large CPU buffers without transparent huge pages."""
    return _on("RADIXLM_HUGEPAGES")


def mkldnn_pack_enabled() -> bool:
    """RADIXLM_MKLDNN_PACK=0: no oneDNN-prepacked bf16 linear weights."""
    return _on("RADIXLM_MKLDNN_PACK")


def bf16_gemm_enabled() -> bool:
    """RADIXLM_BF16_GEMM=0: bf16 linears through oneDNN instead of the native bf16 GEMM. (That
    GEMM runs on AMX tiles where the CPU has them; RADIXLM_BF16_AMX=0, read by the native
    library itself at its first GEMM, keeps it on AVX512-BF16.)"""
    return _on("RADIXLM_BF16_GEMM")


def fused_decode_enabled() -> bool:
    """RADIXLM_FUSED_DECODE=0: a decode step's layers through the Python layers (one native
    call per op) instead of one native call for all of them (kernels/cpu/decode_layers.cpp)."""
    return _on("RADIXLM_FUSED_DECODE")


def float_gemm_forced() -> bool | None:
    """RADIXLM_FLOAT_GEMM=0: never the native float GEMM; =1: on any AVX2 CPU; unset (None):
    where it was measured to win."""
    value = os.environ.get("RADIXLM_FLOAT_GEMM", "")
    return False if value == "0" else True if value == "1" else None


def num_threads() -> int | None:
    """RADIXLM_NUM_THREADS: torch's intra-op threads on CPU (default: torch's own choice)."""
    value = os.environ.get("RADIXLM_NUM_THREADS")
    return int(value) if value else None


def cache_dir() -> str:
    """RADIXLM_CACHE_DIR: dequantized GGUF weights, tokenizers, compiled kernels
    (default ~/.cache/radixlm)."""
    return os.environ.get("RADIXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")


def tp_backend() -> str:
    """RADIXLM_TP_BACKEND: the tensor-parallel ranks' collectives on CUDA (default nccl; gloo goes
    through host memory and lets ranks share one GPU, for testing on one)."""
    return os.environ.get("RADIXLM_TP_BACKEND") or "nccl"
