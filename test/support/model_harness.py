"""A minimal driver for the model + KV pool + attention backend (no scheduler).

It allocates KV slots and request rows by hand, builds ForwardBatch objects and returns
logits, which is all the model-level tests need to compare against transformers (on the
CPU) or one backend against another (test/gpu, with device="cuda").
"""
from __future__ import annotations

import torch

from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.srt.model_runner.attention.base import create_attention_backend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool


class ModelHarness:
    def __init__(self, model, dtype: torch.dtype = torch.float32, capacity: int = 4096,
                 max_reqs: int = 16, max_context: int = 2048, backend: str = "torch_native",
                 device: str = "cpu") -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.kv_pool = MHATokenToKVPool(capacity, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                        cfg.head_dim, dtype, device)
        self.allocator = TokenToKVPoolAllocator(capacity)  # slots are handed out on the CPU
        self.req_pool = ReqToTokenPool(max_reqs, max_context, device)
        self.attn = create_attention_backend(backend, self.kv_pool, cfg.num_attention_heads,
                                             cfg.num_key_value_heads, cfg.head_dim)
        self.lens: dict[int, int] = {}  # request row -> tokens in the KV pool

    def new_request(self) -> int:
        row = self.req_pool.alloc()
        assert row is not None, "out of request rows"
        self.lens[row] = 0
        return row

    def free(self, row: int) -> None:
        n = self.lens.pop(row)
        self.allocator.free(self.req_pool.req_to_token[row, :n].clone())
        self.req_pool.free(row)

    def _run(self, mode: ForwardMode, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        lens = [len(c) for c in chunks]
        loc = self.allocator.alloc(sum(lens))
        assert loc is not None, "out of KV slots"
        loc = loc.to(self.device)
        prefix = [self.lens[r] for r in rows]
        start = 0
        for r, p, n in zip(rows, prefix, lens):
            self.req_pool.req_to_token[r, p:p + n] = loc[start:start + n]
            self.lens[r] = p + n
            start += n
        fb = ForwardBatch.build(mode, [t for c in chunks for t in c], loc, rows, prefix, lens,
                                self.req_pool.req_to_token, self.device)
        with torch.inference_mode():
            self.attn.init_forward_metadata(fb)
            hidden = self.model(fb, self.attn)
            return self.model.compute_logits(hidden)

    def extend(self, rows: list[int], chunks: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len(chunk), vocab] of every new token, per request."""
        logits = self._run(ForwardMode.EXTEND, rows, chunks)
        return list(logits.split([len(c) for c in chunks]))

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [B, vocab] of one new token per request."""
        return self._run(ForwardMode.DECODE, rows, [[t] for t in tokens])
