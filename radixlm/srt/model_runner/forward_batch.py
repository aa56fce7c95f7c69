"""What one forward pass computes: a flat batch of tokens and where their KV goes.

Tokens of all requests are concatenated (request i owns `extend_seq_lens[i]` consecutive
tokens). For request i, the tokens being computed occupy positions
`[extend_prefix_lens[i], seq_lens[i])` and their KV is written to `out_cache_loc`;
the earlier KV (the cached prefix) is read through `req_to_token[req_pool_indices[i]]`.
A decode batch is the special case extend_seq_lens == 1.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from radixlm.kernels.indices import build_kv_indices
from radixlm.srt.model_runner.device_tensor import device_tensor, to_device


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, with or without a cached prefix (chunked prefill included)
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot of each new token
    req_pool_indices: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int64 [B]: KV length after this forward
    extend_prefix_lens: torch.Tensor  # int64 [B]: KV already in the pool
    extend_seq_lens: torch.Tensor  # int64 [B]: tokens computed now
    req_to_token: torch.Tensor  # int64 [num_req_slots, max_context_len] (the pool's table, on the host)
    # Python copies of the small per-request vectors: attention backends loop over them.
    seq_lens_cpu: list[int] = field(default_factory=list)
    req_pool_indices_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    # Filled by the attention backend's init_forward_metadata (backend-private).
    attn_metadata: object = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def host_kv_indices(self, lens: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The first lens[b] KV slots of each request, concatenated, gathered on the host
        from the batch's host-side vectors (so the device is never waited for)."""
        return build_kv_indices(self.req_to_token, torch.tensor(self.req_pool_indices_cpu, dtype=torch.int64),
                                torch.tensor(lens, dtype=torch.int64), max(lens, default=0), dtype)

    @staticmethod
    def build(mode: ForwardMode, input_ids: list[int], out_cache_loc: torch.Tensor,
              req_pool_indices: list[int], prefix_lens: list[int], extend_lens: list[int],
              req_to_token: torch.Tensor, device: str | torch.device = "cpu") -> "ForwardBatch":
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        positions: list[int] = []
        for p, e in zip(prefix_lens, extend_lens):
            positions.extend(range(p, p + e))

        def t(x: list[int]) -> torch.Tensor:
            return device_tensor(x, torch.int64, device)

        return ForwardBatch(
            mode=mode, input_ids=t(input_ids), positions=t(positions),
            out_cache_loc=to_device(out_cache_loc, device, torch.int64),
            req_pool_indices=t(req_pool_indices), seq_lens=t(seq_lens),
            extend_prefix_lens=t(prefix_lens), extend_seq_lens=t(extend_lens),
            req_to_token=req_to_token, seq_lens_cpu=seq_lens, req_pool_indices_cpu=list(req_pool_indices),
            extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=list(extend_lens))
