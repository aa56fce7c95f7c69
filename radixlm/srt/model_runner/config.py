"""What the model runner is configured with (built from ServerArgs by ServerArgs.runner_config)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["RunnerConfig"]


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str | None = None  # None: the default model
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    random_seed: int = 0
    # sizes (resolve_sizes): None picks a default from the device, the model and free memory
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.3
    page_size: int = 1
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None  # -1: no chunking
    # seconds a collective with a trainer's weight update group may wait (tensor-parallel ranks
    # get theirs from the process group)
    dist_timeout: float = 300.0

    def replace(self, **kw: Any) -> RunnerConfig:
        return dataclasses.replace(self, **kw)
